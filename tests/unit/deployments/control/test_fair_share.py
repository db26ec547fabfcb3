"""The fair share gate (`deployments.control.fair_share`) as pure asyncio: generations are fakes that finish when told."""

import asyncio

import pytest

from deployments.control.fair_share import FairShare


class Fleet:
    """A gate and generations that hold their place until `finish` ends them, oldest first per run, or any."""

    def __init__(self, budget: int, weights: dict[str, float] | None = None, registered=lambda run: True):
        weights = weights or {}
        self.gate = FairShare(budget, lambda run: weights.get(run, 1.0), is_run=registered)
        self.admitted: list[str] = []  # runs, in the order their generations got a place
        self.running: list[tuple[str, asyncio.Event]] = []
        self.sequences: dict[asyncio.Event, int] = {}  # each running generation's `n`
        self.tasks: list[asyncio.Task] = []

    async def _generation(self, run: str, tokens: int, n: int) -> None:
        async with self.gate.slot(run, n) as used:
            done = asyncio.Event()
            self.admitted.append(run)
            self.running.append((run, done))
            self.sequences[done] = n
            await done.wait()
            used.prompt_tokens, used.completion_tokens = tokens, 2 * tokens

    async def submit(self, run: str, count: int, tokens: int = 1, n: int = 1) -> list[asyncio.Task]:
        """`count` generations of `run`, each of `n` sequences (a request with `n=G`)."""
        new = [asyncio.create_task(self._generation(run, tokens, n)) for _ in range(count)]
        self.tasks += new
        await settle()
        return new

    async def finish(self, run: str | None = None, count: int = 1) -> None:
        for _ in range(count):
            i = next(i for i, (r, _) in enumerate(self.running) if run in (None, r))
            self.running.pop(i)[1].set()
            await settle()

    def in_flight(self, run: str) -> int:
        """Sequences of `run` being generated."""
        return sum(self.sequences[done] for r, done in self.running if r == run)

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


def test_an_engine_call_serving_merged_requests_counts_each_request_to_its_run():
    """Like requests merged into one engine call (`deployments.control.coalesce`) count as the requests they were."""

    async def main():
        gate = FairShare(8, lambda run: 1.0)
        async with gate.slot("a", places=8, requests=8):
            pass
        async with gate.slot("a"):
            pass
        assert gate.stats()["runs"]["a"]["requests"] == 9

    asyncio.run(main())


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError):
        FairShare(0, lambda run: 1.0)


def test_a_request_of_n_sequences_holds_n_places():
    """spotrl's own groups ask for n=G completions in one request: G places, so the budget is what the engines batch."""

    async def main():
        fleet = Fleet(budget=8)
        await fleet.submit("a", 5, n=4)  # 20 sequences asked for: two requests fit the 8 places, three wait
        assert fleet.in_flight("a") == 8 and fleet.admitted == ["a", "a"]
        stats = fleet.gate.stats()
        assert stats["in_flight"] == 8 and stats["runs"]["a"]["queued"] == 12
        await fleet.submit("b", 1, n=2)
        await fleet.finish("a")  # 4 places free: b's 2 first (it holds none), a's next 4 do not fit in the 2 left
        assert fleet.in_flight("b") == 2 and fleet.in_flight("a") == 4 and fleet.gate.stats()["in_flight"] == 6
        await fleet.close()

    asyncio.run(main())


