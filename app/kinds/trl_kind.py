"""TRL's `environment_factory` (`env.factory`): a class of one's own, or several by name, whose public methods are
the model's tools (`app.tasks.trl_environments`), played by spotrl's tool-episode runner (`app.rollout.tool_episodes`)
and scored by the task's reward functions (its judges among them, asked through the run's fleet seat) or the
environment's `get_reward`."""

from __future__ import annotations

from app.kinds.kind import EnvKind
from app.rollout.judges import task_rewards
from app.rollout.tool_episodes import ToolEpisodeRunner
from core.config import ConfigError


class TrlEnvironments(EnvKind):
    field = "factory"
    unjudged = None

    def check(self, cfg) -> None:
        """`env.factory` imports, each factory makes an environment with a `reset` whose tools have schemas (probed once,
        as TRL's trainers probe at init), and the run has a reward source: ConfigError naming the field else."""
        from app.tasks.trl_environments import check_reset_takes, probe, reset_kwargs, resolve_factories, trl_row

        spec = cfg.env.factory
        try:
            factories = resolve_factories(spec)
        except ValueError as e:
            raise ConfigError(f"env.factory: {e}") from None
        kinds = []
        for name, factory in factories.items():
            try:
                kinds.append(probe(name, factory))
            except ValueError as e:
                raise ConfigError(f"env.factory{'' if name is None else '.' + name}: {e}") from None
        row = trl_row(self.first_problem(cfg))
        for kind in kinds:  # TRL passes the row by keyword (less the field that picks the environment, with several)
            try:
                check_reset_takes(kind.env_type, reset_kwargs(row, multi=kind.name is not None))
            except TypeError as e:
                raise ConfigError(f"env.factory{'' if kind.name is None else '.' + kind.name}: {e}") from None
        tools = cfg.model.tiny.warmup_tools if cfg.model.name_or_path == "tiny" else None
        if tools is not None:  # the tiny model's warm-up plays its demonstrations (`tiny.tool_play`)
            from app.tasks.registry import resolve_named

            try:
                if not callable(resolve_named(tools.demonstration, {}, "demonstration", "module:callable")):
                    raise ValueError(f"{tools.demonstration!r} is not callable")
            except ValueError as e:
                raise ConfigError(f"model.tiny.warmup_tools.demonstration: {e}") from None
        if not cfg.task.reward_funcs and not any(k.owns_reward for k in kinds):
            raise ConfigError(
                "task.reward_funcs: no reward source: name reward functions, or give the environment a get_reward()"
            )

    def check_budget(self, cfg, model_path: str) -> None:
        """A TRL environment's first problem, rendered with its tools as the rollout renders it (reset's observation
        included), leaves the model room in the episode's budget: ConfigError naming the setting that makes room else
        (every episode would fail at its first turn, mid-run). Called once the model's tokenizer exists."""
        from app.tasks.trl_environments import (
            ENVIRONMENT_FIELD,
            ToolChat,
            reset_kwargs,
            resolve_factories,
            tool_methods,
            tool_tokenizer,
            trl_row,
            with_observation,
        )
        from core.models import load_tokenizer

        factories = resolve_factories(cfg.env.factory)
        multi = None not in factories
        row = trl_row(self.first_problem(cfg))
        env = factories[row.get(ENVIRONMENT_FIELD) if multi else None]()
        messages = list(row["prompt"])
        try:  # its observation lengthens the prompt; one that fails here is the rollout's to count, not a config error
            messages = with_observation(messages, env.reset(**reset_kwargs(row, multi)))
        except Exception:
            pass
        tools = tool_methods(env)
        try:
            chat = ToolChat(tool_tokenizer(load_tokenizer(model_path)))
        except ValueError as e:
            raise ConfigError(f"model.name_or_path: {e}") from None
        took, budget = len(chat.prompt_ids(messages, tools)), cfg.max_episode_tokens
        if took < budget:
            return
        what = f"the first problem's prompt with {type(env).__name__}'s {len(tools)} tools takes {took} tokens"
        if cfg.model.name_or_path == "tiny" and cfg.model.tiny.warmup_tools is None and tools:
            raise ConfigError(
                f"model.tiny.warmup_tools: {what}, no room in {budget}: the tiny model renders tools with Qwen2.5's "
                "template, their JSON schemas in full; set model.tiny.warmup_tools (configs/tiny-trl-tools.yaml), whose "
                "template lists the tools in one line, or raise model.max_model_len"
            )
        field = "env.max_episode_tokens" if cfg.env.max_episode_tokens is not None else "model.max_model_len"
        raise ConfigError(f"{field}={budget}: {what}, which leaves no room for the model's turn: raise it")

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        funcs = task_rewards(cfg, fleet.url, fleet.token, tokenizer)
        return ToolEpisodeRunner.from_config(cfg, tokenizer, generate, decode, funcs)
