"""The HTTP API's request bodies: OpenAI's, validated, and how much one request may ask for.

Bodies are validated here (types, ranges, and what the fleet does not do, such as streaming or stop
strings) so that the handlers of `deployments.api` see only valid values, and a malformed request
becomes a 400 that names the field. A valid completion body becomes the fleet's own `Sampling`
(`contracts.serving`) in one step. Field names are OpenAI's and vLLM's: TRL's trainer and the `openai`
client send them.

Nothing a client sends may reach an engine that vLLM's own OpenAI server would refuse: the sampling
fields carry vLLM's ranges (`SamplingParams._verify_args` and the request models of
`vllm.entrypoints.openai`), integers stay within int64 (a seed beyond it kills vLLM's GPU model
runner; any integer beyond it breaks the engine's MessagePack transport), and no number is NaN or
infinite. What the JSON itself may be (depth, lone UTF-16 surrogates, which no UTF-8 text can hold)
and how much one request may ask for (`RequestLimits`) are checked here too, each in one place.
The replies are shaped in `deployments.api.replies`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from contracts.adapters import MAX_ADAPTER_NAME_CHARS
from contracts.serving import Sampling
from deployments.control.errors import ApiError

# vLLM's bounds (vllm.sampling_params, vllm.entrypoints.openai.*.protocol, vllm.envs), mirrored.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
MAX_LOGPROBS = 20  # the engine's default max_logprobs
MAX_TURN = 1024  # bounds the router's per-turn counters
MAX_STOP_STRINGS = 16  # stop strings a request may carry (OpenAI allows 4; vLLM sets no bound)
MAX_STOP_CHARS = 1024  # the length of one: the engine searches every new piece of text for each
GREEDY_TEMPERATURE = 1e-5  # _SAMPLING_EPS: below it vLLM samples greedily, and refuses n > 1
_SURROGATE = re.compile("[\ud800-\udfff]")


Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class RequestLimits:
    """How much one request may ask of the ingress; `fleet.*` of a fleet (core.config.FleetSettings)."""

    max_request_bytes: int
    max_json_depth: int
    max_prompts_per_request: int
    max_sequences_per_request: int
    max_text_chars: int
    max_prompt_logprobs_per_request: int

    @classmethod
    def of(cls, fleet: Any) -> RequestLimits:
        """The limits of a fleet's settings (the same names)."""
        return cls(**{f.name: getattr(fleet, f.name) for f in fields(cls)})

    def check_fanout(self, prompts: int, n: int) -> None:
        """Prompts in one request, and the completions they ask for (vLLM caps prompts at 1024 too)."""
        if prompts > self.max_prompts_per_request:
            raise ApiError(400, f"prompt: {prompts} prompts exceed the limit of {self.max_prompts_per_request}")
        if prompts * n > self.max_sequences_per_request:
            raise ApiError(
                400,
                f"n: {prompts} prompt(s) x n={n} = {prompts * n} completions exceed the limit of "
                f"{self.max_sequences_per_request}",
            )

    def check_prompt_logprobs(self, prompt_tokens: int, k: int | None, n: int) -> None:
        """What a scoring request answers: an entry per prompt token and alternative (`k` + 1), in each of `n` choices."""
        entries = 0 if k is None else prompt_tokens * (k + 1) * n
        if entries > self.max_prompt_logprobs_per_request:
            raise ApiError(
                400,
                f"prompt_logprobs: {prompt_tokens} prompt tokens x ({k} + 1) x n={n} = {entries} log-probs exceed the "
                f"limit of {self.max_prompt_logprobs_per_request}",
            )

    def check_text(self, texts: Iterable[str]) -> None:
        """Text to tokenize, before any of it is: tokenizing costs time on the ingress."""
        chars = sum(len(t) for t in texts)
        if chars > self.max_text_chars:
            raise ApiError(400, f"prompt: {chars} characters of text exceed the limit of {self.max_text_chars}")


