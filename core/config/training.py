"""What every objective shares: the optimizer and its schedule (`train`), and how the policy samples (`sampling`).

Both were once the `grpo` section's, though a distill-only run steps the same optimizer and samples alike; each
objective's own settings are its entry of `objectives` (`core.config.objectives`). Names follow TRL's
AsyncGRPOConfig, so TRL users find what they know.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config.sections import Section


class TrainConfig(Section):
    """The optimizer (AdamW over the adapter), its schedule and the run's length: one step sums every objective."""

    num_prompts_per_step: int = Field(16, ge=1, description="Prompts (groups) consumed per optimizer step.")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate of the adapter.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning rate schedule."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    seed: int = Field(42, description="Seed of the learner and the prompt order.")


class SamplingConfig(Section):
    """How the policy samples its groups: every objective learns from the same samples."""

    num_generations: int = Field(8, ge=2, description="Samples per prompt (the group size G).")
    max_completion_length: int = Field(8, ge=1, description="Most tokens generated per completion.")
    temperature: float = Field(
        1.0, gt=0, le=2, description="Sampling temperature (vLLM's range); the learner scores at the same one."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 disables).")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Min-p sampling: drop tokens below min_p x the top token's probability (0: off)."
    )
