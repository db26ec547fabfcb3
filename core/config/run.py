"""A run's config: one `RunConfig` describes a whole run (model, LoRA, task, env, GRPO, rollout, the fleet it
brings or joins, bucket, learner, logging), so that the driver, the learner and the rollout read the same
validated object. Field names follow TRL's AsyncGRPOConfig where one exists, so TRL users find what they know.

The fleet is a product of its own (`core.config.fleet`): a run either brings one along, described by its
`fleet` section (`RunConfig.own_fleet`), or joins one that runs already (`join.url`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from contracts.adapters import RUN_NAME
from core.config.fleet import FleetConfig, FleetSettings, check_fleet, slots_needed, trusted_source
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
from core.config.teacher import SelfTeacher, TeacherConfig, size_teacher_context


class OpenEnvConfig(Section):
    """An OpenEnv environment (PyPI `openenv`), played over OpenEnv's own WebSocket client (`app.tasks.openenv_env`):
    a server already running (`url`), or an app that the run serves itself on 127.0.0.1 for its duration (`app`).
    Both run in the OpenEnv venv, `.venv-openenv` (`make setup`), where the classes named here are imported."""

    url: str | None = Field(
        None, description="A running OpenEnv server (http:// or ws://), e.g. http://127.0.0.1:8001."
    )
    app: str | None = Field(
        None, description='"module:app": an ASGI app built by OpenEnv\'s create_app, served by the run on 127.0.0.1.'
    )
    client: str = Field(
        "openenv.core.generic_client:GenericEnvClient",
        description="module:Class of the environment's EnvClient; the default, OpenEnv's generic one, sends dicts.",
    )
    action: str | None = Field(
        None,
        description="module:Class of the Action to build (a typed client's); None: a dict, as GenericEnvClient takes.",
    )
    action_field: str = Field("message", description="The Action's text field that the model's turn fills.")
    observation_field: str = Field(
        "message", description="The Observation's text field rendered as the model's next turn (the next user turn)."
    )
    start_timeout_s: float = Field(
        180.0,
        gt=0,
        description="Longest wait for a served app's /health, or the OpenEnv client's process (imports take ~15 s).",
    )

    @field_validator("app", "client", "action")
    @classmethod
    def _module_path(cls, path: str | None) -> str | None:
        if path is not None and ":" not in path:
            raise ValueError("expected module:name")
        return path

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None and url.split("://")[0] not in ("http", "https", "ws", "wss"):
            raise ValueError("expected http(s):// or ws(s)://")
        return url

    @model_validator(mode="after")
    def _one_source(self) -> OpenEnvConfig:
        if (self.url is None) == (self.app is None):
            raise ValueError("a url or an app to serve, exactly one")
        return self


class VerifiersConfig(Section):
    """A verifiers v1 taskset (`verifiers.v1`), run by its env with verifiers' training client pointed at the fleet
    (`app.rollout.verifiers_episodes`); its tasks are the run's problems, its `@vf.reward`s its rewards."""

    taskset: str = Field(
        min_length=1,
        description='The taskset: an installed verifiers taskset id, or "module:TasksetClass" (its module exports it).',
    )
    taskset_args: dict[str, Any] = Field(
        default_factory=dict, description="Fields of the taskset's config (its TasksetConfig subclass), e.g. seed."
    )
    env_id: str = Field("", description="verifiers' env id to pair with the taskset; empty: the taskset's own env.")
    agent: dict[str, Any] = Field(
        default_factory=dict,
        description="verifiers' AgentConfig of the env's agent (harness, runtime, ...); runtime defaults to subprocess.",
    )
    episode_timeout_s: float = Field(
        60.0, gt=0, description="Longest episode (verifiers' env.timeout.episode); beyond, it is lost, counted."
    )
    max_concurrent_episodes: int = Field(64, ge=1, description="Episodes played at once by the rollout.")


