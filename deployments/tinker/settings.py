"""What the Tinker service runs with: the fleet's `tinker:` section (`core.config.tinker.TinkerConfig`: capacity,
limits, learners) and what it takes from the fleet it stands beside (its address, model, context, ranks)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from core.config.tinker import TinkerConfig


class TinkerSettings(TinkerConfig):
    """What `launch/tinker.py` hands the service: the fleet's `tinker:` section and what `of_fleet` derives."""

    fleet_url: str = Field(description="The fleet's HTTP address the service samples through (its front door).")
    fleet_app: str = Field("spotrl", description="The fleet's Serve application, whose front door hands on /api.")
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
    cache_dir: str = Field(description="Where the service and the learner cache bucket files they read.")

    @classmethod
    def of_fleet(cls, fleet, fleet_url: str, base_model: str, model_path: str, **fields) -> TinkerSettings:
        """The settings of the service beside `fleet` (a `core.config.FleetConfig`): its `tinker:` section, and its
        context length, largest LoRA rank and completions per request, the vocabulary its model's, the tokenizer its
        hub id (a client on another machine loads it by that name); `fields` override any of them."""
        name = fleet.model.name_or_path
        hub_id = name != "tiny" and not Path(name).expanduser().exists()
        derived = {
            "tokenizer_id": name if hub_id else None,
            "max_context": fleet.model.max_model_len,
            "vocab_size": model_vocab_size(model_path),
            "max_lora_rank": fleet.max_lora_rank,
            "max_samples": fleet.fleet.max_sequences_per_request,
        }
        section = fleet.tinker.model_dump()
        return cls(
            fleet_url=fleet_url,
            fleet_app=fleet.fleet.app_name,
            base_model=base_model,
            model_path=model_path,
            **{**section, **derived, **fields},
        )


def model_vocab_size(model_path: str) -> int:
    """The rows of the embedding table of the model in `model_path` (its `config.json`), which may exceed the
    tokenizer's vocabulary; an id at or past it is out of the table."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise ValueError(f"{model_path}/config.json names no vocab_size")
    return int(size)
