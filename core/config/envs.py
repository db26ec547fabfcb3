"""The environment of a run's episodes (`env`), one kind of several: spotrl's own environments (`env.name`), an
OpenEnv server's (`env.openenv`), TRL's `environment_factory` (`env.factory`) or a verifiers v1 taskset
(`env.verifiers`); none, single-turn completions. Each kind is one field of `EnvConfig` made by `env_kind`, its
settings that field's type; what a kind does at run time is its module of `app.kinds`, listed in
`app.kinds.registry` (adding a kind: docs/tasks-and-environments.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from core.config.sections import Section

ENV_KIND = "env_kind"  # the mark `env_kind` puts on a field of EnvConfig that names a kind


def env_kind(description: str) -> Any:
    """A field of `EnvConfig` that names a kind of environment (None: not this kind): the config side of a kind."""
    return Field(None, description=description, json_schema_extra={ENV_KIND: True})


class OpenEnvConfig(Section):
    """An OpenEnv environment (PyPI `openenv`), played over OpenEnv's own WebSocket client (`app.tasks.openenv_env`):
    a server already running (`url`), or an app that the run serves itself on 127.0.0.1 for its duration (`app`).
    Both run in the OpenEnv venv, `.venv-openenv` (`make setup`), where the classes named here are imported."""

    url: str | None = Field(
        None, description="A running OpenEnv server (http:// or ws://), e.g. http://127.0.0.1:8001."
    )
    app: str | None = Field(
        None, description='"module:app": an ASGI app built by OpenEnv\'s create_app, served by the run on 127.0.0.1.'
    )
    client: str = Field(
        "openenv.core.generic_client:GenericEnvClient",
        description="module:Class of the environment's EnvClient; the default, OpenEnv's generic one, sends dicts.",
    )
    action: str | None = Field(
        None,
        description="module:Class of the Action to build (a typed client's); None: a dict, as GenericEnvClient takes.",
    )
    action_field: str = Field("message", description="The Action's text field that the model's turn fills.")
    observation_field: str = Field(
        "message", description="The Observation's text field rendered as the model's next turn (the next user turn)."
    )
    start_timeout_s: float = Field(
        180.0,
        gt=0,
        description="Longest wait for a served app's /health, or the OpenEnv client's process (imports take ~15 s).",
    )

    @field_validator("app", "client", "action")
    @classmethod
    def _module_path(cls, path: str | None) -> str | None:
        if path is not None and ":" not in path:
            raise ValueError("expected module:name")
        return path

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None and url.split("://")[0] not in ("http", "https", "ws", "wss"):
            raise ValueError("expected http(s):// or ws(s)://")
        return url

    @model_validator(mode="after")
    def _one_source(self) -> OpenEnvConfig:
        if (self.url is None) == (self.app is None):
            raise ValueError("a url or an app to serve, exactly one")
        return self


class VerifiersConfig(Section):
    """A verifiers v1 taskset (`verifiers.v1`), run by its env with verifiers' training client pointed at the fleet
    (`app.rollout.verifiers_episodes`); its tasks are the run's problems, its `@vf.reward`s its rewards."""

    taskset: str = Field(
        min_length=1,
        description='The taskset: an installed verifiers taskset id, or "module:TasksetClass" (its module exports it).',
    )
    taskset_args: dict[str, Any] = Field(
        default_factory=dict, description="Fields of the taskset's config (its TasksetConfig subclass), e.g. seed."
    )
    env_id: str = Field("", description="verifiers' env id to pair with the taskset; empty: the taskset's own env.")
    agent: dict[str, Any] = Field(
        default_factory=dict,
        description="verifiers' AgentConfig of the env's agent (harness, runtime, ...); runtime defaults to subprocess.",
    )
    episode_timeout_s: float = Field(
        60.0, gt=0, description="Longest episode (verifiers' env.timeout.episode); beyond, it is lost, counted."
    )
    max_concurrent_episodes: int = Field(64, ge=1, description="Episodes played at once by the rollout.")


class EnvConfig(Section):
    """The environment of multi-turn episodes: spotrl's (`name`, `app.tasks.environments`), an OpenEnv server's
    (`openenv`, `app.tasks.openenv_env`), TRL's `environment_factory` (`factory`, `app.tasks.trl_environments`) or a
    verifiers v1 taskset (`verifiers`); none: single-turn completions."""

    name: str | None = env_kind('Environment: a registered name (chained_arithmetic, calculator) or "module:Class".')
    factory: str | dict[str, str] | None = env_kind(
        'TRL environment_factory: "module:callable", or names to factories (each problem picks by its environment column).'
    )
    openenv: OpenEnvConfig | None = env_kind(
        "An OpenEnv environment: {url: ...} or {app: module:app}, played over OpenEnv's client."
    )
    verifiers: VerifiersConfig | None = env_kind(
        "A verifiers v1 taskset played by its env through verifiers' training client."
    )
    max_tool_calling_iterations: int | None = Field(
        None, ge=0, description="Most tool-calling turns of a TRL environment's episode (TRL's; None: no limit)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment class.")
    max_turns: int = Field(4, ge=1, description="Most model turns of an episode (cut beyond: truncated).")
    max_episode_tokens: int | None = Field(
        None,
        ge=2,
        description="Most tokens of an episode, prompt included (cut beyond: truncated); default max_model_len.",
    )
    timeout_s: float = Field(
        5.0, gt=0, description="Longest reset() or step() call; beyond, the episode ends with reward None."
    )

    @field_validator("name")
    @classmethod
    def _named(cls, name: str | None) -> str | None:
        """A registered name or `module:Class`; whether it names an environment is the run side's to say at start
        (`app.kinds.spotrl_kind`), before anything runs."""
        if name is not None and not name.strip():
            raise ValueError("an environment's name, or no env.name for single-turn completions")
        return name

    @field_validator("factory")
    @classmethod
    def _factories(cls, factory: str | dict[str, str] | None) -> str | dict[str, str] | None:
        """`module:callable`, or a non-empty mapping of names to such; whether they import is the run side's to say
        at start (`app.kinds.trl_kind`)."""
        paths = [factory] if isinstance(factory, str) else list((factory or {}).values())
        if isinstance(factory, dict) and not factory:
            raise ValueError("a mapping of environment names to factories needs at least one")
        for path in paths:
            if ":" not in path:
                raise ValueError(f"{path!r}: expected module:callable")
        return factory

    @classmethod
    def kinds(cls) -> tuple[str, ...]:
        """The fields that name a kind of environment (made by `env_kind`), in their order."""
        return tuple(f for f, info in cls.model_fields.items() if (info.json_schema_extra or {}).get(ENV_KIND))

    @model_validator(mode="after")
    def _one_kind(self) -> EnvConfig:
        named = [k for k in self.kinds() if getattr(self, k) is not None]
        if len(named) > 1:
            raise ValueError(f"env.{', env.'.join(named)}: one environment, not several")
        return self

    @property
    def kind(self) -> str | None:
        """The field naming this run's kind of environment; None: single-turn completions, no environment."""
        return next((k for k in self.kinds() if getattr(self, k) is not None), None)