class EnvConfig(Section):
    """The environment of multi-turn episodes: spotrl's (`name`, `app.tasks.environments`), an OpenEnv server's
    (`openenv`, `app.tasks.openenv_env`), TRL's `environment_factory` (`factory`, `app.tasks.trl_environments`) or a
    verifiers v1 taskset (`verifiers`); none: single-turn completions."""

    name: str | None = Field(
        None, description='Environment: a registered name (chained_arithmetic, calculator) or "module:Class".'
    )
    factory: str | dict[str, str] | None = Field(
        None,
        description='TRL environment_factory: "module:callable", or names to factories (each problem picks by its environment column).',
    )
    openenv: OpenEnvConfig | None = Field(
        None, description="An OpenEnv environment: {url: ...} or {app: module:app}, played over OpenEnv's client."
    )
    verifiers: VerifiersConfig | None = Field(
        None, description="A verifiers v1 taskset played by its env through verifiers' training client."
    )
    max_tool_calling_iterations: int | None = Field(
        None, ge=0, description="Most tool-calling turns of a TRL environment's episode (TRL's; None: no limit)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment class.")
    max_turns: int = Field(4, ge=1, description="Most model turns of an episode (cut beyond: truncated).")
    max_episode_tokens: int | None = Field(
        None,
        ge=2,
        description="Most tokens of an episode, prompt included (cut beyond: truncated); default max_model_len.",
    )
    timeout_s: float = Field(
        5.0, gt=0, description="Longest reset() or step() call; beyond, the episode ends with reward None."
    )

    @field_validator("name")
    @classmethod
    def _named(cls, name: str | None) -> str | None:
        """A registered name or `module:Class`; whether it names an environment is the run side's to say at start
        (`app.tasks.registry.check_names`), before anything runs."""
        if name is not None and not name.strip():
            raise ValueError("an environment's name, or no env.name for single-turn completions")
        return name

    @field_validator("factory")
    @classmethod
    def _factories(cls, factory: str | dict[str, str] | None) -> str | dict[str, str] | None:
        """`module:callable`, or a non-empty mapping of names to such; whether they import is the run side's to say
        at start (`app.tasks.checks.check_names`)."""
        paths = [factory] if isinstance(factory, str) else list((factory or {}).values())
        if isinstance(factory, dict) and not factory:
            raise ValueError("a mapping of environment names to factories needs at least one")
        for path in paths:
            if ":" not in path:
                raise ValueError(f"{path!r}: expected module:callable")
        return factory

    @model_validator(mode="after")
    def _one_kind(self) -> EnvConfig:
        named = [k for k in ("name", "factory", "openenv", "verifiers") if getattr(self, k) is not None]
        if len(named) > 1:
            raise ValueError(f"env.{', env.'.join(named)}: one environment, not several")
        return self

    @property
    def multi_turn(self) -> bool:
        """Episodes against spotrl's runner (`app.rollout.episodes`): a named environment or an OpenEnv one."""
        return self.name is not None or self.openenv is not None


