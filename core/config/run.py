"""A run's config: one `RunConfig` describes a whole run (model, LoRA, task, env, objectives, training, sampling,
rollout, the fleet it brings or joins, bucket, learner, logging), so that the driver, the learner and the rollout
read the same validated object. Field names follow TRL's AsyncGRPOConfig where one exists, so TRL users find what
they know. Each section checks itself in its own module (`core.config.envs`, `core.config.objectives`,
`core.config.training`, `core.config.tasks`, `core.config.evaluation`); here are the run's own sections and the
checks that cross sections.

The fleet is a product of its own (`core.config.fleet`): a run either brings one along, described by its
`fleet` section (`RunConfig.own_fleet`), or joins one that runs already (`join.url`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from contracts.adapters import RUN_NAME
from core.config.deprecated import move_grpo_keys
from core.config.envs import EnvConfig
from core.config.evaluation import EvalConfig
from core.config.fleet import FleetConfig, FleetSettings, check_fleet, slots_needed, trusted_source
from core.config.judges import JudgeConfig, check_judges
from core.config.objectives import DistillObjectiveConfig, GRPOObjectiveConfig, Objectives
from core.config.sections import (
    VLLM_LORA_RANKS,
    BucketConfig,
    LoraConfig,
    ModelConfig,
    Section,
    SpotConfig,
    TaskConfig,
    vllm_rank_for,
)
from core.config.tasks import RunTask
from core.config.teacher import SelfTeacher, TeacherConfig, size_to_student_context
from core.config.trackers import DEFAULT_TRACKERS, Tracker, check_trackers, move_trackio_switch
from core.config.training import SamplingConfig, TrainConfig


class RolloutConfig(Section):
    """The asynchronous producer of scored groups."""

    mode: Literal["async", "sync"] = Field(
        "async", description="async: generate ahead while the learner trains; sync: generate a batch only when asked."
    )
    max_inflight_tasks: int = Field(32, ge=1, description="Generation requests in flight across the whole fleet.")
    queue_maxsize: int = Field(64, ge=1, description="Scored groups waiting for the learner (backpressure beyond).")
    request_timeout_s: float = Field(120.0, gt=0, description="Timeout of one generation request.")
    max_retries: int = Field(
        5, ge=0, description="Retries of a failed generation request (backoff from 0.2 s) before its group is dropped."
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="Versions a group's oldest token may lag the learner: dropped beyond (drop_at_take), or the "
        "admission bound (bound_at_admission).",
    )
    max_failed_groups: int = Field(
        64,
        ge=1,
        description="Stop the run, naming the cause, once this many groups in a row failed (an environment that fails "
        "on every problem): the driver would wait for ever for groups that never come.",
    )
    partial_rollouts: bool = Field(
        False,
        description="Cut generations in flight under older versions when a newer one is served and continue them "
        "(and later turns) under the newest, token-exact.",
    )
    partial_min_lag: int = Field(
        1, ge=1, description="Cut only generations under versions at least this many versions behind the newest."
    )
    staleness_rule: Literal["drop_at_take", "bound_at_admission"] = Field(
        "bound_at_admission",
        description="bound_at_admission: start a group only within rollout.max_staleness versions of work ahead, train "
        "what finishes up to hard_max_staleness; drop_at_take: drop groups past rollout.max_staleness when taken.",
    )
    hard_max_staleness: int | None = Field(
        None,
        ge=0,
        description="bound_at_admission: drop groups whose oldest token lags more versions; None: twice "
        "rollout.max_staleness, below bucket.keep_versions.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop groups whose rewards are all equal (no advantage) before the learner; more are sampled.",
    )
    dynamic_sampling_max_extra: int = Field(
        64,
        ge=0,
        description="dynamic_sampling: zero-variance groups dropped in a row before the next one is trained anyway.",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong penalty: tokens before sampling.max_completion_length over which it grows; 0 off.",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="The overlong penalty subtracted at the length limit.")
    mask_truncated: bool = Field(
        False, description="Give a sample cut by the length limit no reward (advantage 0) instead of scoring it."
    )


class LearnerConfig(Section):
    """The FSDP LoRA learner actor group."""

    num_workers: int = Field(1, ge=1, description="Learner processes (FSDP world size); one per device.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device kind the learner trains on.")
    batching: Literal["packed", "padded"] = Field(
        "packed", description="packed: padding-free rows up to token_budget; padded: fixed-count padded batches."
    )
    token_budget: int = Field(4096, ge=1, description="Tokens per packed row (micro-batch).")
    per_device_train_batch_size: int = Field(16, ge=1, description="Samples per padded micro-batch (padded only).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="Tokens whose logits exist at once when scoring (never the whole [tokens x vocab])."
    )
    weight_sync_steps: int = Field(1, ge=1, description="Publish a new adapter version every this many steps.")
    save_steps: int = Field(10, ge=1, description="Checkpoint the learner every this many steps.")
    peak_flops: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 1e11},
        description="Peak FLOP/s overrides for MFU, by GPU name or device kind; else app.learner.perf's spec table.",
    )
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves per learner worker.")
    num_gpus_per_worker: float = Field(
        1.0, gt=0, le=1, description="GPUs per learner worker on cuda; below 1 shares a GPU with the fleet's replicas."
    )
    max_restarts: int = Field(3, ge=-1, description="Restarts of a dead learner worker (-1: no limit); it resumes.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources of rank 0, e.g. {learner_node: 1}; ranks pack with it."
    )


class DriftConfig(Section):
    """Thresholds of the drift alarm (`app.diagnosis`), over the steps it judges; a healthy tiny run stays below."""

    dropped_stale_share: float = Field(
        0.05, ge=0, le=1, description="Share of groups dropped as stale (a healthy tiny run: ~1%)."
    )
    clip_share: float = Field(
        0.15,
        ge=0,
        le=1,
        description="Mean share of tokens at the clip bounds (healthy tiny run: median ~1.4%, max ~10%).",
    )
    ratio_std: float = Field(
        0.5, ge=0, description="Mean per-token standard deviation of the learner/sampler ratio (ratio/std)."
    )
    masked_share: float = Field(
        0.1, ge=0, le=1, description="Mean share of tokens GRPO's off-policy masks drop (off_policy/masked_share)."
    )
    slow_sync_share: float = Field(
        0.5, gt=0, description="A weight sync longer than this share of the step time is named as the cause."
    )


class LoggingConfig(Section):
    """Where metrics go and how often the driver talks."""

    run_name: str = Field("tiny-cpu", description="Name of the run: runs/<run_name>/ holds its files.")
    output_dir: str = Field("runs", description="Folder of run outputs (metrics.jsonl, summary.json).")
    report_to: list[Tracker] = Field(
        default_factory=lambda: list(DEFAULT_TRACKERS),
        description="Where each step's metrics go: jsonl (metrics.jsonl, always), trackio (offline), ray (the "
        "dashboard's spotrl_* gauges), tensorboard (runs/<run_name>/tensorboard), wandb (offline, runs/<run_name>/wandb).",
    )
    diagnose_every: int = Field(
        5, ge=1, description="Judge the bottleneck and drift over this many steps; printed when the verdict changes."
    )
    drift: DriftConfig = Field(default_factory=DriftConfig, description="Thresholds of the drift alarm.")
    progress_bar: bool = Field(True, description="Show a progress bar on the terminal.")

    _old_trackio_switch = model_validator(mode="before")(move_trackio_switch)
    _installed = field_validator("report_to")(check_trackers)


class JoinConfig(Section):
    """A shared fleet this run trains on as one of its runs (`make train ARGS="--fleet URL"`), over HTTP alone."""

    url: str | None = Field(
        None, description="URL of a fleet already running to join; None: the run brings its own fleet (`fleet`)."
    )

    @field_validator("url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url and not url.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL")
        return url


class RunConfig(Section):
    """A whole run: its sections, each checking itself, and the checks that cross them."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter.")
    task: RunTask = Field(default_factory=TaskConfig, description="Task, data and rewards.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn environment (none: single-turn).")
    objectives: Objectives = Field(
        default_factory=lambda: [GRPOObjectiveConfig(kind="grpo")],
        min_length=1,
        description="Objectives the learner sums, each divided by its own token count (default: GRPO alone).",
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimizer, schedule and length of the run.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="How the policy samples groups.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout producer.")
    fleet: FleetSettings = Field(
        default_factory=FleetSettings, description="The fleet the run brings along (unless it joins one)."
    )
    join: JoinConfig = Field(default_factory=JoinConfig, description="A shared fleet to join instead.")
    bucket: BucketConfig = Field(default_factory=BucketConfig, description="Adapter and checkpoint bucket.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and output.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation during training, in the background.")
    judges: dict[str, JudgeConfig] = Field(
        default_factory=dict, description="Judges by name, rewards that task.reward_funcs may name (docs/judges.md)."
    )
    spot: SpotConfig = Field(default_factory=SpotConfig, description="Spot interruption notices.")

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        """The `grpo` section of old configs, moved where its keys live now (`core.config.deprecated`)."""
        return move_grpo_keys(data)

    @model_validator(mode="after")
    def _fits_the_fleet(self) -> RunConfig:
        """The adapter's rank, its lineages' windows and a model teacher fit the fleet the run brings."""
        if self.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora.rank={self.lora.rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
        if self.fleet.max_lora_rank is not None and self.lora.rank > self.fleet.max_lora_rank:
            raise ValueError(f"lora.rank={self.lora.rank} exceeds fleet.max_lora_rank={self.fleet.max_lora_rank}")
        own = self.own_fleet_sizes()
        check_fleet(self.model, self.fleet, own["max_loras"], own["max_staleness"])
        if self.ema_teachers and own["max_loras"] < slots_needed([own["max_staleness"] + 1] * 2):
            raise ValueError(
                f"fleet.max_loras={own['max_loras']}: an ema teacher's lineage pins a window beside the policy's, "
                f"give it at least 2 x (max_staleness + 1) + 1 = {slots_needed([own['max_staleness'] + 1] * 2)}"
            )
        teacher = self.teacher_of("model")
        if teacher is not None:
            index = next(i for i, o in enumerate(self.objectives) if o is self.distill)
            size_to_student_context(self.model, teacher.model, f"objectives[{index}].teacher.model")
        return self

    @model_validator(mode="after")
    def _joins_a_fleet(self) -> RunConfig:
        """A run of a shared fleet has a name the fleet takes, and no teacher loaded into a fleet of its own."""
        if not self.join.url:
            return self
        if not RUN_NAME.fullmatch(self.logging.run_name):
            raise ValueError(
                f"logging.run_name={self.logging.run_name!r} cannot name a run of a shared fleet (join.url): "
                "expected 1-32 of a-z, 0-9, '_', '-', starting with a letter or digit"
            )
        for teacher in self.teachers.values():
            if teacher.kind in ("adapter", "model"):
                raise ValueError(
                    f"objectives: teacher.{teacher.kind} is loaded into the fleet a run brings; a run of a shared "
                    "fleet (join.url) names the fleet's base model (teacher: base), itself (teacher: {self: ...}) or "
                    "a server (teacher: {url: ...})"
                )
        return self

    @model_validator(mode="after")
    def _fits_the_context(self) -> RunConfig:
        """A completion, and an episode, fit the model's context."""
        if self.sampling.max_completion_length >= self.model.max_model_len:
            raise ValueError("sampling.max_completion_length must be smaller than model.max_model_len")
        if self.rollout.overlong_buffer >= self.sampling.max_completion_length:  # else every sample is penalised
            raise ValueError("rollout.overlong_buffer must be smaller than sampling.max_completion_length")
        if self.env.max_episode_tokens is not None and self.env.max_episode_tokens > self.model.max_model_len:
            raise ValueError(
                f"env.max_episode_tokens={self.env.max_episode_tokens} exceeds model.max_model_len={self.model.max_model_len}"
            )
        return self

    @model_validator(mode="after")
    def _truncation_with_the_objectives(self) -> RunConfig:
        """The learner takes its log-probs under the sampler's top-k/top-p (`app.learner.truncation`), but not the
        log-probs at a teacher's top k, whose divergence is over the whole vocabulary: refuse the two together."""
        s = self.sampling
        truncated = s.top_k > 0 or s.top_p < 1 or s.min_p > 0
        if truncated and any(getattr(o, "mode", None) == "topk" for o in self.objectives):
            raise ValueError(
                "sampling.top_k/top_p/min_p: distill mode topk compares whole distributions, which a truncated "
                "sampler does not have; sample untruncated (top_k -1, top_p 1, min_p 0) or use mode sampled"
            )
        return self

    @model_validator(mode="after")
    def _env_with_the_rest(self) -> RunConfig:
        """What the environment's kind asks of the rollout and of the tiny model's warm-up."""
        if self.env.verifiers is not None and self.rollout.partial_rollouts:
            raise ValueError(
                "rollout.partial_rollouts: verifiers' training client cannot continue a generation that a weight "
                "update cut; set it false with env.verifiers"
            )
        tools = self.model.tiny.warmup_tools
        if tools is not None and self.env.factory != tools.environment:
            raise ValueError(
                f"model.tiny.warmup_tools.environment={tools.environment!r}: the tiny model is warmed up in the "
                f"run's own environment, env.factory={self.env.factory!r}"
            )
        return self

    @model_validator(mode="after")
    def _judges_fit(self) -> RunConfig:
        check_judges(self.judges, self.task.reward_timeout_s)
        return self

    @model_validator(mode="after")
    def _staleness_rule(self) -> RunConfig:
        """The admission bound's hard limit lies between the window and the versions the bucket keeps."""
        if self.rollout.staleness_rule != "bound_at_admission":
            return self
        hard, staleness = self.hard_max_staleness, self.rollout.max_staleness
        if hard < staleness:
            raise ValueError(
                f"rollout.hard_max_staleness={hard} is below rollout.max_staleness={staleness}: "
                "groups the admission bound let in would be dropped"
            )
        if hard >= self.bucket.keep_versions:  # a later turn may still name the version its episode started under
            raise ValueError(
                f"rollout.hard_max_staleness={hard} must be below bucket.keep_versions={self.bucket.keep_versions}: "
                "a group may still sample under a version that old"
            )
        return self

    @property
    def hard_max_staleness(self) -> int:
        """The staleness past which even finished work is dropped (bound_at_admission): as configured, else twice
        `rollout.max_staleness` (at least its own), kept below `bucket.keep_versions`."""
        if self.rollout.hard_max_staleness is not None:
            return self.rollout.hard_max_staleness
        staleness = self.rollout.max_staleness
        return max(staleness, min(2 * staleness, self.bucket.keep_versions - 1))

    @property
    def max_episode_tokens(self) -> int:
        """Tokens an episode may hold, prompt included: as configured, else the whole context."""
        return self.env.max_episode_tokens or self.model.max_model_len

    @property
    def distill(self) -> DistillObjectiveConfig | None:
        """The run's distill objective, if it has one."""
        return next((o for o in self.objectives if isinstance(o, DistillObjectiveConfig)), None)

    @property
    def teachers(self) -> dict[str, TeacherConfig]:
        """The teachers of the run's distill objective by name (`teacher` when it names one); empty without."""
        return self.distill.named_teachers() if self.distill is not None else {}

    @property
    def teacher(self) -> TeacherConfig | None:
        """The teacher of the run's distill objective, if it names one; of several, the first."""
        return next(iter(self.teachers.values()), None)

    @property
    def ema_teachers(self) -> list[SelfTeacher]:
        """The run's `ema` self teachers: they score with the average of its versions that its learner keeps."""
        return self.distill.ema_teachers() if self.distill is not None else []

    @property
    def lineages(self) -> int:
        """The lineages of adapter versions the run publishes: its policy, and its ema average for an ema teacher."""
        return 2 if self.ema_teachers else 1

    def teacher_of(self, kind: str) -> TeacherConfig | None:
        """The run's teacher of `kind` (adapter, model: at most one each), if it has one."""
        return next((t for t in self.teachers.values() if t.kind == kind), None)

    def own_fleet_sizes(self) -> dict[str, Any]:
        """The slots, rank and staleness window of the fleet this run brings: as its `fleet` section says, else
        sized for this run alone (each of its lineages' windows and one slot to load into, one more for a teacher
        adapter; its rank); and where a teacher adapter may be loaded from."""
        staleness = self.rollout.max_staleness if self.fleet.max_staleness is None else self.fleet.max_staleness
        adapter_teacher = self.teacher_of("adapter")
        teacher_adapter = adapter_teacher.adapter if adapter_teacher is not None else None
        return {
            "max_staleness": staleness,
            "max_loras": self.fleet.max_loras
            or slots_needed([staleness + 1] * self.lineages) + (teacher_adapter is not None),
            "max_lora_rank": self.fleet.max_lora_rank or vllm_rank_for(self.lora.rank),
            **(trusted_source(self.fleet, teacher_adapter) if teacher_adapter else {}),
        }

    def own_fleet(self) -> FleetConfig:
        """The fleet this run brings along when it joins none: its model, its bucket, its `fleet` section, and
        the teacher deployment of a `model` teacher."""
        bucket = self.bucket.model_copy(update={"url": self.bucket_url.replace("{", "{{").replace("}", "}}")})
        return FleetConfig(
            model=self.model,
            bucket=bucket,
            fleet=self.fleet.model_copy(update=self.own_fleet_sizes()),
            spot=self.spot,
            teacher=model_teacher.deployment() if (model_teacher := self.teacher_of("model")) is not None else None,
        )

    @property
    def fleet_run(self) -> str | None:
        """This run's name on a shared fleet it joined (`join.url`), which namespaces its adapters
        (`<run>/policy-vN`); None when the run brings its own fleet."""
        return self.logging.run_name if self.join.url else None

    @property
    def window(self) -> int:
        """The versions of this run's lineage a sample may still use: `rollout.max_staleness + 1`."""
        return self.rollout.max_staleness + 1

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.output_dir) / self.logging.run_name

    @property
    def bucket_url(self) -> str:
        return self.bucket.url.format(run_name=self.logging.run_name)
