"""Recipe: an objective of your own (a term of the learner's loss), in one file: its config, its code, one line.

    .venv/bin/python -m examples.objective_rloo steps=20 is_cap=2.0        # any field of Config below, as key=value

An objective works on both sides of a run (`app.objectives.base.Objective`): on the rollout's, `annotate` writes
the per-token streams its loss needs into every sample of a group before it is queued; on the learner's, `loss`
takes the learner's log-probs of a micro-batch's trained tokens and those streams, and answers its share of the
step's loss. The learner sums the run's objectives without naming any. spotrl's are one module each in
`app/objectives/` (GRPO, distillation); one of one's own is this file: its config (a Section with a `kind`), the
`Objective`, and `register_objective(...)`. This one is REINFORCE with a leave-one-out baseline (RLOO): each
sample's advantage is its reward less the mean of the rest of its group, and the loss is -A x log-prob, weighted by
the truncated importance ratio against the sampler (the samples may be a few versions stale).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field

from app.objectives.base import LossStats, Objective
from app.objectives.combined import register_objective
from contracts.rollouts import SAMPLING_LOGPROBS, Group
from core.config import RunConfig, config_errors_exit, load_config
from core.config.objectives import objectives_with
from core.config.sections import Section


class Config(BaseModel):
    """The recipe's knobs; anything else of the run's config is a `sets` override (`--set` of `spotrl train`)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field("configs/tiny-cpu.yaml", description="The run's YAML to start from (the embedded default).")
    steps: int = Field(20, ge=1, description="Training steps (train.max_steps).")
    run_name: str = Field("rloo", description="runs/<run_name>/ holds the run's metrics and summary.")
    is_cap: float = Field(2.0, gt=0, description="Cap of the importance weight (RLOOObjectiveConfig.is_cap).")
    sets: list[str] = Field(default_factory=list, description="More KEY=VALUE overrides of the run's config.")


class RLOOObjectiveConfig(Section):
    """The objective's entry in `objectives`: `{kind: rloo, weight: ..., is_cap: ...}`."""

    kind: Literal["rloo"] = Field(description="The objective: rloo (REINFORCE, leave-one-out baseline).")
    weight: float = Field(1.0, gt=0, description="Weight of this objective's loss in the learner's sum.")
    is_cap: float = Field(2.0, gt=0, description="Cap of the importance weight exp(learner - sampler log-prob).")


ADVANTAGES = "rloo_advantages"  # the stream it annotates: its sample's advantage, on every token


def leave_one_out(rewards: list[float]) -> list[float]:
    """Each reward less the mean of the others of its group; a NaN reward (unscored) gets 0 and is nobody's baseline."""
    r = np.asarray(rewards, dtype=float)
    scored = ~np.isnan(r)
    advantages, k = np.zeros_like(r), int(scored.sum())
    if k > 1:
        s = r[scored]
        advantages[scored] = s - (s.sum() - s) / (k - 1)
    return advantages.tolist()


def rloo_loss(logp, sampling_logp, advantages, normalizer: float, is_cap: float) -> tuple[torch.Tensor, LossStats]:
    """-A x log-prob per token, weighted by min(exp(logp - sampling_logp), is_cap) (no gradient through the weight),
    summed and divided by `normalizer` (the step's token count: micro-batches' shares add up to the step's loss)."""
    sampling_logp = torch.where(torch.isnan(sampling_logp), logp.detach(), sampling_logp.to(logp.dtype))
    weight = torch.exp(logp.detach() - sampling_logp).clamp(max=is_cap)
    loss = -(weight * advantages * logp).sum() / normalizer
    with torch.no_grad():
        sums = {"rloo/is_weight": weight.sum().item(), "rloo/advantage": advantages.sum().item()}
        return loss, LossStats.over_tokens(sums, float(logp.numel()))


class RLOO(Objective):
    kind = "rloo"
    streams = (SAMPLING_LOGPROBS, ADVANTAGES)

    def __init__(self, weight: float = 1.0, *, is_cap: float = 2.0):
        super().__init__(weight)
        self.is_cap = is_cap

    @classmethod
    def from_config(cls, spec, cfg) -> RLOO:
        return cls(spec.weight, is_cap=spec.is_cap)

    def annotate(self, group: Group) -> None:
        for sample, advantage in zip(group.samples, leave_one_out(group.rewards), strict=True):
            sample.streams[ADVANTAGES] = [advantage] * len(sample.completion_ids)

    def loss(self, logp, entropy, streams: Mapping[str, torch.Tensor], normalizer: float):
        return rloo_loss(logp, streams[SAMPLING_LOGPROBS], streams[ADVANTAGES], normalizer, self.is_cap)


class RLOORunConfig(RunConfig):
    """A run whose `objectives` may name rloo (and whose default is rloo alone)."""

    objectives: objectives_with(RLOOObjectiveConfig) = Field(
        default_factory=lambda: [RLOOObjectiveConfig(kind="rloo")],
        min_length=1,
        description="Objectives the learner sums (default: RLOO alone).",
    )


register_objective(RLOO)  # the registry line: at import, so every process that reads an RLOORunConfig has it


def run_config(config: Config) -> RLOORunConfig:
    """The run: the base config with the recipe's overrides, its objectives RLOO alone."""
    sets = [f"train.max_steps={config.steps}", f"logging.run_name={config.run_name}", *config.sets]
    base = load_config(config.base, sets).model_dump()
    return RLOORunConfig.model_validate(base | {"objectives": [{"kind": "rloo", "is_cap": config.is_cap}]})


def parse(argv: list[str]) -> Config:
    """`key=value` arguments (values read as YAML, as `--set` reads them) into the recipe's Config."""
    pairs = [a.split("=", 1) for a in argv]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"expected key=value arguments, the fields of Config: {', '.join(Config.model_fields)}")
    return Config.model_validate({k: yaml.safe_load(v) for k, v in pairs})


def main(argv: list[str] | None = None) -> None:
    from launch.train import run

    with config_errors_exit():  # one line and exit 2, as `spotrl train` says it
        cfg = run_config(parse(sys.argv[1:] if argv is None else argv))
    run(cfg)  # as `spotrl train` runs a config: the kind's own start-up check among its names, before Ray


if __name__ == "__main__":
    from examples.objective_rloo import main as recipe_main  # by its module name: Ray's workers import it so

    recipe_main()