class GRPOConfig(Section):
    """The GRPO algorithm (names as in TRL's AsyncGRPOConfig)."""

    num_generations: int = Field(8, ge=2, description="Samples per prompt (the group size G).")
    num_prompts_per_step: int = Field(16, ge=1, description="Prompts (groups) consumed per optimizer step.")
    max_completion_length: int = Field(8, ge=1, description="Most tokens generated per completion.")
    temperature: float = Field(
        1.0, gt=0, le=2, description="Sampling temperature (vLLM's range); the learner scores at the same one."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 disables).")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate of the adapter.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning rate schedule."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    epsilon: float = Field(0.2, ge=0, lt=1, description="Lower clip: ratio is clipped at 1 - epsilon.")
    epsilon_high: float = Field(0.2, ge=0, description="Upper clip: ratio is clipped at 1 + epsilon_high.")
    vllm_importance_sampling_correction: bool = Field(
        False, description="Truncated importance sampling against the sampler's log-probs."
    )
    vllm_importance_sampling_cap: float = Field(2.0, gt=0, description="Cap of the truncated importance weight.")
    max_staleness: int = Field(
        4,
        ge=0,
        description="Versions a group's oldest token may lag the learner: dropped beyond (drop_at_take), or the "
        "admission bound (bound_at_admission).",
    )
    weight_sync_steps: int = Field(1, ge=1, description="Publish a new adapter version every this many steps.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    seed: int = Field(42, description="Seed of the learner and the prompt order.")


class GRPOObjectiveConfig(Section):
    """GRPO as a term of the learner's loss (`app.objectives.grpo`): its settings are the `grpo` section's."""

    kind: Literal["grpo"] = Field(
        description="The objective: grpo (group-normalised advantages, TRL's clipped loss; its settings in `grpo`)."
    )
    weight: float = Field(1.0, gt=0, description="Weight of this objective's loss in the learner's sum.")


# The most alternatives a fleet's scoring request may ask for (`deployments.api.bodies.MAX_LOGPROBS`, vLLM's default
# max_logprobs); a teacher that is asked more answers 400.
MAX_TEACHER_TOP_K = 20
TOPK_FIELDS = frozenset({"top_k", "alpha", "tail", "is_clip"})  # what only the topk mode reads


class DistillObjectiveConfig(Section):
    """On-policy distillation (`app.objectives.distill`): the reverse KL to a teacher at every sampled token, or a
    divergence over the teacher's top-k tokens at every position (`mode: topk`)."""

    kind: Literal["distill"] = Field(
        description="The objective: distill (a teacher scores the student's samples; per-token reverse KL)."
    )
    weight: float = Field(1.0, gt=0, description="Weight of this objective's loss in the learner's sum.")
    teacher: TeacherConfig | None = Field(
        None, description="The teacher: base, {adapter: ...}, {model: {...}}, {url: ...} or {self: {...}}."
    )
    teachers: dict[str, TeacherConfig] | None = Field(
        None, description="Several teachers by name, instead of `teacher`: each problem picks one by `teacher_field`."
    )
    teacher_field: str = Field(
        "teacher", description="With `teachers`: the problem's column naming its teacher (none: the one named default)."
    )
    coef: float = Field(
        1.0,
        gt=0,
        description="Scale of the signal: sampled, advantage = -coef x (sampler's - teacher's log-prob); topk, "
        "coef x divergence.",
    )
    max_gap: float = Field(
        20.0, gt=0, description="Largest per-token gap (nats) counted; a token the teacher rules out counts this much."
    )
    mode: Literal["sampled", "topk"] = Field(
        "sampled",
        description="sampled: reverse KL at the sampled token; topk: a divergence over the teacher's top_k (TRL's "
        "topk_logits).",
    )
    top_k: int = Field(
        20,
        ge=1,
        le=MAX_TEACHER_TOP_K,
        description=f"topk: the teacher's most likely tokens per position distilled (the fleet answers at most "
        f"{MAX_TEACHER_TOP_K}).",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="topk: generalised JSD between forward KL (0) and reverse KL (1), TRL's distillation_alpha.",
    )
    tail: bool = Field(
        False, description="topk: one more bucket for the mass outside the top k (else both are renormalised over it)."
    )
    is_clip: float | None = Field(
        2.0,
        gt=0,
        description="topk: clip of the importance weight exp(learner - sampler log-prob) per token; null: none.",
    )

    @model_validator(mode="after")
    def _topk_fields_in_topk_mode(self) -> DistillObjectiveConfig:
        """A top-k setting given in sampled mode would be ignored without a word: refuse it instead (its default
        is no setting, so that a dumped config loads again)."""
        fields = type(self).model_fields
        given = sorted(f for f in TOPK_FIELDS if getattr(self, f) != fields[f].default)
        if self.mode == "sampled" and given:
            raise ValueError(f"{', '.join(given)}: only for mode topk (mode is sampled)")
        return self

    @model_validator(mode="after")
    def _one_or_several(self) -> DistillObjectiveConfig:
        if (self.teacher is None) == (self.teachers is None):
            raise ValueError("name a teacher, or several as teachers: {<name>: <teacher>}, not both nor neither")
        if self.teachers is not None:
            if not self.teachers:
                raise ValueError("teachers: name at least one")
            for name in self.teachers:
                if not RUN_NAME.fullmatch(name):
                    raise ValueError(f"teachers: {name!r} cannot name a teacher (1-32 of a-z, 0-9, '_', '-')")
            for kind in ("adapter", "model"):  # the fleet a run brings has one teacher slot and one deployment
                named = [n for n, t in self.teachers.items() if t.kind == kind]
                if len(named) > 1:
                    raise ValueError(f"teachers: at most one {kind} teacher (got {', '.join(named)})")
        return self

    def named_teachers(self) -> dict[str, TeacherConfig]:
        """The objective's teachers by name: the one `teacher` as `teacher`, or `teachers`."""
        return dict(self.teachers) if self.teachers is not None else {"teacher": self.teacher}


# One term of the learner's loss (`app.objectives`), told apart by its `kind`.
ObjectiveConfig = Annotated[GRPOObjectiveConfig | DistillObjectiveConfig, Field(discriminator="kind")]


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
        description="bound_at_admission: start a group only within grpo.max_staleness versions of work ahead, train "
        "what finishes up to hard_max_staleness; drop_at_take: drop groups past grpo.max_staleness when taken.",
    )
    hard_max_staleness: int | None = Field(
        None,
        ge=0,
        description="bound_at_admission: drop groups whose oldest token lags more versions; None: twice "
        "grpo.max_staleness, below bucket.keep_versions.",
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
    slow_sync_share: float = Field(
        0.5, gt=0, description="A weight sync longer than this share of the step time is named as the cause."
    )


class LoggingConfig(Section):
    """Where metrics go and how often the driver talks."""

    run_name: str = Field("tiny-cpu", description="Name of the run: runs/<run_name>/ holds its files.")
    output_dir: str = Field("runs", description="Folder of run outputs (metrics.jsonl, summary.json).")
    trackio: bool = Field(True, description="Also log to trackio (offline, SQLite).")
    diagnose_every: int = Field(
        5, ge=1, description="Judge the bottleneck and drift over this many steps; printed when the verdict changes."
    )
    drift: DriftConfig = Field(default_factory=DriftConfig, description="Thresholds of the drift alarm.")
    progress_bar: bool = Field(True, description="Show a progress bar on the terminal.")


class JoinConfig(Section):
    """A shared fleet this run trains on as one of its runs (`make train ARGS="--fleet URL"`), over HTTP alone."""

    url: str | None = Field(
        None, description="URL of a fleet already running to join; None: the run brings its own fleet (`fleet`)."
    )


class RunConfig(Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Task, data and rewards.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn environment (none: single-turn).")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO algorithm.")
    objectives: list[ObjectiveConfig] = Field(
        default_factory=lambda: [GRPOObjectiveConfig(kind="grpo")],
        min_length=1,
        description="Objectives the learner sums, each divided by its own token count (default: GRPO alone).",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout producer.")
    fleet: FleetSettings = Field(
        default_factory=FleetSettings, description="The fleet the run brings along (unless it joins one)."
    )
    join: JoinConfig = Field(default_factory=JoinConfig, description="A shared fleet to join instead.")
    bucket: BucketConfig = Field(default_factory=BucketConfig, description="Adapter and checkpoint bucket.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and output.")
    spot: SpotConfig = Field(default_factory=SpotConfig, description="Spot interruption notices.")

    @model_validator(mode="after")
    def _check_cross_field(self) -> RunConfig:
        if self.env.verifiers is not None and self.rollout.partial_rollouts:
            raise ValueError(
                "rollout.partial_rollouts: verifiers' training client cannot continue a generation that a weight "
                "update cut; set it false with env.verifiers"
            )
        if self.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora.rank={self.lora.rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
        if self.fleet.max_lora_rank is not None and self.lora.rank > self.fleet.max_lora_rank:
            raise ValueError(f"lora.rank={self.lora.rank} exceeds fleet.max_lora_rank={self.fleet.max_lora_rank}")
        own = self.own_fleet_sizes()
        check_fleet(self.model, self.fleet, own["max_loras"], own["max_staleness"])
        emas = {(t.update_rate, t.sync_steps) for t in self.ema_teachers}
        if len(emas) > 1:
            raise ValueError(
                f"ema teachers of one run share the learner's one average: one update_rate and sync_steps, not {sorted(emas)}"
            )
        if emas and own["max_loras"] < slots_needed([own["max_staleness"] + 1] * 2):
            raise ValueError(
                f"fleet.max_loras={own['max_loras']}: an ema teacher's lineage pins a window beside the policy's, "
                f"give it at least 2 x (max_staleness + 1) + 1 = {slots_needed([own['max_staleness'] + 1] * 2)}"
            )
        if self.join.url and not RUN_NAME.fullmatch(self.logging.run_name):
            raise ValueError(
                f"logging.run_name={self.logging.run_name!r} cannot name a run of a shared fleet (join.url): "
                "expected 1-32 of a-z, 0-9, '_', '-', starting with a letter or digit"
            )
        if self.join.url and not self.join.url.startswith(("http://", "https://")):
            raise ValueError(f"join.url={self.join.url!r}: expected an http:// or https:// URL")
        kinds = [o.kind for o in self.objectives]
        if len(set(kinds)) < len(kinds):
            raise ValueError(f"objectives: each kind at most once (got {kinds}): their metrics would mix")
        teacher = self.teacher_of("model")
        if teacher is not None:
            index = next(i for i, o in enumerate(self.objectives) if o is self.distill)
            size_teacher_context(self.model, teacher.model, f"objectives[{index}].teacher.model")
        for teacher in self.teachers.values():
            if self.join.url and teacher.kind in ("adapter", "model"):
                raise ValueError(
                    f"objectives: teacher.{teacher.kind} is loaded into the fleet a run brings; a run of a shared "
                    "fleet (join.url) names the fleet's base model (teacher: base), itself (teacher: {self: ...}) or "
                    "a server (teacher: {url: ...})"
                )
        if self.grpo.max_completion_length >= self.model.max_model_len:
            raise ValueError("grpo.max_completion_length must be smaller than model.max_model_len")
        if self.task.name == "math" and not self.task.dataset:
            raise ValueError("task.dataset is required when task.name is math")
        if self.task.name == "reasoning_gym" and not self.task.datasets:
            raise ValueError(
                "task.datasets: at least one reasoning-gym dataset is required when task.name is reasoning_gym"
            )
        if self.task.name != "reasoning_gym" and self.task.datasets:
            # Ignored datasets would be a run silently trained on something else than its config says.
            raise ValueError(
                f"task.datasets: reasoning-gym datasets need task.name reasoning_gym (got {self.task.name})"
            )
        if self.task.chain_min > self.task.chain_max:
            raise ValueError("task.chain_min must not exceed task.chain_max")
        self._check_staleness_rule()
        tools = self.model.tiny.warmup_tools
        if tools is not None and self.env.factory != tools.environment:
            raise ValueError(
                f"model.tiny.warmup_tools.environment={tools.environment!r}: the tiny model is warmed up in the "
                f"run's own environment, env.factory={self.env.factory!r}"
            )
        if self.env.max_episode_tokens is not None and self.env.max_episode_tokens > self.model.max_model_len:
            raise ValueError(
                f"env.max_episode_tokens={self.env.max_episode_tokens} exceeds model.max_model_len={self.model.max_model_len}"
            )
        return self

    def _check_staleness_rule(self) -> None:
        if self.rollout.staleness_rule != "bound_at_admission":
            return
        hard, staleness = self.hard_max_staleness, self.grpo.max_staleness
        if hard < staleness:
            raise ValueError(
                f"rollout.hard_max_staleness={hard} is below grpo.max_staleness={staleness}: "
                "groups the admission bound let in would be dropped"
            )
        if hard >= self.bucket.keep_versions:  # a later turn may still name the version its episode started under
            raise ValueError(
                f"rollout.hard_max_staleness={hard} must be below bucket.keep_versions={self.bucket.keep_versions}: "
                "a group may still sample under a version that old"
            )

    @property
    def hard_max_staleness(self) -> int:
        """The staleness past which even finished work is dropped (bound_at_admission): as configured, else twice
        `grpo.max_staleness` (at least its own), kept below `bucket.keep_versions`."""
        if self.rollout.hard_max_staleness is not None:
            return self.rollout.hard_max_staleness
        staleness = self.grpo.max_staleness
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
        return [
            t.self_teacher
            for t in self.teachers.values()
            if t.self_teacher is not None and t.self_teacher.model == "ema"
        ]

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
        staleness = self.grpo.max_staleness if self.fleet.max_staleness is None else self.fleet.max_staleness
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
            tiny_task=self.task,
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
        """The versions of this run's lineage a sample may still use: `grpo.max_staleness + 1`."""
        return self.grpo.max_staleness + 1

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.output_dir) / self.logging.run_name

    @property
    def bucket_url(self) -> str:
        return self.bucket.url.format(run_name=self.logging.run_name)
