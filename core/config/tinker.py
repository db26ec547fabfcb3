"""The fleet's `tinker:` section: the self-hosted Tinker API beside it (`python -m launch.tinker`), its tenants'
capacity and limits, and its learners.

What the service takes from the fleet itself (its context length, largest LoRA rank, completions per request, the
model's vocabulary and tokenizer) is not set here: `deployments.tinker.settings.TinkerSettings.of_fleet` derives it.
Set these in the fleet's YAML (`tinker: {max_models: 8}`) or with `--set tinker.max_models=8`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config.sections import Section


class TinkerConfig(Section):
    """Every limit a Tinker tenant can reach, and where the service's learners train."""

    max_tokens_per_call: int = Field(1 << 18, ge=2, description="Tokens of all datums of one forward_backward.")
    max_models: int = Field(4, ge=1, description="Training clients (adapters) on each learner at once, all tenants.")
    learners: int = Field(
        1, ge=1, description="Learners the training clients are spread over (each trains its own clients at once)."
    )
    max_models_per_tenant: int = Field(2, ge=1, description="Training clients one API key may hold at once.")
    session_idle_s: float = Field(120.0, gt=0, description="A session without a heartbeat this long is released.")
    key_recheck_s: float = Field(
        1.0, gt=0, description="How long a key is trusted before the fleet is asked again (a revoked key's bound)."
    )
    sample_lane: int = Field(
        64, ge=1, description="Sample requests one API key has in flight to the fleet at once; others wait their turn."
    )
    sample_merge_window_s: float = Field(
        0.02,
        ge=0,
        description="How long a sample request waits for another like it of its key (same prompt and sampler) to "
        "share one fleet call, after the latest one (at most 4 such windows in all); 0: each goes alone.",
    )
    max_samplers_per_tenant: int = Field(
        64, ge=1, description="Sampling clients one API key holds; beyond it the least recently used is released."
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body, after zstd inflation (413).")
    poll_wait_s: float = Field(20.0, gt=0, description="How long retrieve_future waits before it says try_again.")
    learner_wait_s: float = Field(
        300.0, gt=0, description="How long a request waits for a lost learner to come back before it fails."
    )
    future_ttl_s: float = Field(600.0, gt=0, description="How long a finished future's result is kept for retrieval.")
    turn_wait_s: float = Field(
        300.0, gt=0, description="How long a training client's request waits for those numbered before it, then fails."
    )
    max_seq_ahead: int = Field(
        1024, ge=1, description="How far past its client's turn a request's seq_id may be (429 beyond: wait)."
    )
    learner_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the learner trains: cpu, or cuda (its actor then asks Ray for one GPU)."
    )
    learner_ranks: int = Field(
        1,
        ge=1,
        description="Devices the learner shards the base over (FSDP2), a Ray actor each, on one node; 1: one device.",
    )
    learner_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="The frozen base's dtype on the learner (adapters and AdamW stay fp32); bfloat16 on GPUs.",
    )
