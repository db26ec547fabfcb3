"""The run's sampler, chosen by its config: single-turn completions scored by the task's rewards
(`app.rollout.sampling`), episodes of spotrl's environments or OpenEnv's (`app.rollout.episodes`) or of TRL's
`environment_factory` (`app.rollout.tool_episodes`). Apart from the three, so that none imports another's kind."""

from __future__ import annotations

import functools

from app.rollout.episodes import EpisodeRunner
from app.rollout.sampling import CompletionSampler, Sampler
from app.rollout.tool_episodes import ToolEpisodeRunner
from app.tasks.rewards import RewardScorer
from contracts.rollouts import Generate


def sampler_for(cfg, tokenizer, generate: Generate) -> Sampler:
    """The run's sampler: episodes of its environment (`env.name` or `env.openenv`, or TRL's `env.factory`), else
    completions scored by its rewards."""
    from core.models import completion_text

    decode = functools.partial(completion_text, tokenizer)
    if cfg.env.factory is not None:
        return ToolEpisodeRunner.from_config(cfg, tokenizer, generate, decode)
    if cfg.env.multi_turn:
        return EpisodeRunner.from_config(cfg, tokenizer, generate, decode)
    scorer = RewardScorer.from_names(cfg.task.reward_funcs, cfg.task.reward_timeout_s)
    return CompletionSampler(generate, scorer, decode)
