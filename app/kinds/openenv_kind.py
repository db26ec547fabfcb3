"""An OpenEnv environment (`env.openenv`): a server running, or an app the run serves on 127.0.0.1 for its length,
played over OpenEnv's own client in the OpenEnv venv (`app.tasks.openenv_env`) by spotrl's episode runner; rewarded by
the environment, and by the judges `task.reward_funcs` names."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.episodes import EpisodeRunner
from app.rollout.judges import episode_judges
from core.config import ConfigError


class OpenEnv(EnvKind):
    field = "openenv"
    unjudged = None

    def check(self, cfg) -> None:
        """The client and Action classes fit and the app imports, resolved in the OpenEnv venv as the run will
        (`app.tasks.openenv_env.check_classes`); one line saying what builds the venv where there is none."""
        from app.tasks.openenv_env import check_classes  # the OpenEnv venv's client: only runs that name it pay

        try:
            check_classes(cfg.env.openenv)
        except ValueError as e:
            named = str(e).split(":")[0] in ("client", "action", "action_field", "app")  # the message starts with it
            raise ConfigError(f"env.openenv.{e}" if named else f"env.openenv: {e}") from None

    def serve(self, stack, cfg):
        from app.tasks.openenv_server import serve_openenv

        return serve_openenv(stack, cfg)

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        from app.tasks.openenv_env import openenv_factory

        factory = openenv_factory(cfg.env.openenv, cfg.env.timeout_s)
        judges = episode_judges(cfg, fleet.url, fleet.token, tokenizer)
        return EpisodeRunner.from_config(cfg, factory, tokenizer, generate, decode, judges)
