"""What the ingress knows about the model it fronts and the fleet it serves: one object for every layer of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from contracts.auth import Secret, signing_secret
from core.config import FleetConfig, FleetSettings
from deployments.api.bodies import RequestLimits


@dataclass
class ApiSettings:
    """What the ingress knows about the model it fronts."""

    base_model: str  # the `model` name meaning "no adapter" (listed first by /v1/models)
    base_fingerprint: str  # which model that is (`core.models.model_fingerprint`): runs check theirs against it
    model_aliases: frozenset[str]  # other names accepted for the base model (e.g. "tiny", the folder path)
    max_model_len: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    chat_ids: Callable[[list[dict[str, Any]], bool], list[int]]
    admin_token: str | None = None
    bucket_url: str = ""  # where the fleet's own lineage (policy-vN) and its runs' prefixes are, credentials redacted
    protect_inference: bool = False
    autoscaling: tuple[int, int] | None = None  # (min_replicas, max_replicas) of an elastic fleet
    limits: RequestLimits = field(default_factory=lambda: RequestLimits.of(FleetSettings()))
    max_loras: int = 4  # LoRA slots per engine: how many runs fit (`deployments.control.runs`)
    max_staleness: int = 2  # the window (+ 1) of a run that states none, and of the fleet's own lineage
    max_lora_rank: int | None = None  # the largest rank a run may register with
    run_idle_timeout_s: float = 600.0  # a run silent for this long is released
    # Generations in flight on the fleet at once, shared by run weight (`deployments.control.fair_share`).
    inflight_budget: int = field(default_factory=lambda: FleetConfig().inflight_limit)
    # Places per live replica (its engine's max_num_seqs) when no fixed budget is set: the budget follows the fleet.
    inflight_per_replica: int | None = None
    default_run_weight: float = 1.0
    # How long like generations of one run wait for each other to share an engine call (`deployments.control.coalesce`).
    coalesce_window_s: float = 0.005
    # Tokens per hashed block of the prefix router (`fleet.router.block_size`): scored sequences that share their first
    # block route alike, and go in one replica call (`deployments.control.coalesce`).
    routing_block_size: int = 32
    # The model deployments' names (`FleetConfig.deployments`: a teacher's, a judge's): replicas of their own, every run's.
    deployed_models: frozenset[str] = frozenset()
    # What every lineage's signing key derives from (`contracts.auth.lineage_key`): the replicas verify with the same.
    signing_secret: Secret | None = None

    @property
    def signing(self) -> Secret:
        return self.signing_secret or signing_secret(self.admin_token)
