"""Generations a replica handed back, continued on another replica and stitched into one answer, token-exact.

A replica cuts its unfinished generations short when its node is going (`deployments.replica.notices`) and
answers each with its tokens so far (`contracts.serving.Generated.handed_back`, `deployments.replica.inflight`). The
ingress sends every unfinished choice on as a request of its own: prompt + the token ids generated so far, for
the tokens that are left (`max_tokens` and `min_tokens` less those), one sample (each choice of an n > 1
request has its own prefix), under the same adapter and sampling; the router, told that the replica drains,
picks another one. The parts are stitched in order (token ids, their log-probs, the top alternatives), with the
last part's finish reason, and the prompt's log-probs when a scoring request asked for them. The continuation conditions on exactly the tokens sampled so far, under the same
adapter version, so the caller (the learner) gets one sequence and a log-prob for each of its tokens, as if
one replica had sampled it all.

What a continuation is not: the same random draw. A request with a `seed` is continued with that seed, which
keeps it reproducible given where it was cut, but the tokens after the cut differ from those an uninterrupted
generation would have drawn. vLLM's presence and frequency penalties count generated tokens only, so after a
cut they no longer count the tokens before it (now part of the prompt); the repetition penalty counts both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from contracts.serving import ABORTED, Generated, GenerateRequest, SampledChoice

Generate = Callable[[GenerateRequest], Awaitable[Generated]]


def continuation(request: GenerateRequest, choice: SampledChoice) -> GenerateRequest | None:
    """The request that continues `choice` (cut short) of `request`; None when no token is left to generate."""
    done = len(choice.token_ids)
    sampling = request.sampling
    left = None if sampling.max_tokens is None else sampling.max_tokens - done
    if left is not None and left <= 0:
        return None
    rest = replace(sampling, n=1, max_tokens=left, min_tokens=max(0, sampling.min_tokens - done))
    return GenerateRequest(request.prompt_ids + choice.token_ids, request.model, rest, request.turn)


def _joined(first: list | None, rest: list | None) -> list | None:
    return None if first is None and rest is None else [*(first or []), *(rest or [])]


def stitch(first: SampledChoice, rest: SampledChoice, prompt_len: int) -> SampledChoice:
    """`first`'s tokens followed by its continuation's, as one choice (at `first`'s index), with the log-probs of the
    `prompt_len` prompt tokens when they were asked for: `first`'s, or (cut before its prefill had them) the first
    `prompt_len` of the continuation's, whose prompt is that prompt followed by `first`'s tokens."""
    prompt_logprobs = first.prompt_logprobs
    if prompt_logprobs is None and rest.prompt_logprobs is not None:
        prompt_logprobs = rest.prompt_logprobs[:prompt_len]
    return replace(
        first,
        token_ids=first.token_ids + rest.token_ids,
        logprobs=_joined(first.logprobs, rest.logprobs),
        top_logprobs=_joined(first.top_logprobs, rest.top_logprobs),
        finish_reason=rest.finish_reason,
        stop_reason=rest.stop_reason,
        prompt_logprobs=prompt_logprobs,
    )


async def continue_handed_back(generate: Generate, request: GenerateRequest, result: Generated) -> Generated:
    """`result` with every choice its replica cut short continued through `generate` (the ingress's own path:
    routed afresh, retried, and continued again if handed back again); `result` itself if nothing was cut."""
    if not result.handed_back:
        return result
    if not result.choices:  # cut before it produced anything: the whole request again
        return await generate(request)
    parts = await asyncio.gather(*(_finish(generate, request, choice) for choice in result.choices))
    replicas = dict.fromkeys(name for r in [result.replica, *(r for _, r in parts)] for name in r.split(",") if name)
    return Generated(",".join(replicas), [choice for choice, _ in parts])


async def _finish(generate: Generate, request: GenerateRequest, choice: SampledChoice) -> tuple[SampledChoice, str]:
    """`choice` finished: continued elsewhere if it was cut short; and the replica that continued it."""
    if choice.finish_reason != ABORTED:
        return choice, ""
    rest = continuation(request, choice)
    if rest is None:
        return replace(choice, finish_reason="length"), ""
    answer = await generate(rest)
    return stitch(choice, answer.choices[0], len(request.prompt_ids)), answer.replica
