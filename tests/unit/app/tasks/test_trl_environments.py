"""TRL's environment_factory contract: factories by name, which methods are tools and their schemas, the probe at
start, reset's observation, get_reward as a reward source, and the chat side on the tiny model's tokenizer."""

import pytest

from app.tasks.trl_environments import (
    ToolChat,
    env_reward_func,
    probe,
    reset_kwargs,
    resolve_factories,
    tool_methods,
    tool_schemas,
    tool_tokenizer,
    with_observation,
)
from examples.trl_calculator import CalculatorEnv
from tiny.tokenizer import build_tokenizer


class Counter:
    """A tool, a private helper, a property that must not be evaluated, reset and get_reward."""

    def reset(self, **row) -> None:
        self.n = 0

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: How much to add.
        """
        self.n += by
        return self.n

    def _helper(self) -> None:
        raise AssertionError("private: never a tool")

    @property
    def exploding(self) -> int:
        raise AssertionError("a property is never evaluated")

    def get_reward(self) -> float:
        return float(self.n)


class Undocumented:
    def reset(self, **row) -> None:
        pass

    def tool(self, x):
        return x


class NoReset:
    def tool(self, x: int) -> int:
        """Echo.

        Args:
            x: A number.
        """
        return x


def test_factories_resolve_as_trl_normalises_them():
    assert resolve_factories("examples.trl_calculator:CalculatorEnv") == {None: CalculatorEnv}
    both = resolve_factories({"calc": "examples.trl_calculator:CalculatorEnv", "count": f"{__name__}:Counter"})
    assert both == {"calc": CalculatorEnv, "count": Counter}
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_factories("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_factories("examples.trl_calculator:Missing")
    with pytest.raises(ValueError, match="not callable"):
        resolve_factories(f"{__name__}:__doc__")


def test_tools_are_the_public_methods_but_reset_and_get_reward():
    env = Counter()
    assert [m.__name__ for m in tool_methods(env)] == ["bump"]
    env.reset()
    assert tool_methods(env)[0](2) == 2  # bound to the instance
    (schema,) = tool_schemas(env)
    assert schema["function"]["name"] == "bump"
    assert schema["function"]["parameters"]["properties"]["by"] == {
        "type": "integer",
        "description": "How much to add.",
    }
    assert [s["function"]["name"] for s in tool_schemas(CalculatorEnv())] == ["add", "submit"]


def test_probe_reads_the_contract_and_refuses_what_trl_would():
    kind = probe(None, Counter)
    assert (kind.env_type, kind.tools, kind.owns_reward) == (Counter, ("bump",), True)
    assert probe("calc", CalculatorEnv).tools == ("add", "submit")
    with pytest.raises(ValueError, match="must define a callable `reset`"):
        probe(None, NoReset)
    with pytest.raises(ValueError, match="schema cannot be built"):
        probe(None, Undocumented)

    def broken():
        raise RuntimeError("no sandbox")

    with pytest.raises(ValueError, match="factory raised RuntimeError: no sandbox"):
        probe(None, broken)


def test_reset_gets_the_row_and_its_observation_ends_the_last_message():
    row = {"prompt": [{"role": "user", "content": "Q"}], "answer": "4", "environment": "calc"}
    assert reset_kwargs(row, multi=True) == {"prompt": row["prompt"], "answer": "4"}
    assert reset_kwargs(row, multi=False) == row
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert with_observation(prompt, None) == prompt
    assert with_observation(prompt, " more")[-1] == {"role": "user", "content": "Q more"}
    assert prompt[-1]["content"] == "Q"  # the row's messages are never changed
    with pytest.raises(TypeError, match="returned int"):
        with_observation(prompt, 3)


def test_get_reward_scores_its_own_class_only_and_survives_one_that_raises():
    class Sub(Counter):
        pass

    class Raising(Counter):
        def get_reward(self) -> float:
            raise RuntimeError("lost state")

    a, b, c = Counter(), Sub(), Counter()
    for env, n in ((a, 1), (b, 2), (c, 3)):
        env.reset()
        env.bump(n)
    reward = env_reward_func(Counter)
    assert reward.__name__ == "Counter"
    assert reward([], [], [], environments=[a, b, c]) == [1.0, None, 3.0]  # exact type, as TRL
    raising = env_reward_func(Raising)
    assert raising([], [], [], environments=[Raising(), a]) == [None, None]
    assert raising.failures == 1


def test_the_tiny_tokenizer_calls_tools_with_trls_qwen2_5_template():
    plain = build_tokenizer(2, 0)
    with pytest.raises(ValueError, match="cannot render tool calls"):
        ToolChat(plain)
    tokenizer = tool_tokenizer(plain)
    assert plain.chat_template != tokenizer.chat_template and plain.eos_token == "<|endoftext|>"  # a copy
    assert tool_tokenizer(tokenizer) is tokenizer  # a template that knows tools is kept
    chat = ToolChat(tokenizer)
    env = CalculatorEnv()
    tools = tool_methods(env)
    prompt = chat.prompt_ids([{"role": "user", "content": "Compute 1+2."}], tools)
    assert '"name": "submit"' in tokenizer.decode(prompt)
    call = tokenizer('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>')["input_ids"]
    message = chat.parse(call, prompt, tools)
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    broken = tokenizer("<tool_call>\n{oops</tool_call><|im_end|>")["input_ids"]
    assert chat.parse(broken, prompt, tools) == {"role": "assistant", "content": "<tool_call>\n{oops</tool_call>"}
    suffix = chat.tool_suffix_ids([{"role": "tool", "name": "add", "content": "3"}])
    assert (
        tokenizer.decode(suffix)
        == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_config_naming_factories_is_checked_at_start():
    from pydantic import ValidationError

    from app.tasks.checks import check_names
    from core.config import ConfigError, RunConfig

    ok = RunConfig(env={"factory": "examples.trl_calculator:CalculatorEnv"}, task={"reward_funcs": []})
    check_names(ok)  # get_reward is the reward source
    check_names(RunConfig(env={"factory": {"calc": "examples.trl_calculator:CalculatorEnv"}}))
    for factory, field, needle in [
        ("no_such_module_xyz:Env", "env.factory", "cannot be imported"),
        ({"calc": f"{__name__}:NoReset"}, "env.factory.calc", "must define a callable `reset`"),
        (f"{__name__}:Undocumented", "env.factory", "schema cannot be built"),
    ]:
        with pytest.raises(ConfigError, match=f"^{field}: .*{needle}"):
            check_names(RunConfig(env={"factory": factory}))
    with pytest.raises(ConfigError, match="no reward source"):
        check_names(RunConfig(env={"factory": f"{__name__}:Plain"}, task={"reward_funcs": []}))
    with pytest.raises(ValidationError, match="one environment, not several"):
        RunConfig(env={"factory": "examples.trl_calculator:CalculatorEnv", "name": "calculator"})
    with pytest.raises(ValidationError, match="module:callable"):
        RunConfig(env={"factory": "CalculatorEnv"})
    calc = "examples.trl_calculator:CalculatorEnv"

    def with_demonstration(name: str) -> RunConfig:
        tools = {"environment": calc, "demonstration": name}
        return RunConfig(model={"tiny": {"warmup_tools": tools}}, env={"factory": calc}, task={"reward_funcs": []})

    check_names(with_demonstration("examples.trl_calculator:demonstration"))
    with pytest.raises(ConfigError, match="^model.tiny.warmup_tools.demonstration: .*cannot be imported"):
        check_names(with_demonstration("examples.trl_calculator:nothing"))


class Plain(CalculatorEnv):
    get_reward = None  # not a function: owns no reward


class ResetTakesAProblem(CalculatorEnv):
    def reset(self, problem) -> None:  # TRL calls reset(**row): prompt=, answer=, the columns
        self.answer = int(problem.answer)


def test_a_reset_that_cannot_take_the_problems_row_is_a_config_error_at_start():
    """The probe at start never called `reset`: a wrong signature passed it and lost every episode of the run."""
    from app.tasks.checks import check_names
    from core.config import ConfigError, RunConfig

    cfg = RunConfig(env={"factory": f"{__name__}:ResetTakesAProblem"}, task={"reward_funcs": []})
    with pytest.raises(
        ConfigError,
        match=r"^env\.factory: ResetTakesAProblem\.reset\(self, problem\) -> None cannot take a problem's row \(prompt, answer\)",
    ):
        check_names(cfg)
    several = RunConfig(
        env={"factory": {"calc": "examples.trl_calculator:CalculatorEnv", "odd": f"{__name__}:ResetTakesAProblem"}}
    )
    with pytest.raises(ConfigError, match=r"^env\.factory\.odd: ResetTakesAProblem\.reset"):
        check_names(several)