def parse_body(raw: bytes, schema: type[Body], max_depth: int) -> Body:
    """The request body as `schema`, or a 400 naming the first problem."""
    data = decode_json(raw, max_depth)
    if not isinstance(data, dict):
        raise ApiError(400, "body: expected a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}") from None


def decode_json(raw: bytes, max_depth: int) -> Any:
    """Strict JSON: no NaN or Infinity (nor a number too large for a float), nesting at most `max_depth`
    deep, and no lone UTF-16 surrogate (`"\\ud800"`), which no response and no tokenizer could encode."""
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float) if raw else None
    except RecursionError:  # deeper than the interpreter goes: far deeper than max_depth
        raise ApiError(400, f"body: nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "body: not valid JSON") from None
    _check_structure(data, max_depth)
    return data


def _no_constant(name: str) -> Any:
    raise ApiError(400, f"body: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(400, f"body: number {text[:40]} is out of range")
    return value


def _check_structure(data: Any, max_depth: int) -> None:
    """Walk the parsed body once (iteratively: depth is what is being checked): depth and surrogates."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise ApiError(400, "body: a string holds a lone UTF-16 surrogate")
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            raise ApiError(400, f"body: nested deeper than {max_depth} levels")
        values = node if isinstance(node, list) else [*node.keys(), *node.values()]
        stack.extend((v, depth + 1) for v in values if isinstance(v, str | dict | list))


# ---- request bodies ------------------------------------------------------------------------------

TokenIds = list[StrictInt]  # each checked against the vocabulary (`deployments.api.prompts`)
# No control characters in names and paths: they end up in file paths, logs and error messages.
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"


class _SamplingFields(BaseModel):
    """Sampling fields shared by completions, chat completions and vLLM's token generation (vLLM's names, defaults and
    ranges): at the top of an OpenAI body, under `sampling_params` of `/inference/v1/generate`."""

    # Like vLLM: unknown OpenAI fields (user, ...) are ignored. Every float is finite.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    return_token_ids: bool = False
    # vLLM's switch: log-prob tokens as "token_id:N" strings, for clients that read ids, not text.
    return_tokens_as_token_ids: bool | None = None
    stream: bool = False

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> Sampling:
        """The engine's sampling parameters, for a prompt that leaves room for `max_tokens`."""
        if self.stream:
            raise ApiError(400, "stream: streaming responses are not supported")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (len(stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters")
        if self.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens: {self.min_tokens} exceeds max_tokens {max_tokens}")
        if self.temperature < GREEDY_TEMPERATURE and self.n > 1:
            raise ApiError(400, f"n: must be 1 when sampling greedily (temperature 0), got {self.n}")
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
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            prompt_logprobs=prompt_logprobs,
        )


class _SamplingBody(_SamplingFields):
    """An OpenAI body: the sampling fields and the model."""

    model: str = Field(min_length=1, max_length=4096)


class CompletionBody(_SamplingBody):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's scoring field: each prompt token's log-prob under the model, and the top k alternatives (TRL's teachers).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    # spotrl's extension: the turn of a multi-turn episode this prompt continues (the router counts affinity per turn).
    turn: int | None = Field(None, ge=1, le=MAX_TURN)

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch, as a batch; unsupported options refused first."""
        if self.echo or (self.best_of or 1) > 1:
            raise ApiError(400, "echo and best_of are not supported")
        prompts = self.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) or not prompts:
            return [prompts]
        return list(prompts)


# How a client names its session (verifiers' `SESSION_ID_HEADER`, a rollout's trace id): its turns go to one replica.
SESSION_HEADER = "x-session-id"
SESSION_PATTERN = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")


class TokenSamplingParams(_SamplingFields):
    """`sampling_params` of vLLM's `/inference/v1/generate` (vLLM's `SamplingParams` by its JSON names)."""

    max_tokens: int | None = Field(None, ge=1)  # None: all the room the context leaves (vLLM's server default)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the sampled token's, and the top k alternatives
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # the route returns token ids, never text: nothing to skip
    detokenize: bool = True


class TokenGenerateBody(BaseModel):
    """`POST /inference/v1/generate` (vLLM 0.32's tokens-in, tokens-out route, `GenerateRequest` of
    `vllm.entrypoints.scale_out.token_in_token_out.protocol`): what verifiers' `TrainClient` sends (through
    `renderers.client.generate`); the fields the fleet does not do (multimodal input, streaming, text output,
    cache salts, priorities, disaggregated KV transfer) are refused by name rather than dropped."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=PRINTABLE)
    model: str | None = Field(None, min_length=1, max_length=4096)  # None: the base model
    token_ids: TokenIds = Field(min_length=1)
    sampling_params: TokenSamplingParams
    return_token_ids: bool | None = None
    output_mode: str = "tokens"
    stream: bool | None = False
    features: Any = None
    content_parts: Any = None
    cache_salt: Any = None
    priority: int = 0
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field asked for that the fleet does not do."""
        refused = {
            "output_mode": self.output_mode != "tokens",
            "stream": bool(self.stream),
            "features": self.features is not None,
            "content_parts": self.content_parts is not None,
            "cache_salt": self.cache_salt is not None,
            "priority": self.priority != 0,
            "kv_transfer_params": self.kv_transfer_params is not None,
            "ec_transfer_params": self.ec_transfer_params is not None,
            "sampling_params.prompt_logprobs": self.sampling_params.prompt_logprobs is not None,
        }
        field = next((name for name, asked in refused.items() if asked), None)
        if field is not None:
            raise ApiError(400, f"{field}: not supported by the fleet's /inference/v1/generate (token ids in and out)")


def session_id(headers: Any) -> str | None:
    """The request's `X-Session-ID`, checked (printable, at most 256 characters); None when it sends none."""
    value = headers.get(SESSION_HEADER)
    if value is None:
        return None
    if not SESSION_PATTERN.match(value):
        raise ApiError(400, "x-session-id: expected 1 to 256 characters of [A-Za-z0-9._:@/+=-]")
    return value


class TokenizeBody(BaseModel):
    """`POST /tokenize` (vLLM's): a text's token ids as the fleet tokenizes prompts (no special tokens added), by
    which a client compares its tokenizer with the fleet's."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=4096)
    prompt: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1, max_length=64)
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @staticmethod
    def texts(conversation: list[dict[str, str]]) -> list[str]:
        """What the chat template tokenizes of a conversation (for `RequestLimits.check_text`)."""
        return [text for m in conversation for text in (m["role"], m["content"])]

    def top_alternatives(self) -> int | None:
        """The engine's `logprobs`: None without log-probs, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS, pattern=PRINTABLE)
    lora_path: str = Field(min_length=1, max_length=4096, pattern=PRINTABLE)
    load_inplace: bool = False


class UnloadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS, pattern=PRINTABLE)


class CutBody(BaseModel):
    """`POST /v1/cut`: the adapters whose generations in flight to cut (`deployments.control.cut`)."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(min_length=1, max_length=64)

    def checked_models(self) -> list[str]:
        """The names, each a valid adapter name, each once (a 400 naming the first that is not)."""
        from contracts.adapters import is_adapter_name

        for name in self.models:
            if not is_adapter_name(name):
                raise ApiError(400, f"models: {name[:170]!r} is not an adapter name")
        return list(dict.fromkeys(self.models))


class RunBody(BaseModel):
    """`POST /v1/runs`: the run to register (`contracts.adapters.RUN_NAME`, checked by the registry)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=PRINTABLE)
    weight: float | None = Field(None, gt=0, le=1e6)  # share of in-flight generations (`fair_share`)
    max_staleness: int | None = Field(None, ge=0, le=1024)  # its window (+ 1) of pinned versions; None: the fleet's
    lora_rank: int | None = Field(None, ge=1, le=512)  # the rank it trains; None: unstated
    lineages: int | None = Field(None, ge=1, le=2)  # 2: it also publishes an ema average (`ema-vN`); None: 1
