"""No environment: single-turn completions of the task's problems, scored by its reward functions
(`app.rollout.sampling`), its judges among them (`app.rollout.judges`: asked through the run's fleet seat)."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.judges import scoring_workers, task_rewards
from app.rollout.sampling import CompletionSampler
from app.tasks.rewards import RewardScorer


class SingleTurn(EnvKind):
    field = None
    unjudged = None

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        task = cfg.task
        funcs = task_rewards(cfg, fleet.url, fleet.token, tokenizer)
        scorer = RewardScorer(
            funcs, task.reward_timeout_s, cfg.train.max_steps, scoring_workers(cfg, funcs), task.weights()
        )
        return CompletionSampler(generate, scorer, decode)
