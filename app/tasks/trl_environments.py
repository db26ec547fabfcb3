"""TRL's `environment_factory` contract, so that an environment class written for TRL 1.16's `GRPOTrainer` or
`AsyncGRPOTrainer` trains in spotrl without a change.

The contract (TRL's docstring of `environment_factory`): a factory makes one environment; `reset(**row)` starts an
episode from a dataset row and returns None or a string appended to the last user message; every public method
other than `reset` and `get_reward` is a tool, described to the model by the chat template from its type hints and
docstring (`tools=`, transformers' `get_json_schema`); the model's tool calls are read back with the tokenizer's
response template (TRL's `parse_response`), run, and their results appended as `tool` messages, until a turn calls
no tool or `max_tool_calling_iterations` is reached; `get_reward()`, where the class defines it, is one more reward
source named after the class; reward functions get the episodes' instances as `environments=`.

Where TRL has a helper for a step, this module calls it rather than restating it: the tool methods are listed as
TRL lists them (`inspect.getmembers` on the class), the template is checked and completed with TRL's
`supports_tool_calling`, `add_response_schema`, `is_chat_template_prefix_preserving` and `get_training_chat_template`,
completions are parsed with `trl.chat_template_utils.parse_response`, and the tokens of tool results are
`GRPOTrainer._get_tool_suffix_ids`'s own, so that an episode stays one token sequence (prompt, model tokens as
sampled, tool results) exactly as GRPOTrainer lays it out. The rollout side (turns against the fleet, timeouts,
budgets) is `app.rollout.tool_episodes`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.tasks.problems import Problem
from app.tasks.registry import resolve_named

EnvironmentFactory = Callable[[], object]
# The methods TRL never exposes as tools (`GRPOTrainer._generate_and_score_completions`).
NOT_TOOLS = ("reset", "get_reward")
# The row field that picks an example's environment when the factory is a mapping (TRL's control field).
ENVIRONMENT_FIELD = "environment"


def resolve_factories(spec: str | dict[str, str]) -> dict[str | None, EnvironmentFactory]:
    """`env.factory` as TRL normalises `environment_factory`: one `module:callable` is the environment of every
    example (`{None: factory}`), a mapping names several, each example choosing by its `environment` field.
    ValueError naming the factory that does not import or is not callable."""
    named = {None: spec} if isinstance(spec, str) else dict(spec)
    factories = {}
    for key, path in named.items():
        found = resolve_named(path, {}, "environment factory", "module:callable")
        if not callable(found):
            raise ValueError(f"environment factory {path!r} is not callable")
        factories[key] = found
    return factories


def tool_methods(env: object) -> list[Callable]:
    """An environment's tools, as TRL finds them: the public functions of its class but `reset` and `get_reward`,
    bound to the instance (listed on the class, so that no property is evaluated)."""
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def tool_schemas(env: object) -> list[dict]:
    """The JSON schemas the chat template renders for an environment's tools (transformers' `get_json_schema`, which
    `apply_chat_template(tools=...)` applies to each callable): ValueError when a method lacks the docstring or type
    hints it needs."""
    from transformers.utils import get_json_schema

    return [get_json_schema(method) for method in tool_methods(env)]


@dataclass(frozen=True)
class EnvironmentKind:
    """What a probe of one instance finds out about an environment at start, as TRL's trainers probe at init."""

    name: str | None  # the key of `env.factory` (None: the single factory)
    env_type: type
    tools: tuple[str, ...]
    owns_reward: bool  # defines get_reward: one more reward source, named after the class


def probe(name: str | None, factory: EnvironmentFactory) -> EnvironmentKind:
    """Make one environment and read its contract (a `reset`, its tools' schemas, `get_reward`): ValueError saying what
    is wrong, so that a run refuses a broken environment at start rather than losing every episode to it."""
    try:
        env = factory()
    except Exception as e:
        raise ValueError(f"environment factory raised {type(e).__name__}: {e}") from None
    members = dict(inspect.getmembers(type(env), predicate=inspect.isfunction))
    if "reset" not in members:
        # TRL's own message (GRPOTrainer.__init__)
        raise ValueError("Each environment instance returned by `environment_factory` must define a callable `reset`.")
    try:
        tool_schemas(env)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"{type(env).__name__}: a tool's schema cannot be built: {e}") from None
    tools = tuple(m.__name__ for m in tool_methods(env))
    return EnvironmentKind(name, type(env), tools, "get_reward" in members)


def trl_row(problem: Problem) -> dict:
    """The dataset row TRL would hand `reset(**row)` and the reward functions: the prompt as chat messages, the
    answer, and the problem's own columns."""
    prompt = [{"role": "user", "content": problem.prompt}] if isinstance(problem.prompt, str) else problem.prompt
    return {"prompt": prompt, "answer": problem.answer, **problem.columns}


