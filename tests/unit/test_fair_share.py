"""The fair share gate (`deployments.control.fair_share`) as pure asyncio: generations are fakes that finish when told."""

import asyncio

import pytest

from deployments.control.fair_share import FairShare


class Fleet:
    """A gate and generations that hold their place until `finish` ends them, oldest first per run, or any."""

    def __init__(self, budget: int, weights: dict[str, float] | None = None):
        weights = weights or {}
        self.gate = FairShare(budget, lambda run: weights.get(run, 1.0))
        self.admitted: list[str] = []  # runs, in the order their generations got a place
        self.running: list[tuple[str, asyncio.Event]] = []
        self.tasks: list[asyncio.Task] = []

    async def _generation(self, run: str, tokens: int) -> None:
        async with self.gate.slot(run) as used:
            done = asyncio.Event()
            self.admitted.append(run)
            self.running.append((run, done))
            await done.wait()
            used.prompt_tokens, used.completion_tokens = tokens, 2 * tokens

    async def submit(self, run: str, count: int, tokens: int = 1) -> list[asyncio.Task]:
        new = [asyncio.create_task(self._generation(run, tokens)) for _ in range(count)]
        self.tasks += new
        await settle()
        return new

    async def finish(self, run: str | None = None, count: int = 1) -> None:
        for _ in range(count):
            i = next(i for i, (r, _) in enumerate(self.running) if run in (None, r))
            self.running.pop(i)[1].set()
            await settle()

    def in_flight(self, run: str) -> int:
        return sum(r == run for r, _ in self.running)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def settle() -> None:
    for _ in range(5):  # a finish wakes the next waiter, whose task then runs up to its own await
        await asyncio.sleep(0)


def test_a_burst_of_one_run_does_not_delay_another_beyond_its_share():
    async def main():
        fleet = Fleet(budget=4)
        await fleet.submit("a", 40)  # the fleet was idle: a's burst takes every place, 36 wait
        assert fleet.in_flight("a") == 4 and fleet.gate.stats()["runs"]["a"]["queued"] == 36
        await fleet.submit("b", 3)
        assert fleet.in_flight("b") == 0
        await fleet.finish("a", 2)  # b's share of 4 is 2: the next two places are b's, not a's queue's
        assert fleet.in_flight("b") == 2 and fleet.admitted[-2:] == ["b", "b"]
        await fleet.finish("a")  # b holds its share: a's next
        assert fleet.admitted[-1] == "a" and fleet.in_flight("b") == 2
        await fleet.finish("b")  # b's third takes b's freed place
        assert fleet.admitted[-1] == "b" and fleet.in_flight("b") == 2
        await fleet.close()

    asyncio.run(main())


def test_weights_share_the_fleet_in_proportion_under_contention():
    async def main():
        fleet = Fleet(budget=8, weights={"a": 3.0, "b": 1.0})
        await fleet.submit("a", 200)
        await fleet.submit("b", 200)
        held = []
        for _ in range(120):
            await fleet.finish()  # the oldest generation in flight, whoever's
            held.append((fleet.in_flight("a"), fleet.in_flight("b")))
        assert set(held[10:]) == {(6, 2)}, held  # 3:1 of 8, after a's idle-fleet start drains
        later = fleet.admitted[40:]
        assert 2.5 <= later.count("a") / later.count("b") <= 3.5
        shares = {run: s["share"] for run, s in fleet.gate.stats()["runs"].items()}
        assert shares == {"a": 6.0, "b": 2.0}
        await fleet.close()

    asyncio.run(main())


def test_no_run_starves_however_small_its_weight():
    async def main():
        fleet = Fleet(budget=2, weights={"a": 100.0, "b": 1.0})
        await fleet.submit("a", 50)
        await fleet.submit("b", 5)
        await fleet.finish("a")  # b's share is 0.04 of a place: it holds none, so it gets this one
        assert fleet.in_flight("b") == 1
        await fleet.finish("a")  # now a's
        assert fleet.admitted[-1] == "a"
        await fleet.close()

    asyncio.run(main())


def test_the_gate_is_work_conserving_a_lone_run_uses_the_whole_fleet():
    async def main():
        fleet = Fleet(budget=4, weights={"a": 0.01, "b": 1.0})
        await fleet.submit("a", 10)  # a small weight, alone: all four places at once, nobody waits for nothing
        assert fleet.in_flight("a") == 4
        await fleet.submit("b", 2)
        await fleet.finish("a", 2)
        await fleet.finish("b", 2)  # b's burst is over: its places go back to a
        assert fleet.in_flight("a") == 4 and fleet.in_flight("b") == 0
        assert fleet.gate.stats()["in_flight"] == 4
        await fleet.close()

    asyncio.run(main())


def test_a_request_cancelled_while_waiting_frees_its_place_in_the_queue():
    async def main():
        fleet = Fleet(budget=1)
        await fleet.submit("a", 1)
        gone, kept = await fleet.submit("b", 2)
        gone.cancel()  # the client went away
        await settle()
        assert fleet.gate.stats()["runs"]["b"]["queued"] == 1
        await fleet.finish("a")
        assert fleet.admitted == ["a", "b"] and not kept.done()  # the one left got the place
        stats = fleet.gate.stats()
        assert stats["in_flight"] == 1 and stats["runs"]["b"]["queued"] == 0
        await fleet.close()

    asyncio.run(main())


def test_a_request_cancelled_just_as_it_was_granted_a_place_passes_it_on():
    async def main():
        fleet = Fleet(budget=1)
        await fleet.submit("a", 1)
        (granted,) = await fleet.submit("b", 1)
        await fleet.submit("c", 1)
        fleet.running.pop()[1].set()  # a ends: b is granted the place...
        await asyncio.sleep(0)
        granted.cancel()  # ...and is cancelled before it could start
        await settle()
        assert fleet.admitted == ["a", "c"]
        assert fleet.gate.stats()["in_flight"] == 1
        await fleet.close()
        assert fleet.gate.stats()["in_flight"] == 0

    asyncio.run(main())


def test_counts_per_run_requests_tokens_and_queue_waits():
    async def main():
        now = [0.0]
        gate = FairShare(1, lambda run: 1.0, clock=lambda: now[0])
        release = asyncio.Event()

        async def one(run: str, tokens: int) -> None:
            async with gate.slot(run) as used:
                await release.wait()
                used.prompt_tokens, used.completion_tokens = tokens, tokens + 1

        first = asyncio.create_task(one("a", 3))
        await settle()
        second = asyncio.create_task(one("b", 5))
        await settle()
        now[0] = 2.5
        release.set()
        await asyncio.gather(first, second)
        runs = gate.stats()["runs"]
        a = runs["a"]
        assert (a["requests"], a["prompt_tokens"], a["completion_tokens"], a["queue_wait_max_s"]) == (1, 3, 4, 0.0)
        assert (runs["b"]["requests"], runs["b"]["prompt_tokens"], runs["b"]["queue_wait_max_s"]) == (1, 5, 2.5)

    asyncio.run(main())


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError):
        FairShare(0, lambda run: 1.0)
