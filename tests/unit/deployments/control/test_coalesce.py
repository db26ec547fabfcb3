"""Coalescing like generations (`deployments.control.coalesce`): which requests merge, how the choices are dealt
back, and what a failure or a caller that goes away does."""

import asyncio
import dataclasses

import pytest

from contracts.serving import Generated, GenerateRequest, SampledChoice, Sampling
from deployments.control.coalesce import Coalescer, Generations, Merged, deal, merge_key


def request(prompt=(1, 2, 3), model="base", n=1, seed=None, temperature=1.0, session=None) -> GenerateRequest:
    return GenerateRequest(list(prompt), model, Sampling(n=n, seed=seed, temperature=temperature), session=session)


class Engine:
    """A send that answers each request `n` distinct choices (token i*10, log-prob -i) after a pause, and records its
    calls; `fail` fails the whole call, `refuse` the requests whose prompt ends in that token."""

    def __init__(self, pause_s: float = 0.01, fail: Exception | None = None, refuse: int | None = None):
        self.calls: list[GenerateRequest] = []  # every engine request, in the order sent
        self.bundles: list[int] = []  # per replica call, the engine requests in it
        self.served: list[int] = []  # per replica call, the callers' requests it serves
        self.pause_s, self.fail, self.refuse = pause_s, fail, refuse
        self.cancelled = 0

    async def __call__(self, call: list[Merged]) -> list[Generated | Exception]:
        self.calls.extend(m.request for m in call)
        self.bundles.append(len(call))
        self.served.append(sum(m.callers for m in call))
        try:
            await asyncio.sleep(self.pause_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail is not None:
            raise self.fail
        return [self.answer(m.request) for m in call]

    def answer(self, req: GenerateRequest) -> Generated | Exception:
        if req.prompt_ids[-1] == self.refuse:
            return ValueError(f"400: refused {req.prompt_ids}")
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


def test_a_group_whose_requests_arrive_apart_but_closer_than_the_window_is_still_one_call():
    """A busy ingress parses a group's requests one after another: the call waits a window after the latest."""
    engine, coalescer = Engine(), Coalescer(window_s=0.1)

    async def go():
        async def later(i):
            await asyncio.sleep(0.02 * i)  # 6 requests over 0.1 s, each 0.02 s after the one before
            return await coalescer.generate("run-a", request(), engine)

        return await asyncio.gather(*(later(i) for i in range(6)))

    results = run(go())
    assert [c.sampling.n for c in engine.calls] == [6] and all(len(r.choices) == 1 for r in results)


def test_a_steady_stream_of_like_requests_still_goes_out_after_at_most_four_windows():
    engine, coalescer = Engine(), Coalescer(window_s=0.05)

    async def go():
        async def later(i):
            await asyncio.sleep(0.01 * i)  # 40 requests over 0.4 s, never a window apart
            return await coalescer.generate("run-a", request(), engine)

        return await asyncio.gather(*(later(i) for i in range(40)))

    run(go())
    sizes = [c.sampling.n for c in engine.calls]
    assert sum(sizes) == 40 and len(sizes) >= 2 and sizes[0] <= 21  # the first call went by 0.2 s (4 windows)


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


def scored(*tail: int, prompt=tuple(range(32)), **sampling) -> GenerateRequest:
    """A scored sequence: a prompt of one router block (32 tokens) and a completion, its prompt's log-probs asked for."""
    return GenerateRequest([*prompt, *tail], "base", Sampling(max_tokens=1, prompt_logprobs=0, **sampling))


def test_a_groups_scored_sequences_sent_one_per_request_are_one_replica_call_each_answered_apart():
    engine, coalescer = Engine(), Coalescer(window_s=0.005, kind=Generations(block_size=32))
    sequences = [scored(40 + i, 50 + i) for i in range(8)]

    async def go():
        return await asyncio.gather(*(coalescer.generate("run-a", s, engine) for s in sequences))

    results = run(go())
    assert engine.bundles == [8] and engine.served == [8]  # one replica call, eight engine requests
    assert engine.calls == sequences  # each sequence its own engine request, unchanged, in order
    assert all(len(r.choices) == 1 for r in results)
    assert (coalescer.requests, coalescer.calls) == (8, 1)


def test_scored_sequences_that_would_route_apart_are_never_bundled():
    engine, coalescer = Engine(), Coalescer(window_s=0.005, kind=Generations(block_size=32))
    other_prompt = scored(40, prompt=tuple(range(1, 33)))  # another first block: another route
    others = [
        other_prompt,
        dataclasses.replace(scored(41), model="run-a/policy-v1"),  # another adapter
        dataclasses.replace(scored(42), session="s1"),  # another session's replica
    ]

    async def go():
        await asyncio.gather(*(coalescer.generate("run-a", s, engine) for s in [scored(43), *others]))
        await coalescer.generate("run-b", scored(44), engine)  # another run: its own share

    run(go())
    assert engine.bundles == [1, 1, 1, 1, 1]


def test_scored_sequences_shorter_than_a_block_have_no_route_of_their_own_and_share_a_call():
    """Nothing to route by (no full block): each would go to the least loaded replica, so they go there together."""
    engine, coalescer = Engine(), Coalescer(window_s=0.005, kind=Generations(block_size=32))
    short = [scored(40 + i, prompt=tuple(range(i, i + 16))) for i in range(6)]  # 17 tokens, distinct prompts
    full = scored(50, prompt=tuple(range(16, 48)))  # a full block of its own: its own route

    async def go():
        await asyncio.gather(*(coalescer.generate("run-a", s, engine) for s in [*short, full]))

    run(go())
    assert sorted(engine.bundles) == [1, 6] and engine.calls[:6] == short


def test_generations_of_distinct_prompts_are_never_bundled_even_when_they_share_a_first_block():
    """A shared system prompt must not tie a run's generations to one replica, nor each answer to the slowest."""
    engine, coalescer = Engine(), Coalescer(window_s=0.005, kind=Generations(block_size=32))
    prompts = [GenerateRequest([*range(32), 40 + i], "base", Sampling(max_tokens=8)) for i in range(4)]

    async def go():
        await asyncio.gather(*(coalescer.generate("run-a", p, engine) for p in prompts))

    run(go())
    assert engine.bundles == [1, 1, 1, 1]


def test_seeded_and_greedy_scored_sequences_are_bundled_side_by_side_never_merged():
    engine, coalescer = Engine(), Coalescer(window_s=0.005, kind=Generations(block_size=32))
    same = [scored(40, seed=3), scored(40, seed=3), scored(40, temperature=0.0), scored(40, temperature=0.0)]

    async def go():
        return await asyncio.gather(*(coalescer.generate("run-a", s, engine) for s in same))

    results = run(go())
    assert engine.bundles == [4] and [c.sampling.n for c in engine.calls] == [1, 1, 1, 1]
    assert all(len(r.choices) == 1 for r in results)


def test_a_bundled_requests_own_failure_reaches_its_callers_alone():
    engine, coalescer = Engine(refuse=66), Coalescer(window_s=0.005, kind=Generations(block_size=32))

    async def go():
        sent = [scored(40), scored(66), scored(66), scored(41)]  # the two 66s are one engine request of n=2
        return await asyncio.gather(*(coalescer.generate("run-a", s, engine) for s in sent), return_exceptions=True)

    results = run(go())
    assert engine.bundles == [3] and [c.sampling.n for c in engine.calls] == [1, 2, 1]
    assert [type(r).__name__ for r in results] == ["Generated", "ValueError", "ValueError", "Generated"]
