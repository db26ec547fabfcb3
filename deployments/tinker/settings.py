"""The Tinker API's capacity and limits: how many training clients, how long a silent session lives, body sizes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TinkerSettings(BaseModel):
    """What `launch/tinker.py` hands the service; every limit a tenant can reach has its own field."""

    model_config = ConfigDict(extra="forbid")

    fleet_url: str = Field(description="The fleet's HTTP address the service samples through (loopback, same proxy).")
    base_model: str = Field(description="The fleet's base model id, what create_lora_training_client must name.")
    model_path: str = Field(description="The base model's folder: the tokenizer the SDK's get_tokenizer loads.")
    max_context: int = Field(128, ge=2, description="Longest datum or prompt plus completion, in tokens.")
    max_models: int = Field(4, ge=1, description="Training clients (adapters) on each learner at once, all tenants.")
    learners: int = Field(
        1, ge=1, description="Learners the training clients are spread over (each trains its own clients at once)."
    )
    max_models_per_tenant: int = Field(2, ge=1, description="Training clients one API key may hold at once.")
    session_idle_s: float = Field(120.0, gt=0, description="A session without a heartbeat this long is released.")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body, after zstd inflation (413).")
    poll_wait_s: float = Field(20.0, gt=0, description="How long retrieve_future waits before it says try_again.")
    learner_wait_s: float = Field(
        300.0, gt=0, description="How long a request waits for a lost learner to come back before it fails."
    )
    future_ttl_s: float = Field(600.0, gt=0, description="How long a finished future's result is kept for retrieval.")
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
