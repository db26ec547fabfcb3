"""No environment: single-turn completions of the task's problems, scored by its reward functions
(`app.rollout.sampling`)."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.sampling import CompletionSampler
from app.tasks.rewards import RewardScorer


class SingleTurn(EnvKind):
    field = None

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        scorer = RewardScorer.from_names(cfg.task.reward_funcs, cfg.task.reward_timeout_s, cfg.train.max_steps)
        return CompletionSampler(generate, scorer, decode)
