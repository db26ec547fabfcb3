"""The Tinker API's capacity and limits: how many training clients, how long a silent session lives, body sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TinkerSettings(BaseModel):
    """What `launch/tinker.py` hands the service; every limit a tenant can reach has its own field."""

    model_config = ConfigDict(extra="forbid")

    fleet_url: str = Field(description="The fleet's HTTP address the service samples through (loopback, same proxy).")
    base_model: str = Field(description="The fleet's base model id, what create_lora_training_client must name.")
    model_path: str = Field(description="The base model's folder (the fleet's own name for it is accepted too).")
    tokenizer_id: str | None = Field(
        None, description="What the SDK's get_tokenizer loads: the hub id of a hub model; None: model_path."
    )
    max_context: int = Field(
        ge=2, description="Longest datum or prompt, in tokens: the fleet's model.max_model_len (`of_fleet`)."
    )
    vocab_size: int = Field(ge=1, description="Rows of the base model's embedding table: every token id is below it.")
    max_lora_rank: int = Field(ge=1, description="Largest LoRA rank a training client may have: the fleet's.")
    max_samples: int = Field(
        ge=1, description="Sequences one sample request may ask for: the fleet's max_sequences_per_request."
    )
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
    cache_dir: str = Field(description="Where the learner caches bucket files it reads.")
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

    @classmethod
    def of_fleet(cls, fleet, fleet_url: str, base_model: str, model_path: str, **fields) -> TinkerSettings:
        """The settings of the service beside `fleet` (a `core.config.FleetConfig`): its context length, largest LoRA
        rank and completions per request are the fleet's, the vocabulary its model's, the tokenizer its hub id (a
        client on another machine loads it by that name); `fields` set the rest."""
        name = fleet.model.name_or_path
        hub_id = name != "tiny" and not Path(name).expanduser().exists()
        derived = {
            "tokenizer_id": name if hub_id else None,
            "max_context": fleet.model.max_model_len,
            "vocab_size": model_vocab_size(model_path),
            "max_lora_rank": fleet.max_lora_rank,
            "max_samples": fleet.fleet.max_sequences_per_request,
        }
        return cls(fleet_url=fleet_url, base_model=base_model, model_path=model_path, **{**derived, **fields})


def model_vocab_size(model_path: str) -> int:
    """The rows of the embedding table of the model in `model_path` (its `config.json`), which may exceed the
    tokenizer's vocabulary; an id at or past it is out of the table."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise ValueError(f"{model_path}/config.json names no vocab_size")
    return int(size)
