"""Handed-back generations continued elsewhere and stitched (`deployments.ingress.handback`), and the ingress's side of a
draining replica (`deployments.ingress.shell.ServeBackend`): refused requests sent to a replica that stays, the router told."""

import asyncio

import pytest

from contracts.retry import Backoff
from contracts.serving import ABORTED, Generated, GenerateRequest, ReplicaDraining, SampledChoice, Sampling
from deployments.ingress.handback import continuation, continue_handed_back, stitch
from tests.support.serve_handles import GenerateHandle


def _choice(index, tokens, reason, top=False):
    logprobs = [-float(t) / 10 for t in tokens]
    return SampledChoice(
        index,
        tokens,
        logprobs,
        [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)] if top else None,
        reason,
        None,
    )


def test_a_continuation_asks_for_the_tokens_left_after_prompt_and_tokens_so_far():
    request = GenerateRequest([1, 2], "policy-v3", Sampling(n=4, max_tokens=10, min_tokens=5, seed=7, logprobs=1), 2)
    rest = continuation(request, _choice(2, [5, 6, 7], ABORTED))
    assert rest.prompt_ids == [1, 2, 5, 6, 7] and rest.model == "policy-v3" and rest.turn == 2
    assert (rest.sampling.n, rest.sampling.max_tokens, rest.sampling.min_tokens) == (1, 7, 2)
    assert rest.sampling.seed == 7 and rest.sampling.logprobs == 1  # the rest of the sampling is the request's
    assert continuation(request, _choice(0, list(range(10)), ABORTED)) is None  # nothing left to generate
    unbounded = GenerateRequest([1], "m", Sampling(max_tokens=None))
    assert continuation(unbounded, _choice(0, [3], ABORTED)).sampling.max_tokens is None


def test_stitching_keeps_ids_log_probs_and_alternatives_in_order():
    whole = stitch(_choice(1, [5, 6], ABORTED, top=True), _choice(0, [7, 8, 9], "stop", top=True), 2)
    assert whole == _choice(1, [5, 6, 7, 8, 9], "stop", top=True)
    assert (
        stitch(
            SampledChoice(0, [5], None, None, ABORTED, None), SampledChoice(0, [6], None, None, "length", None), 1
        ).logprobs
        is None
    )


def test_a_scoring_request_handed_back_keeps_its_prompt_log_probs():
    """A teacher's request (`prompt_logprobs`, max_tokens 1) cut before its token: the continuation, whose prompt is
    the same, scores it; the stitched answer carries the prompt's log-probs, not None (its group would be lost)."""
    prompt = [1, 2, 3]
    scored = [None, {2: (-0.5, 1)}, {3: (-0.25, 1)}]
    request = GenerateRequest(prompt, "teacher-v0", Sampling(max_tokens=1, logprobs=0, prompt_logprobs=0))

    async def generate(req):
        assert req.prompt_ids == prompt and req.sampling.prompt_logprobs == 0
        return Generated("b", [SampledChoice(0, [7], [-1.0], None, "length", None, prompt_logprobs=scored)])

    cut = Generated("a", [SampledChoice(0, [], [], None, ABORTED, None)], handed_back=True)
    answer = asyncio.run(continue_handed_back(generate, request, cut))
    assert answer.choices[0].prompt_logprobs == scored and answer.choices[0].token_ids == [7]
    after_prefill = SampledChoice(0, [7], [-1.0], None, ABORTED, None, prompt_logprobs=scored)
    longer = [*scored, {7: (-1.0, 1)}]  # a continuation's prompt holds the tokens generated before the cut too
    assert (
        stitch(after_prefill, SampledChoice(0, [8], [-2.0], None, "length", None, longer), 3).prompt_logprobs == scored
    )
    assert (
        stitch(
            SampledChoice(0, [7], [-1.0], None, ABORTED, None),
            SampledChoice(0, [8], [-2.0], None, "length", None, longer),
            3,
        ).prompt_logprobs
        == scored
    )


def test_every_cut_choice_of_an_n_request_is_continued_and_a_continuation_cut_again_is_continued_again():
    request = GenerateRequest([1], "policy-v1", Sampling(n=3, max_tokens=6, logprobs=0))
    sent = []

    async def generate(req):
        sent.append(req)
        if len(req.prompt_ids) == 2:  # the first choice's continuation is cut again on its replica
            return Generated("c", [_choice(0, [4], ABORTED)], handed_back=True)
        done = 6 - len(req.prompt_ids) + 1
        return Generated("d", [_choice(0, [9] * done, "length")])

    async def backend_generate(req):  # what ServeBackend.generate does: continue whatever comes back cut
        return await continue_handed_back(backend_generate, req, await generate(req))

    cut = Generated(
        "a", [_choice(0, [2], ABORTED), _choice(1, [3, 3, 3, 3, 3, 3], "length"), _choice(2, [], ABORTED)], True
    )
    whole = asyncio.run(continue_handed_back(backend_generate, request, cut))
    assert [c.token_ids for c in whole.choices] == [[2, 4, 9, 9, 9, 9], [3] * 6, [9] * 6]
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3 and [c.index for c in whole.choices] == [0, 1, 2]
    assert all(len(c.logprobs) == len(c.token_ids) for c in whole.choices)
    assert whole.replica == "a,c,d"
    assert sorted(r.prompt_ids for r in sent) == [[1], [1, 2], [1, 2, 4]]
    assert asyncio.run(
        continue_handed_back(backend_generate, request, Generated("a", [], True))
    ).choices  # resent whole


@pytest.fixture
def marked(monkeypatch):
    import deployments.ingress.shell as ingress

    monkeypatch.setattr(ingress, "GENERATE_BACKOFF", Backoff(attempts=3, first_s=0.0, jitter=False))
    marks = []
    monkeypatch.setattr(ingress, "mark_draining", marks.append)
    return marks


def test_the_ingress_routes_around_a_draining_replica_and_continues_what_it_handed_back(marked):
    from deployments.ingress.shell import ServeBackend

    request = GenerateRequest([1, 2], "policy-v1", Sampling(n=1, max_tokens=4))
    handle = GenerateHandle(
        ReplicaDraining("its node is going", "a"),
        Generated("b", [_choice(0, [5], ABORTED)], handed_back=True),
        Generated("c", [_choice(0, [6, 7, 8], "length")]),
    )
    answer = asyncio.run(ServeBackend(handle).generate(request))
    assert marked == ["a", "b"]  # the refusing replica, then the one that handed its generation back
    assert answer.choices[0].token_ids == [5, 6, 7, 8] and answer.replica == "b,c"
    assert [r.prompt_ids for r in handle.sent] == [[1, 2], [1, 2], [1, 2, 5]]
