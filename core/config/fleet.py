"""A fleet's config: the base model it serves, the bucket its adapters come from, and how it runs.

`FleetConfig` is what `serve_config.yaml` names (`configs/fleet-tiny-cpu.yaml`) and what the ingress and
every replica read. A run that brings its own fleet (`make train` without `--fleet`) derives one from
its own config (`RunConfig.own_fleet`): its model, its bucket, its `fleet` section (the same
`FleetSettings`), sized for that run's LoRA rank and staleness window. A run that joins a shared fleet
states its rank and window when it registers instead, and the fleet checks them against its own.

Slots: vLLM holds `max_loras` adapters per engine. Every lineage pins the versions a sample may still
use (its window, `max_staleness + 1`), plus one slot to load the next version into; a lineage's window is
the run's own (registered with it) or, for lineages no run registered, `fleet.max_staleness`.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import ConfigDict, Field, SecretStr, field_serializer, field_validator, model_validator

from contracts.adapters import split_version_url
from contracts.auth import check_token
from core.config.deprecated import drop_tiny_task
from core.config.judges import JudgeDeployment
from core.config.sections import BucketConfig, ModelConfig, RouterConfig, Section, SpotConfig
from core.config.teacher import ModelDeployment, TeacherDeployment, size_to_student_context
from core.config.tinker import TinkerConfig

# The fleet's model deployments beside the base model's, by field: the order their replicas take cores in.
DEPLOYMENTS = ("teacher", "judge")

# A fleet of its own (`serve run serve_config.yaml`) hosts at least two runs of the default config out of the
# box (window 3 each, plus one slot to load into) with room to spare.
DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 8
DEFAULT_MAX_STALENESS = 2


def slots_needed(windows: list[int]) -> int:
    """Slots that lineages of these windows pin, plus one to load the next version into while the oldest of a
    window still drains."""
    return sum(windows) + 1


class AutoscalingSettings(Section):
    """Ray Serve sizes the replica deployment on the sequences in flight per replica (`deployments.autoscaling`); Ray's
    autoscaler brings the nodes for it (cluster.yaml's rollout groups, min_workers to max_workers)."""

    min_replicas: int = Field(1, ge=1, description="Fewest replicas the fleet shrinks to.")
    max_replicas: int = Field(4, ge=1, description="Most replicas the fleet grows to.")
    target_sequences: float = Field(
        128.0,
        gt=0,
        description="Sequences in flight per replica (running or waiting in its engine) the fleet is sized for.",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="How long the load must call for more replicas before one is added."
    )
    downscale_delay_s: float = Field(
        300.0, ge=0, description="How long the load must call for fewer replicas before one is removed."
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Window the sequences in flight are averaged over.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError("fleet.autoscaling.max_replicas must be >= fleet.autoscaling.min_replicas")
        return self


class FleetSettings(Section):
    """How a fleet runs: its replicas and engines, its slots, its front door, its limits and its tenants.

    `admin_token` is a secret: a pydantic SecretStr (its repr is stars), dumped as None by
    `model_dump` (so never in trackio's run config, the replicas' arguments or Serve's config),
    read only through `contracts.auth.admin_token`, and kept out of validation errors.
    """

    # Assignment errors (cfg.fleet.admin_token = ...) would otherwise quote the rejected token.
    model_config = ConfigDict(hide_input_in_errors=True)

    num_replicas: int = Field(
        2, ge=1, description="vLLM replicas (one engine each); with autoscaling, how many the fleet starts with."
    )
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Grow and shrink the fleet with its load (None: num_replicas, always)."
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="Prefix-hash router settings.")
    max_loras: int | None = Field(
        None,
        ge=1,
        description="LoRA slots per engine; default 8, or max_staleness + 2 for the fleet a run brings along.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Largest LoRA rank the engines accept; default 8, or the run's lora.rank for the fleet it brings.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Versions pinned behind the newest of a lineage no run registered (its own policy-vN, TRL's); "
        "default 2, or the run's rollout.max_staleness.",
    )
    max_num_batched_tokens: int = Field(
        8192, ge=1, description="Tokens one engine step schedules (prefill chunks included); at least max_model_len."
    )
    kv_cache_memory_bytes: int = Field(256 * 2**20, gt=0, description="KV cache size per engine on the CPU.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory per engine (GPU only).")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests one replica accepts at once.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences one engine batches at once.")
    cpu_threads_per_replica: int = Field(1, ge=1, description="CPU cores pinned to each engine on a CPU machine.")
    host: str = Field("127.0.0.1", description="Address the HTTP ingress binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the fleet's front door, its HTTP API.")
    proxy_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of Ray Serve's own HTTP proxy behind the front door (other Serve apps); None: a free one.",
    )
    app_name: str = Field("spotrl", description="Name of the Ray Serve application.")
    admin_token: SecretStr | None = Field(
        None,
        description="Token admin calls require, 16+ characters (SPOTRL_ADMIN_TOKEN in the environment wins).",
    )
    protect_inference: bool = Field(False, description="Also require the admin token on inference endpoints.")
    max_request_bytes: int = Field(
        16 * 2**20,
        ge=1024,
        description="Largest request body the ingress reads (413 beyond, refused by Content-Length).",
    )
    max_json_depth: int = Field(32, ge=8, description="Deepest nesting of arrays and objects in a request body.")
    max_prompts_per_request: int = Field(1024, ge=1, description="Prompts in one /v1/completions batch (vLLM: 1024).")
    max_sequences_per_request: int = Field(4096, ge=1, description="Completions one request may ask for: prompts x n.")
    max_text_chars: int = Field(
        1_000_000, ge=1, description="Characters of text (prompts, chat messages) one request may have tokenized."
    )
    max_prompt_logprobs_per_request: int = Field(
        500_000,
        ge=1,
        description="Log-probs one scoring request may ask for: prompt tokens x (prompt_logprobs + 1) x n.",
    )
    coalesce_window_s: float = Field(
        0.005,
        ge=0,
        le=1,
        description="How long the ingress holds a run's request for another like it to share its engine call, after "
        "the latest one (at most 4 such windows in all; 0: never).",
    )
    poison_ttl_s: float = Field(
        600.0, gt=0, description="How long the ingress refuses a request during which two engines died."
    )
    poison_max_entries: int = Field(
        10_000, ge=1, description="Poison-request fingerprints the ingress remembers at most (oldest dropped first)."
    )
    version_listing_interval_s: float = Field(
        5.0, ge=0, description="Least seconds between a replica's bucket listings for versions newer than it knows."
    )
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources of each replica, e.g. {rollout_node: 1} (its node group).",
    )
    num_gpus_per_replica: float = Field(
        0, ge=0, description="GPUs per replica; 0 on a CPU box (engines pinned to cores)."
    )
    pause_lease_s: float = Field(
        60.0, gt=0, description="Longest a /pause holds the fleet: without /resume the replicas resume by themselves."
    )
    lora_slot_wait_s: float = Field(
        30.0, ge=0, description="How long a load waits for a free LoRA slot while every adapter has requests in flight."
    )
    run_idle_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A run silent this long (no generation, load or heartbeat) is released: token, adapters.",
    )
    inflight_budget: int | None = Field(
        None,
        ge=1,
        description="Sequences in flight at once on the fleet (a request of n holds n), shared by weight; "
        "None: replicas x max_num_seqs.",
    )
    default_run_weight: float = Field(
        1.0, gt=0, le=1e6, description="A run's weight (share of in-flight sequences) when it registers without one."
    )
    adapter_cache_keep: int = Field(
        2,
        ge=0,
        description="Versions per lineage a replica keeps in its disk cache beyond those in use (the newest); "
        "the others are deleted.",
    )
    extra_adapter_dirs: list[str] = Field(
        default_factory=list,
        description="Local folders besides the bucket to load adapters from, e.g. TRL's .vllm_lora.",
    )
    extra_adapter_buckets: list[str] = Field(
        default_factory=list,
        description="Other lineages' bucket prefixes (a finished run's bucket.url) whose versions load under any name.",
    )
    routes: list[str] = Field(
        default_factory=list,
        description='More endpoints of the API: "module:callable"s, each making a deployments.api.routing.Routes from '
        "the app's RouteParts (docs/extending.md).",
    )

    @field_validator("routes")
    @classmethod
    def _route_names(cls, routes: list[str]) -> list[str]:
        """`module:callable` each; whether they import is the fleet builder's to say, before anything starts."""
        for name in routes:
            if ":" not in name:
                raise ValueError(f"{name!r}: expected module:callable")
        return routes

    @model_validator(mode="before")
    @classmethod
    def _wrap_token(cls, data: Any) -> Any:
        # Wrapped before validation, so that an error about the token quotes SecretStr('**********').
        if isinstance(data, dict) and isinstance(data.get("admin_token"), str):
            data = {**data, "admin_token": SecretStr(data["admin_token"])}
        return data

    @field_validator("admin_token")
    @classmethod
    def _check_token(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None:
            check_token(token.get_secret_value(), "")  # the error names the field already
        return token

    @field_serializer("admin_token")
    def _never_dump_the_token(self, token: SecretStr | None) -> None:
        return None


class FleetConfig(Section):
    """A whole fleet: the base model, the bucket, the fleet's settings."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model every replica serves.")
    bucket: BucketConfig = Field(
        default_factory=BucketConfig, description="The fleet's bucket ({run_name} is the fleet's app_name)."
    )
    fleet: FleetSettings = Field(default_factory=FleetSettings, description="Replicas, slots, limits, tenants.")
    spot: SpotConfig = Field(
        default_factory=SpotConfig, description="Spot interruption notices on the replicas' nodes."
    )
    teacher: TeacherDeployment | None = Field(
        None, description="A teacher model served by replicas of its own beside the base model's (distillation)."
    )
    judge: JudgeDeployment | None = Field(
        None, description="A judge model served by replicas of its own beside the base model's (judges name it)."
    )
    tinker: TinkerConfig = Field(
        default_factory=TinkerConfig,
        description="The Tinker API beside the fleet (python -m launch.tinker): its tenants' limits, its learners.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        return drop_tiny_task(data)  # read for one more release

    @model_validator(mode="after")
    def _check_cross_field(self) -> FleetConfig:
        check_fleet(self.model, self.fleet, self.max_loras, self.max_staleness)
        for field, deployment in self.deployments().items():
            size_to_student_context(self.model, deployment.model, f"{field}.model", who=field)
        if self.teacher is not None and self.judge is not None and self.teacher.name == self.judge.name:
            raise ValueError(
                f"judge.name={self.judge.name!r} is teacher.name too: a request reaches a deployment by its model "
                "name, so each needs a name of its own"
            )
        return self

    def deployments(self) -> dict[str, ModelDeployment]:
        """The model deployments the fleet serves beside the base model, by field (`teacher`, `judge`), in the order
        their replicas take cores."""
        return {field: d for field in DEPLOYMENTS if (d := getattr(self, field)) is not None}

    def deployment_fleet(self, field: str) -> FleetConfig:
        """The config of deployment `field`'s replicas: this fleet's settings, that deployment's model, no deployment
        of their own."""
        d = self.deployments().get(field)
        if d is None:
            raise ValueError(f"this fleet has no {field} deployment")
        return self.model_copy(
            update={
                "model": d.model,
                "fleet": self.fleet.model_copy(update={"num_replicas": d.num_replicas}),
                **dict.fromkeys(DEPLOYMENTS),
            }
        )

    @property
    def max_loras(self) -> int:
        """LoRA slots each engine reserves."""
        return self.fleet.max_loras or DEFAULT_MAX_LORAS

    @property
    def max_lora_rank(self) -> int:
        """The rank the engines' LoRA buffers are sized for: the largest a run may train."""
        return self.fleet.max_lora_rank or DEFAULT_MAX_LORA_RANK

    @property
    def max_staleness(self) -> int:
        """The staleness window of lineages no run registered (the fleet's own `policy-vN`, TRL's)."""
        return DEFAULT_MAX_STALENESS if self.fleet.max_staleness is None else self.fleet.max_staleness

    @property
    def window(self) -> int:
        """Versions pinned per lineage no run registered: `max_staleness + 1`."""
        return self.max_staleness + 1

    @property
    def inflight_limit(self) -> int:
        """`inflight_budget`, or the sequences the engines batch at once: beyond that vLLM queues first come first
        served. The fair share counts in sequences too (a request of `n` completions holds `n` places)."""
        return self.fleet.inflight_budget or self.fleet.num_replicas * self.fleet.max_num_seqs

    @property
    def bucket_url(self) -> str:
        return self.bucket.url.format(run_name=self.fleet.app_name)


def trusted_source(fleet: FleetSettings, adapter: str) -> dict[str, list[str]]:
    """`fleet`'s trusted sources with the one `adapter` comes from added: a committed version's lineage prefix
    (`extra_adapter_buckets`), or a PEFT folder's parent (`extra_adapter_dirs`); local paths made absolute."""
    found = split_version_url(adapter)
    if found is not None:
        prefix = found[0]
        if prefix.startswith("file://") and not prefix.startswith("file:///"):
            prefix = f"file://{os.path.abspath(prefix.removeprefix('file://'))}"
        return {"extra_adapter_buckets": [*fleet.extra_adapter_buckets, prefix]}
    folder = os.path.abspath(os.path.expanduser(adapter.removeprefix("file://")))
    return {"extra_adapter_dirs": [*fleet.extra_adapter_dirs, os.path.dirname(folder)]}


def check_fleet(model: ModelConfig, fleet: FleetSettings, max_loras: int, max_staleness: int) -> None:
    """ValueError (naming the fields) for a fleet that could not serve: what a fleet's config and a run's own
    fleet section are both checked against."""
    if fleet.max_num_batched_tokens < model.max_model_len:
        raise ValueError("fleet.max_num_batched_tokens must be >= model.max_model_len (one prompt per engine step)")
    scaling = fleet.autoscaling
    if scaling is not None and not scaling.min_replicas <= fleet.num_replicas <= scaling.max_replicas:
        raise ValueError(
            "fleet.num_replicas (the replicas the fleet starts with) must lie within fleet.autoscaling.min_replicas "
            f"and max_replicas ({scaling.min_replicas}..{scaling.max_replicas})"
        )
    if fleet.proxy_port == fleet.port:
        raise ValueError(
            f"fleet.proxy_port ({fleet.proxy_port}) must be a port other than fleet.port: Serve's own proxy listens "
            "behind the fleet's front door"
        )
    if max_loras < slots_needed([max_staleness + 1]):
        raise ValueError(
            f"fleet.max_loras must be >= max_staleness + 2 = {max_staleness + 2} "
            "(vLLM silently evicts adapters that still have requests in flight)"
        )