@pytest.mark.parametrize("group_size, budget", [(2, 8), (4, 16), (8, 32)])
def test_weights_one_and_three_hold_places_one_to_three_in_sequences_with_requests_of_n(group_size, budget):
    """Two runs sending spotrl's own n=G requests under contention, at weights 1 and 3: 1:3 of the sequences, exactly
    once the first run's idle-fleet start has drained, whichever generation finishes next."""

    async def main():
        fleet = Fleet(budget=budget, weights={"a": 1.0, "b": 3.0})
        await fleet.submit("a", 300, n=group_size)  # the fleet was idle: a's burst takes every place
        await fleet.submit("b", 300, n=group_size)
        held = []
        for i in range(150):
            await fleet.finish(run="b" if i % 3 == 0 and fleet.in_flight("b") else None)  # mixed orders of finishing
            held.append((fleet.in_flight("a"), fleet.in_flight("b")))
        assert set(held[20:]) == {(budget // 4, 3 * budget // 4)}, held
        assert {run: s["share"] for run, s in fleet.gate.stats()["runs"].items()} == {
            "a": budget / 4,
            "b": 3 * budget / 4,
        }
        await fleet.close()

    asyncio.run(main())


def test_a_large_generation_is_not_starved_by_smaller_ones():
    """Places are kept for the next waiter whose generation does not fit yet, rather than given to small ones behind it."""

    async def main():
        fleet = Fleet(budget=4)
        await fleet.submit("a", 4)
        await fleet.submit("b", 1, n=4)  # needs the whole fleet
        await fleet.submit("a", 10)
        await fleet.finish("a", 3)  # three free places are kept for b, not given to a's waiting ones
        assert fleet.gate.stats()["in_flight"] == 1 and fleet.in_flight("b") == 0
        await fleet.finish("a")
        assert fleet.in_flight("b") == 4 and fleet.admitted[-1] == "b"
        await fleet.close()

    asyncio.run(main())


def test_a_generation_asking_more_sequences_than_the_budget_holds_the_whole_budget():
    async def main():
        fleet = Fleet(budget=4)
        (big,) = await fleet.submit("a", 1, n=64)
        assert fleet.gate.stats()["in_flight"] == 4 and not big.done()
        await fleet.finish("a")
        assert fleet.gate.stats()["in_flight"] == 0
        await fleet.close()

    asyncio.run(main())


def test_a_run_that_left_is_forgotten_once_its_last_generation_is_done_never_while_it_waits():
    async def main():
        registered = {"a", "b"}
        fleet = Fleet(budget=1, registered=registered.__contains__)
        await fleet.submit("a", 1)
        await fleet.submit("b", 2)
        fleet.gate.report_slots({"a": 2, "b": 1})
        registered.discard("b")  # removed while one of its generations waits, another behind it
        fleet.gate.forget("b")
        assert "b" in fleet.gate.stats()["runs"]  # a waiter is never dropped
        await fleet.finish("a")
        assert fleet.admitted == ["a", "b"]
        await fleet.finish("b")
        await fleet.finish("b")
        assert set(fleet.gate.stats()["runs"]) == {"a"}
        fleet.gate.report_slots({"a": 2})
        assert fleet.gate.sizes() == {"fair_share_tenants": 1, "slots_gauges": 1}
        registered.discard("a")  # idle when removed: forgotten at once
        fleet.gate.forget("a")
        fleet.gate.report_slots({})
        assert fleet.gate.sizes() == {"fair_share_tenants": 0, "slots_gauges": 0}
        await fleet.close()

    asyncio.run(main())


def test_a_waiter_larger_than_a_shrunk_budget_takes_the_whole_of_it_and_nobody_deadlocks():
    """The fleet shrinks while a group of 8 waits (a node lost, autoscaling down): the waiter is clamped to the new
    budget, takes it once free, and every run behind it follows; places go back as granted."""

    async def main():
        fleet = Fleet(budget=8)
        await fleet.submit("a", 1, n=6)  # 6 of 8 in flight
        await fleet.submit("b", 1, n=8)  # waits for all 8
        await fleet.submit("c", 2, n=1)  # behind b: the free places are kept for it
        fleet.gate.resize(4)  # half the fleet gone
        await fleet.finish("a")
        # c's two fit within its share (half the 4 places) and go first; then b, holding no place, is next
        assert fleet.admitted == ["a", "c", "c"]
        await fleet.finish("c")
        assert fleet.admitted == ["a", "c", "c"]  # the free places kept for b
        await fleet.finish("c")
        assert fleet.admitted == ["a", "c", "c", "b"] and fleet.gate.stats()["in_flight"] == 4  # b: the whole budget
        await fleet.finish("b")
        assert fleet.gate.stats()["in_flight"] == 0
        await fleet.close()

    asyncio.run(main())


def test_small_generations_fill_their_runs_share_between_another_runs_large_ones():
    """Single samples merged into one generation of 8 (a run's burst, `deployments.control.coalesce`) beside another
    run's generations of 2: between two of the large ones, the small run fills its share (4 of 8 places) instead
    of one generation of 2 per large one, which would serve it at a fifth of the fleet's sequences, not half."""

    async def main():
        fleet = Fleet(budget=8)
        await fleet.submit("a", 4, n=8)  # one in flight, three waiting
        await fleet.submit("b", 4, n=2)
        await fleet.finish("a")
        assert fleet.admitted == ["a", "b", "b"] and fleet.in_flight("b") == 4  # b's share; then a's next, whole
        await fleet.finish("b", count=2)
        assert fleet.admitted == ["a", "b", "b", "a"]
        await fleet.finish("a")
        assert fleet.admitted == ["a", "b", "b", "a", "b", "b"]  # all of b's done after two of a's four
        await fleet.finish("b", count=2)
        await fleet.finish("a", count=2)
        assert fleet.admitted == ["a", "b", "b", "a", "b", "b", "a", "a"]
        await fleet.close()

    asyncio.run(main())
