"""Coalescing like generations (`deployments.control.coalesce`): which requests merge, how the choices are dealt
back, and what a failure or a caller that goes away does."""

import asyncio

import pytest

from contracts.serving import Generated, GenerateRequest, SampledChoice, Sampling
from deployments.control.coalesce import Coalescer, deal, merge_key


def request(prompt=(1, 2, 3), model="base", n=1, seed=None, temperature=1.0, session=None) -> GenerateRequest:
    return GenerateRequest(list(prompt), model, Sampling(n=n, seed=seed, temperature=temperature), session=session)


class Engine:
    """A send that answers `n` distinct choices (token i*10, log-prob -i) after a pause, and records its calls."""

    def __init__(self, pause_s: float = 0.01, fail: Exception | None = None):
        self.calls: list[GenerateRequest] = []
        self.served: list[int] = []  # per call, the callers' requests it serves
        self.pause_s, self.fail = pause_s, fail
        self.cancelled = 0

    async def __call__(self, req: GenerateRequest, requests: int) -> Generated:
        self.calls.append(req)
        self.served.append(requests)
        try:
            await asyncio.sleep(self.pause_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail is not None:
            raise self.fail
        choices = [SampledChoice(i, [i * 10], [-float(i)], None, "length", None) for i in range(req.sampling.n)]
        return Generated("r0", list(reversed(choices)))


def run(coro):
    return asyncio.run(coro)


def test_a_group_sent_as_single_requests_is_one_engine_call_and_each_caller_gets_its_own_samples():
    engine, coalescer = Engine(), Coalescer(window_s=0.005)

    async def go():
        return await asyncio.gather(*(coalescer.generate("run-a", request(), engine) for _ in range(8)))

    results = run(go())
    assert len(engine.calls) == 1 and engine.calls[0].sampling.n == 8
    assert engine.calls[0].prompt_ids == [1, 2, 3] and engine.calls[0].model == "base"
    tokens = [r.choices[0].token_ids[0] for r in results]
    assert sorted(tokens) == [i * 10 for i in range(8)]  # every sample once, none shared
    assert all(len(r.choices) == 1 and r.choices[0].index == 0 and r.replica == "r0" for r in results)
    assert all(r.choices[0].logprobs == [-r.choices[0].token_ids[0] / 10] for r in results)  # a sample's own log-probs
    assert (coalescer.requests, coalescer.calls) == (8, 1)
    assert engine.served == [8]  # the run's usage counts its 8 requests, not the one call


def test_callers_of_n_gt_1_get_their_n_choices_numbered_from_zero():
    engine, coalescer = Engine(), Coalescer(window_s=0.005)

    async def go():
        return await asyncio.gather(*(coalescer.generate("run-a", request(n=n), engine) for n in (2, 3, 1)))

    results = run(go())
    assert engine.calls[0].sampling.n == 6
    assert [[c.index for c in r.choices] for r in results] == [[0, 1], [0, 1, 2], [0]]
    assert [[c.token_ids[0] for c in r.choices] for r in results] == [[0, 10], [20, 30, 40], [50]]


@pytest.mark.parametrize(
    "other",
    [
        request(prompt=(1, 2, 4)),  # another prompt
        request(model="run-a/policy-v1"),  # another adapter: another prefix, another route
        request(temperature=0.5),  # sampled otherwise
        request(session="s1"),  # another session's replica
    ],
)
def test_requests_that_differ_in_anything_but_n_are_not_merged(other):
    engine, coalescer = Engine(), Coalescer(window_s=0.005)

    async def go():
        await asyncio.gather(coalescer.generate("run-a", request(), engine), coalescer.generate("run-a", other, engine))

    run(go())
    assert len(engine.calls) == 2 and all(c.sampling.n == 1 for c in engine.calls)


def test_runs_are_never_merged_so_each_keeps_its_fair_share():
    engine, coalescer = Engine(), Coalescer(window_s=0.005)

    async def go():
        await asyncio.gather(*(coalescer.generate(run, request(), engine) for run in ("run-a", "run-b", "run-a")))

    run(go())
    assert sorted(c.sampling.n for c in engine.calls) == [1, 2]
    assert merge_key("run-a", request()) != merge_key("run-b", request())


@pytest.mark.parametrize("alone", [{"seed": 7}, {"temperature": 0.0}])
def test_seeded_and_greedy_requests_go_alone(alone):
    """A group reseeds its children (`seed + i`), and vLLM refuses n > 1 when greedy."""
    engine, coalescer = Engine(), Coalescer(window_s=0.005)

    async def go():
        await asyncio.gather(*(coalescer.generate("run-a", request(**alone), engine) for _ in range(3)))

    run(go())
    assert [c.sampling.n for c in engine.calls] == [1, 1, 1]


def test_window_zero_sends_every_request_alone():
    engine, coalescer = Engine(), Coalescer(window_s=0)

    async def go():
        await asyncio.gather(*(coalescer.generate("run-a", request(), engine) for _ in range(4)))

    run(go())
    assert len(engine.calls) == 4


def test_a_batch_never_exceeds_max_n():
    engine, coalescer = Engine(), Coalescer(window_s=0.005, max_n=4)

    async def go():
        return await asyncio.gather(*(coalescer.generate("run-a", request(n=n), engine) for n in (2, 2, 3, 1, 4)))

    results = run(go())
    assert sorted(c.sampling.n for c in engine.calls) == [4, 4, 4]
    assert [len(r.choices) for r in results] == [2, 2, 3, 1, 4]


def test_a_failure_reaches_every_caller_of_the_call():
    engine, coalescer = Engine(fail=ValueError("400: bad")), Coalescer(window_s=0.005)

    async def go():
        return await asyncio.gather(
            *(coalescer.generate("run-a", request(), engine) for _ in range(3)), return_exceptions=True
        )

    results = run(go())
    assert len(engine.calls) == 1 and all(isinstance(r, ValueError) for r in results)


def test_a_caller_that_goes_away_leaves_the_others_their_samples_and_the_last_one_cancels_the_call():
    engine, coalescer = Engine(pause_s=0.2), Coalescer(window_s=0.005)

    async def go():
        tasks = [asyncio.create_task(coalescer.generate("run-a", request(), engine)) for _ in range(3)]
        await asyncio.sleep(0.05)  # sent, in the engine
        tasks[0].cancel()
        rest = await asyncio.gather(*tasks[1:])
        assert [len(r.choices) for r in rest] == [1, 1] and engine.cancelled == 0
        tasks = [asyncio.create_task(coalescer.generate("run-a", request(), engine)) for _ in range(2)]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.01)

    run(go())
    assert engine.cancelled == 1


def test_a_caller_gone_before_the_window_ends_is_left_out_of_the_call():
    engine, coalescer = Engine(), Coalescer(window_s=0.05)

    async def go():
        tasks = [asyncio.create_task(coalescer.generate("run-a", request(), engine)) for _ in range(3)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()
        return await asyncio.gather(tasks[0], tasks[2])

    results = run(go())
    assert engine.calls[0].sampling.n == 2 and all(len(r.choices) == 1 for r in results)


def test_deal_gives_a_short_answer_what_there_is():
    result = Generated("r1", [SampledChoice(i, [i], None, None, "abort", None) for i in range(3)], handed_back=True)
    shares = deal(result, [2, 2])
    assert [[c.token_ids for c in s.choices] for s in shares] == [[[0], [1]], [[2]]]
    assert all(s.handed_back and s.replica == "r1" for s in shares)
