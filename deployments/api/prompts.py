"""A valid body's prompts as the engine's requests: tokenized by the ingress, every token id checked.

Prompts are tokenized here, never by vLLM, with the tokenizer that was checked to round-trip: what the
learner later scores is exactly what was sampled. Every token id is checked against the vocabulary (an id
beyond the embedding table crashes an engine) and every prompt against `max_model_len` (a scoring request may fill
it). Tokenizing is CPU
work: the routes call these methods in a worker thread (`deployments.control.offload`).
"""

from __future__ import annotations

from contracts.serving import SCORING_ROOM, GenerateRequest
from deployments.api.bodies import ChatCompletionBody, CompletionBody, TokenGenerateBody
from deployments.api.settings import ApiSettings
from deployments.control.errors import ApiError


class Prompts:
    """Engine requests for the model of `settings`."""

    def __init__(self, settings: ApiSettings):
        self.settings = settings

    def resolve_model(self, name: str) -> str:
        """The base model's aliases are one name, so the router hashes one namespace for all of them."""
        base = self.settings.base_model
        return base if name in self.settings.model_aliases or name == base else name

    def check_vocabulary(self, ids: list[int], what: str) -> None:
        """Every id a token of the model: an id beyond the embedding table crashes an engine."""
        vocab = self.settings.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{what}: token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def room(self, ids: list[int], max_tokens: int | None, scoring: bool = False) -> int:
        """`max_tokens` for a valid prompt `ids`: the one asked for, or all the room the context leaves. A `scoring`
        request (it asks for `prompt_logprobs`) of one token may fill the context: its one token is sampled in the
        engines' room past it (`contracts.serving.SCORING_ROOM`), so a sample of the full length is scored whole."""
        limit = self.settings.max_model_len
        if not ids:
            raise ApiError(400, "prompt: empty")
        self.check_vocabulary(ids, "prompt")
        room = limit - len(ids)
        if scoring and room == 0 and max_tokens in (None, SCORING_ROOM):
            return SCORING_ROOM
        if room < 1:
            raise ApiError(400, f"prompt: {len(ids)} tokens leave no room within max_model_len {limit}")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens: {max_tokens} + {len(ids)} prompt tokens exceed max_model_len {limit}")
        return max_tokens if max_tokens is not None else room

    def completion_jobs(self, body: CompletionBody, prompts: list[str | list[int]]) -> list[GenerateRequest]:
        """The engine's request for each prompt, tokenized and checked; a text the tokenizer refuses is a 400."""
        self.check_vocabulary(body.stop_token_ids or [], "stop_token_ids")
        try:
            id_lists = [self.settings.encode(p) if isinstance(p, str) else p for p in prompts]
        except Exception as e:
            raise ApiError(400, f"prompt: cannot tokenize ({type(e).__name__})") from None
        model = self.resolve_model(body.model)
        return [
            GenerateRequest(
                ids,
                model,
                body.sampling(
                    self.room(ids, body.max_tokens, body.prompt_logprobs is not None),
                    body.logprobs,
                    body.prompt_logprobs,
                ),
                body.turn,
            )
            for ids in id_lists
        ]

    def chat_job(self, body: ChatCompletionBody, messages: list[dict[str, str]]) -> GenerateRequest:
        """The engine's request for a conversation, through the chat template."""
        self.check_vocabulary(body.stop_token_ids or [], "stop_token_ids")
        try:
            ids = self.settings.chat_ids(messages, body.add_generation_prompt)
        except ApiError:
            raise
        except Exception as e:  # the chat template rejected the conversation
            raise ApiError(400, f"messages: cannot apply the chat template ({type(e).__name__}: {e})") from None
        max_tokens = self.room(ids, body.max_completion_tokens or body.max_tokens)
        return GenerateRequest(ids, self.resolve_model(body.model), body.sampling(max_tokens, body.top_alternatives()))

    def token_job(self, body: TokenGenerateBody, session: str | None) -> GenerateRequest:
        """The engine's request for vLLM's `/inference/v1/generate`: the client's token ids as they are (it rendered
        them), checked; `session` (its `X-Session-ID`) keeps its turns on one replica."""
        params = body.sampling_params
        self.check_vocabulary(params.stop_token_ids or [], "sampling_params.stop_token_ids")
        self.check_vocabulary(body.token_ids, "token_ids")
        model = self.resolve_model(body.model or self.settings.base_model)
        sampling = params.sampling(self.room(body.token_ids, params.max_tokens), params.logprobs)
        return GenerateRequest(body.token_ids, model, sampling, session=session)
