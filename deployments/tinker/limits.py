"""What one request may ask of the learner and the fleet, checked before anything of it is built.

One event loop and one learner serve every tenant: a body that makes the service allocate what its bytes do not
hold (a sparse tensor's declared shape), a token id beyond the embedding table (a device-side assert on CUDA, a
restart of every rank of a learner group: every tenant's adapters lost), a sample of millions of sequences, or a
LoRA rank the fleet's engines cannot load, is refused here with the reason, as the SDK's 400. The limits are the
fleet's own (`TinkerSettings.of_fleet`): its context length, its model's vocabulary, its largest LoRA rank, its
completions per request. A `forward_backward` is checked from its bytes alone (`check_forward_backward`), in a
worker thread like its decoding (`Limits.loss_call`), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from contracts.tinker import LOSS_CONFIG, LOSS_INPUTS, LossCall
from deployments.tinker.wire import TOKEN_DTYPE, loss_call, tensor_length, tensor_values

# Losses the SDK names that this server does not compute, and why; a request naming one is refused at once.
NOT_HERE = {
    "stable_reinforce": "it needs the sampler's per-sequence stability records (record_stability_info), "
    "which this server does not keep",
}


class Refused(ValueError):
    """A request over a limit, or asking for what this server does not do (a 400 with this reason)."""


@dataclass(frozen=True)
class Limits:
    """The bounds of one request: tokens per datum (`max_context`) and per call, token ids, samples, LoRA rank."""

    max_context: int
    vocab_size: int
    max_tokens_per_call: int
    max_samples: int
    max_lora_rank: int

    @classmethod
    def of(cls, settings) -> Limits:
        """The limits a `TinkerSettings` holds."""
        return cls(
            settings.max_context,
            settings.vocab_size,
            settings.max_tokens_per_call,
            settings.max_samples,
            settings.max_lora_rank,
        )

    def lora_rank(self, rank: int) -> None:
        """A training client's rank: the fleet loads no adapter above its `max_lora_rank`, so its weights could
        never be sampled (the first save for the sampler would fail)."""
        if not 1 <= rank <= self.max_lora_rank:
            raise Refused(
                f"lora_config.rank {rank}: this server's fleet serves LoRA ranks 1..{self.max_lora_rank} "
                f"(its max_lora_rank); ask for rank {self.max_lora_rank} or less"
            )

    def optimizer(self, config: types.OptimizerConfig) -> None:
        """The optimizer a training client is created for: AdamW alone is served (its `optim_step` takes AdamParams)."""
        if not isinstance(config, types.AdamOptimizerConfig):
            raise Refused(
                f"optimizer_config: {type(config).__name__} is not supported here; only AdamOptimizerConfig (adamw)"
            )

    def token_ids(self, ids: np.ndarray, what: str) -> None:
        """Every id a row of the embedding table."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise Refused(f"{what}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")

    def loss(self, loss_fn: str, config: dict[str, float]) -> None:
        """A built-in loss this server computes, with keys it reads."""
        if loss_fn in NOT_HERE:
            raise Refused(
                f"loss_fn {loss_fn!r} is not supported here: {NOT_HERE[loss_fn]}; use 'ppo' (or 'importance_sampling', "
                f"'cispo', 'dro') with the sampler's logprobs and your advantages"
            )
        if loss_fn not in LOSS_INPUTS:
            raise Refused(f"loss_fn {loss_fn!r} is not supported here; supported: {', '.join(LOSS_INPUTS)}")
        unknown = sorted(set(config) - set(LOSS_CONFIG[loss_fn]))
        if unknown:
            raise Refused(
                f"loss_fn_config for {loss_fn}: unknown keys {unknown}; it takes {sorted(LOSS_CONFIG[loss_fn])}"
            )

    def check_forward_backward(self, message: pb.ForwardBackwardRequest) -> None:
        """Every datum's tokens within the context and the vocabulary, the call's within `max_tokens_per_call`, and
        each loss input one value per token, as its bytes say (a declared shape is checked against them), before
        anything is decoded."""
        self.loss(message.loss_fn, {**message.loss_fn_config, **{k: 0.0 for k in message.loss_fn_config_v2}})
        allowed = {"target_tokens", *LOSS_INPUTS[message.loss_fn]}
        total = 0
        for i, datum in enumerate(message.data):
            length = 0
            for chunk in datum.model_input:
                if chunk.WhichOneof("chunk") != "encoded_text":
                    raise Refused(f"data[{i}]: only encoded_text chunks are supported, got {chunk.WhichOneof('chunk')}")
                raw = chunk.encoded_text.tokens
                if len(raw) % TOKEN_DTYPE.itemsize:
                    raise Refused(f"data[{i}]: encoded_text tokens are not whole int32 values")
                length += len(raw) // TOKEN_DTYPE.itemsize
            if not 1 <= length <= self.max_context:
                raise Refused(f"data[{i}]: {length} tokens; a datum holds 1..{self.max_context} (the context length)")
            total += length
            if total > self.max_tokens_per_call:
                raise Refused(
                    f"data[:{i + 1}]: {total} tokens exceed {self.max_tokens_per_call} per forward_backward; "
                    "send fewer datums per call"
                )
            for chunk in datum.model_input:
                self.token_ids(np.frombuffer(chunk.encoded_text.tokens, dtype=TOKEN_DTYPE), f"data[{i}].model_input")
            names = set(datum.loss_fn_inputs)
            if "target_tokens" not in names:
                raise Refused(f"data[{i}]: loss_fn_inputs['target_tokens'] is missing")
            if names - allowed:
                raise Refused(
                    f"data[{i}]: loss_fn_inputs {sorted(names - allowed)} are not read by {message.loss_fn} "
                    f"(it reads {sorted(allowed)})"
                )
            for name, tensor in datum.loss_fn_inputs.items():
                try:
                    count = tensor_length(tensor, name)
                except ValueError as exc:
                    raise Refused(f"data[{i}]: {exc}") from None
                if count != length:
                    raise Refused(f"data[{i}]: loss_fn_inputs[{name!r}] holds {count} values for {length} tokens")
            self.token_ids(
                tensor_values(datum.loss_fn_inputs["target_tokens"], "target_tokens", length),
                f"data[{i}].target_tokens",
            )

    def loss_call(self, message: pb.ForwardBackwardRequest) -> LossCall:
        """The checked request as the learner's `LossCall` (CPU work: call it in a worker thread)."""
        self.check_forward_backward(message)
        return loss_call(message)

    def sample(self, body: types.SampleRequest, prompt: list[int]) -> None:
        """A sample within the fleet's completions per request, the context and the vocabulary, asking only for what
        is served (how many tokens it may add within the context is the fleet's to check: it knows a scoring
        request's room)."""
        unserved = {
            "topk_prompt_logprobs": body.topk_prompt_logprobs > 0,
            "topk_sample_logprobs": body.topk_sample_logprobs > 0,
            "target_prompt_logprobs": body.target_prompt_logprobs is not None,
            "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
        }
        asked = [name for name, set_ in unserved.items() if set_]
        if asked:
            raise Refused(f"{', '.join(asked)}: not supported by this server (top-1 log-probs only); leave unset")
        if body.record_stability_info:  # asked by a client that trains with stable_reinforce: say what works instead
            raise Refused(
                "record_stability_info: this server keeps no sampling records, so it does not train stable_reinforce; "
                "sample without them and train with loss_fn 'ppo' (the cookbook's AsyncConfig(loss_fn='ppo'))"
            )
        if not 1 <= body.num_samples <= self.max_samples:
            raise Refused(f"num_samples {body.num_samples}: this server samples 1..{self.max_samples} per request")
        if not 1 <= len(prompt) <= self.max_context:
            raise Refused(f"prompt: {len(prompt)} tokens; a prompt holds 1..{self.max_context} (the context length)")
        self.token_ids(np.asarray(prompt, dtype=np.int64), "prompt")
        stop = body.sampling_params.stop
        if stop and not isinstance(stop, str) and isinstance(next(iter(stop)), int):
            self.token_ids(np.asarray(list(stop), dtype=np.int64), "sampling_params.stop")
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and (not body.prompt_logprobs or not 1 <= last_n <= len(prompt) - 1):
            raise Refused(
                f"prompt_logprobs_last_n {last_n}: needs prompt_logprobs and must be 1..{len(prompt) - 1} "
                "(the prompt's length less one)"
            )
