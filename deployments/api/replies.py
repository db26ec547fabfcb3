"""The HTTP API's replies: OpenAI's response shapes built from what the replicas generated, always valid JSON.

Responses keep OpenAI's and vLLM's field names: TRL's trainer and the `openai` client parse them. They
never carry NaN or infinity (`FiniteJSONResponse`), and log-probs are floored like vLLM's.

Per-token strings (`logprobs.tokens`, `text_offset`, the chat `logprobs.content`) are made only
when a client asks for log-probs, from a per-token cache (a token id always decodes to the same
string), or not decoded at all when the client sends vLLM's `return_tokens_as_token_ids`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from contracts.serving import LOGPROB_FLOOR, Generated, PromptLogprobs, SampledChoice


class FiniteJSONResponse(JSONResponse):
    """A JSON response that is always valid JSON: a NaN or infinity anywhere becomes null.

    Starlette refuses them (allow_nan=False) with an exception, which would turn an odd engine
    statistic into a 500; log-probs never get here as -inf (`finite_logprob` floors them first).
    """

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:
            return super().render(_finite(content))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def finite_logprob(logprob: float) -> float:
    """vLLM's server answers -9999.0 for a -inf log-prob (a filtered-out alternative); NaN gets the same."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false: floored too


TokenText = Callable[[int], str]  # a token id's string in log-prob listings


def choice_text(choice: SampledChoice, decode: Callable[[list[int]], str]) -> str:
    """A completion's text as vLLM's server writes it: its tokens decoded, and for one a stop string ended, cut before
    that string (the tokens keep it, up to the one that completed it; the text never holds it)."""
    text = decode(choice.token_ids)
    if isinstance(choice.stop_reason, str):
        at = text.find(choice.stop_reason)  # the first: the engine would have stopped at any earlier one
        if at >= 0:
            text = text[:at]
    return text


def cached_token_text(decode: Callable[[list[int]], str]) -> TokenText:
    """`decode([token])`, once per token id: a vocabulary is finite, and a listing repeats tokens."""
    return functools.lru_cache(maxsize=None)(lambda token: decode([token]))


def token_id_placeholder(token: int) -> str:
    """vLLM's `return_tokens_as_token_ids` format: the id itself, nothing decoded."""
    return f"token_id:{token}"


def completion_choice(
    index: int,
    choice: SampledChoice,
    text: str,
    token_text: TokenText | None,
    prompt_ids: list[int] | None,
    prompt_token_text: TokenText = token_id_placeholder,
) -> dict[str, Any]:
    """A `/v1/completions` choice; log-probs when `token_text` is given, token ids when `prompt_ids` is, the
    prompt's log-probs when the request asked for them (their tokens named by `prompt_token_text`)."""
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(choice, token_text) if token_text else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids if prompt_ids is not None else None,
        "prompt_token_ids": prompt_ids,
        "prompt_logprobs": listed_prompt_logprobs(choice.prompt_logprobs, prompt_token_text),
    }


def listed_prompt_logprobs(positions: PromptLogprobs | None, token_text: TokenText) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {"<token id>": {logprob, rank,
    decoded_token}}, holding the prompt's own token and the top alternatives; -inf floored as vLLM floors it."""
    if positions is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": finite_logprob(lp), "rank": rank, "decoded_token": token_text(t)}
            for t, (lp, rank) in entry.items()
        }
        for entry in positions
    ]


def completion_logprobs(choice: SampledChoice, token_text: TokenText) -> dict[str, Any]:
    """OpenAI's legacy completions log-probs: per-token strings, log-probs, offsets, top alternatives."""
    tokens = [token_text(t) for t in choice.token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = choice.top_logprobs
    return {
        "tokens": tokens,
        "token_logprobs": [finite_logprob(lp) for lp in choice.logprobs or []],
        "text_offset": offsets,
        "top_logprobs": [{token_text(t): finite_logprob(lp) for t, lp in alt.items()} for alt in top] if top else None,
    }


def chat_choice(choice: SampledChoice, text: str, token_text: TokenText | None, with_token_ids: bool) -> dict[str, Any]:
    """A `/v1/chat/completions` choice; log-probs when `token_text` is given."""
    out = {
        "index": choice.index,
        "message": {"role": "assistant", "content": text},
        "logprobs": {"content": chat_logprobs(choice, token_text)} if token_text else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
    }
    if with_token_ids:
        out["token_ids"] = choice.token_ids
    return out


def chat_logprobs(choice: SampledChoice, token_text: TokenText) -> list[dict[str, Any]]:
    top = choice.top_logprobs or [{}] * len(choice.token_ids)
    out = []
    for token, lp, alt in zip(choice.token_ids, choice.logprobs or [], top, strict=False):
        text = token_text(token)
        out.append(
            {
                "token": text,
                "logprob": finite_logprob(lp),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": finite_logprob(v), "bytes": list(token_text(t).encode())}
                    for t, v in alt.items()
                ],
            }
        )
    return out


def usage(prompt_tokens: int, choices: list[SampledChoice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def replica_header(results: list[Generated]) -> dict[str, str]:
    """`x-spotrl-replica`: the replicas that served a reply, each named once."""
    return {"x-spotrl-replica": ",".join(dict.fromkeys(r.replica for r in results))}


def token_choice(choice: SampledChoice, with_logprobs: bool) -> dict[str, Any]:
    """A choice of vLLM's `/inference/v1/generate` in `output_mode` "tokens" (`GenerateTokensChoice`): token ids and,
    when asked, per token `{token_id, logprob, rank, top_logprobs}` as vLLM 0.32 answers it, plus `token` ("token_id:N",
    vLLM's placeholder for a token it does not decode), which the `renderers` client of verifiers reads instead of
    `token_id` (`renderers.client._parse_completion_logprobs`): both clients parse the same reply."""
    logprobs = None
    if with_logprobs:
        top = choice.top_logprobs or [{}] * len(choice.token_ids)
        logprobs = {
            "content": [
                {
                    "token_id": token,
                    "token": token_id_placeholder(token),
                    "logprob": finite_logprob(lp),
                    "rank": None,
                    "top_logprobs": [
                        {"token_id": t, "token": token_id_placeholder(t), "logprob": finite_logprob(v), "rank": None}
                        for t, v in alt.items()
                    ],
                }
                for token, lp, alt in zip(choice.token_ids, choice.logprobs or [], top, strict=False)
            ]
        }
    return {
        "index": choice.index,
        "finish_reason": choice.finish_reason or "stop",
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids,
        "logprobs": logprobs,
        "routed_experts": None,
        "sampling_mask": None,
    }
