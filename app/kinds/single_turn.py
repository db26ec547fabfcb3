"""No environment: single-turn completions of the task's problems, scored by its reward functions
(`app.rollout.sampling`), its judges among them (`app.rollout.judges`: asked through the run's fleet seat)."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.judges import judge_rewards
from app.rollout.sampling import CompletionSampler
from app.tasks.rewards import RewardScorer, resolve_reward


class SingleTurn(EnvKind):
    field = None

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        task = cfg.task
        judges = judge_rewards(cfg, fleet.url, fleet.token, tokenizer)
        funcs = [judges[name] if name in judges else resolve_reward(name) for name in task.reward_funcs]
        # A judge's call mostly waits on the fleet: as many at once as groups in flight, or they queue behind two.
        workers = cfg.rollout.max_inflight_tasks if judges else 2
        scorer = RewardScorer(funcs, task.reward_timeout_s, cfg.train.max_steps, workers, task.weights())
        return CompletionSampler(generate, scorer, decode)
