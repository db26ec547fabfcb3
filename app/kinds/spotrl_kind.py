"""spotrl's own environments (`env.name`: a registered name or `module:Class`, `app.tasks.environments`), played
by spotrl's episode runner (`app.rollout.episodes`), one instance per episode built with `env.kwargs`; rewarded by the
environment, and by the judges `task.reward_funcs` names (asked through the run's fleet seat)."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.episodes import EpisodeRunner
from app.rollout.judges import episode_judges
from app.tasks.environments import resolve_environment
from core.config import ConfigError


class SpotrlEnvironments(EnvKind):
    field = "name"
    unjudged = None

    def check(self, cfg) -> None:
        try:
            resolve_environment(cfg.env.name)
        except ValueError as e:
            raise ConfigError(f"env.name: {e}") from None

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        env_cls, kwargs = resolve_environment(cfg.env.name), dict(cfg.env.kwargs)
        judges = episode_judges(cfg, fleet.url, fleet.token, tokenizer)
        return EpisodeRunner.from_config(cfg, lambda: env_cls(**kwargs), tokenizer, generate, decode, judges)
