"""spotrl's own environments (`env.name`: a registered name or `module:Class`, `app.tasks.environments`), played
by spotrl's episode runner (`app.rollout.episodes`), one instance per episode built with `env.kwargs`."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.episodes import EpisodeRunner
from app.tasks.environments import resolve_environment
from core.config import ConfigError


class SpotrlEnvironments(EnvKind):
    field = "name"

    def check(self, cfg) -> None:
        try:
            resolve_environment(cfg.env.name)
        except ValueError as e:
            raise ConfigError(f"env.name: {e}") from None

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        env_cls, kwargs = resolve_environment(cfg.env.name), dict(cfg.env.kwargs)
        return EpisodeRunner.from_config(cfg, lambda: env_cls(**kwargs), tokenizer, generate, decode)
