"""The HTTP API's wire format: OpenAI's request bodies, validated, and the response shapes built from replies.

Bodies are validated here (types, ranges, and what the fleet does not do, such as streaming or stop
strings) so that the handlers of `deployments.api` see only valid values, and a malformed request
becomes a 400 that names the field. A valid completion body becomes the fleet's own `Sampling`
(`deployments.protocol`) in one step. Responses keep OpenAI's and vLLM's field names: TRL's trainer
and the `openai` client parse them.

Per-token strings (`logprobs.tokens`, `text_offset`, the chat `logprobs.content`) are made only
when a client asks for log-probs, from a per-token cache (a token id always decodes to the same
string), or not decoded at all when the client sends vLLM's `return_tokens_as_token_ids`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from deployments.protocol import SampledChoice, Sampling

ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class ApiError(Exception):
    """Answered as `{"error": {"message", "type", "code"}}` with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or ERROR_KINDS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, schema: type[Body]) -> Body:
    """The request body as `schema`, or a 400 naming the first problem."""
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "body: not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body: expected a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}") from None


# ---- request bodies ------------------------------------------------------------------------------

TokenIds = list[StrictInt]


class _SamplingBody(BaseModel):
    """Sampling fields shared by completions and chat completions (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="ignore")  # like vLLM: unknown OpenAI fields (user, ...) are ignored

    model: str = Field(min_length=1, max_length=4096)
    n: int = Field(1, ge=1, le=256)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    # vLLM's switch: log-prob tokens as "token_id:N" strings, for clients that read ids, not text.
    return_tokens_as_token_ids: bool | None = None
    stream: bool = False

    def sampling(self, max_tokens: int, logprobs: int | None) -> Sampling:
        """The engine's sampling parameters, for a prompt that leaves room for `max_tokens`."""
        if self.stream:
            raise ApiError(400, "stream: streaming responses are not supported")
        if self.stop:
            raise ApiError(
                400, "stop: stop strings are not supported (the engine never detokenizes); use stop_token_ids"
            )
        return Sampling(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=self.seed,
            logprobs=logprobs,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )


class CompletionBody(_SamplingBody):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch, as a batch; unsupported options refused first."""
        if self.echo or (self.best_of or 1) > 1:
            raise ApiError(400, "echo and best_of are not supported")
        prompts = self.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) or not prompts:
            return [prompts]
        return list(prompts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def top_alternatives(self) -> int | None:
        """The engine's `logprobs`: None without log-probs, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=128)


# ---- responses -----------------------------------------------------------------------------------

TokenText = Callable[[int], str]  # a token id's string in log-prob listings


def cached_token_text(decode: Callable[[list[int]], str]) -> TokenText:
    """`decode([token])`, once per token id: a vocabulary is finite, and a listing repeats tokens."""
    return functools.lru_cache(maxsize=None)(lambda token: decode([token]))


def token_id_placeholder(token: int) -> str:
    """vLLM's `return_tokens_as_token_ids` format: the id itself, nothing decoded."""
    return f"token_id:{token}"


def completion_choice(
    index: int, choice: SampledChoice, text: str, token_text: TokenText | None, prompt_ids: list[int] | None
) -> dict[str, Any]:
    """A `/v1/completions` choice; log-probs when `token_text` is given, token ids when `prompt_ids` is."""
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(choice, token_text) if token_text else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids if prompt_ids is not None else None,
        "prompt_token_ids": prompt_ids,
    }


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
        "token_logprobs": choice.logprobs or [],
        "text_offset": offsets,
        "top_logprobs": [{token_text(t): lp for t, lp in alt.items()} for alt in top] if top else None,
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
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())}
                    for t, v in alt.items()
                ],
            }
        )
    return out


def usage(prompt_tokens: int, choices: list[SampledChoice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