def check_reset_takes(env_type: type, kwargs: dict[str, Any]) -> None:
    """TypeError saying so when `reset` cannot be called as TRL calls it, `reset(**row)`, with these keywords: such
    an environment would lose every episode, found only once episodes are played."""
    signature = inspect.signature(env_type.reset)
    try:
        signature.bind(None, **kwargs)  # None in place of self
    except TypeError as e:
        raise TypeError(
            f"{env_type.__name__}.reset{signature} cannot take a problem's row ({', '.join(kwargs)}), as TRL calls it "
            f"(reset(**row)): {e}"
        ) from None


def reset_kwargs(row: dict[str, Any], multi: bool) -> dict[str, Any]:
    """What `reset` receives: the row, less the `environment` field that picked the environment (multi-environment)."""
    return {k: v for k, v in row.items() if k != ENVIRONMENT_FIELD} if multi else dict(row)


def with_observation(prompt: list[dict], observation: str | None) -> list[dict]:
    """The prompt with `reset`'s observation appended to its last message, as TRL does (a new list: the row's own
    messages are never changed). TypeError for an observation that is neither None nor a string."""
    if observation is None:
        return list(prompt)
    if not isinstance(observation, str):
        raise TypeError(f"reset() returned {type(observation).__name__}, expected None or str")
    last = prompt[-1]
    return prompt[:-1] + [{**last, "content": last["content"] + observation}]


def env_reward_func(env_type: type) -> Callable[..., list[float | None]]:
    """TRL's extra reward source for an environment that owns its reward: each episode of `env_type` scored by its
    `get_reward()`, others None; named after the class. One environment whose `get_reward` raises gives None for its
    own episode only (the error is kept on the function, `failures`, for the sampler to count)."""

    def get_reward(completions, prompts, completion_ids, environments, **_) -> list[float | None]:
        scores = []
        for env in environments:
            if type(env) is not env_type:  # exact type, as TRL (a subclass is another environment)
                scores.append(None)
                continue
            try:
                value = env.get_reward()
                scores.append(None if value is None else float(value))
            except Exception:
                get_reward.failures += 1
                scores.append(None)
        return scores

    get_reward.__name__ = get_reward.__qualname__ = env_type.__name__
    get_reward.failures = 0
    return get_reward


class ToolChat:
    """A tokenizer's side of TRL's tool loop: prompts rendered with the tools, completions parsed into messages, the
    token ids of tool results.

    The tokenizer is copied, then completed as TRL completes it: a response template when it has none
    (`add_response_schema`, for the templates TRL knows), and a training template in place of one that is not
    prefix-preserving (`get_training_chat_template`). ValueError for a template that cannot render tool calls."""

    def __init__(self, tokenizer, chat_template_kwargs: dict[str, Any] | None = None):
        from trl.chat_template_utils import (
            add_response_schema,
            get_training_chat_template,
            is_chat_template_prefix_preserving,
            supports_tool_calling,
        )

        tokenizer = copy.deepcopy(tokenizer)  # the rollout's own tokenizer stays as it was loaded
        if not supports_tool_calling(tokenizer):
            raise ValueError(
                "the model's chat template cannot render tool calls (TRL's supports_tool_calling): environments "
                "with tools need a model whose template does"
            )
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            add_response_schema(tokenizer)
        self.tokenizer = self.processing_class = self._tokenizer = tokenizer
        self.chat_template = (
            None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
        )
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._is_vlm = False  # read by GRPOTrainer._get_tool_suffix_ids; spotrl trains text models

    def prompt_ids(self, messages: list[dict], tools: list[Callable]) -> list[int]:
        """The prompt's token ids, rendered as GRPOTrainer renders an environment's prompt (`_tokenize_prompts`)."""
        out = self.tokenizer.apply_chat_template(
            conversation=messages,
            tools=tools or None,  # TRL's `or None`: some templates render tool boilerplate for tools=[]
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.chat_template_kwargs,
        )
        return list(out["input_ids"])

    def parse(self, ids: list[int], prefix: list[int], tools: list[Callable]) -> dict:
        """The assistant message of a turn's ids (TRL's `parse_response`: malformed tool calls become plain text)."""
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The token ids that follow a tool-calling turn: its tool results, then the next assistant header.

        This is GRPOTrainer's own `_get_tool_suffix_ids`, called on this object, which holds the attributes it reads
        (`processing_class`, `_tokenizer`, `chat_template`, `chat_template_kwargs`, `_is_vlm`): spotrl lays tool
        results out by TRL's code rather than a restatement of it."""
        from trl.trainer.grpo_trainer import GRPOTrainer

        return list(GRPOTrainer._get_tool_suffix_ids(self, tool_messages))


def tool_tokenizer(tokenizer):
    """The tokenizer an environment with tools renders with: the model's own, unless it is the tiny model's, whose
    plain chat template knows no tools; that one gets TRL's Qwen2.5 template (the family the tiny model is built in)
    and `<|im_end|>` as its end of turn, as Qwen2.5's instruct tokenizers have. The tiny model's files (and the key
    of its cache) are unchanged."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from core.chat_templates import CHAT_TEMPLATE as TINY_CHAT_TEMPLATE

    if tokenizer.chat_template != TINY_CHAT_TEMPLATE:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer
