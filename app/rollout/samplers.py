"""The run's sampler, chosen by its config: single-turn completions scored by the task's rewards
(`app.rollout.sampling`), episodes of spotrl's environments or OpenEnv's (`app.rollout.episodes`), of TRL's
`environment_factory` (`app.rollout.tool_episodes`) or of a verifiers v1 taskset (`app.rollout.verifiers_episodes`).
Apart from them, so that none imports another's kind."""

from __future__ import annotations

import functools

from app.rollout.episodes import EpisodeRunner
from app.rollout.sampling import CompletionSampler, Sampler
from app.rollout.tool_episodes import ToolEpisodeRunner
from app.tasks.rewards import RewardScorer
from contracts.rollouts import Generate


def sampler_for(
    cfg, tokenizer, generate: Generate, *, fleet_url: str = "", token: str | None = None, model_path: str = ""
) -> Sampler:
    """The run's sampler: episodes of its environment (`env.name` or `env.openenv`, TRL's `env.factory`, or a verifiers
    taskset, whose own client reaches the fleet at `fleet_url` with `token` and renders with the tokenizer at
    `model_path`), else completions scored by its rewards."""
    from core.models import completion_text

    decode = functools.partial(completion_text, tokenizer)
    if cfg.env.verifiers is not None:
        from app.rollout.verifiers_episodes import VerifiersRunner  # imports verifiers: only runs that name it pay

        return VerifiersRunner.from_config(
            cfg, tokenizer, generate, decode, fleet_url=fleet_url, token=token, model_path=model_path
        )
    if cfg.env.factory is not None:
        return ToolEpisodeRunner.from_config(cfg, tokenizer, generate, decode)
    if cfg.env.multi_turn:
        return EpisodeRunner.from_config(cfg, tokenizer, generate, decode)
    scorer = RewardScorer.from_names(cfg.task.reward_funcs, cfg.task.reward_timeout_s, cfg.train.max_steps)
    return CompletionSampler(generate, scorer, decode)
