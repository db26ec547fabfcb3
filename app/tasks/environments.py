"""Environments: episodes in which the model and an environment take turns, for multi-turn GRPO.

The shape is gym's `reset` / `step` (and verifiers' MultiTurnEnv): an episode starts from a
`Problem`; after each model turn the environment answers with an `EnvStep`: the turn's reward, and
either an observation for the model to read next (text, which the rollout tokenises once, or token
ids, used as they are) or `done`. One instance plays one episode, so an environment keeps its
state in `self`. Environments are named in the config like reward functions: a registered name or
`module:Class` (`env.name`), built with `env.kwargs`.

The rollout (`app.rollout.episodes`) runs `reset` and `step` in a worker thread with a timeout: an
environment that raises or hangs ends only its own episode, whose reward becomes None (NaN: no
advantage), counted in `env/errors/<cause>`, never the run. An environment that knows why it failed raises
`EnvLost` to name the cause (an OpenEnv server that went away, `app.tasks.openenv_env`). `close` runs once its
episode is over, however it ended, so an environment holding a connection or a process lets it go.

A complete environment:

    class Echo(Environment):
        '''Rewards repeating the problem's answer, then asks once more.'''

        def reset(self, problem):
            self.answer, self.turn = problem.answer, 0

        def step(self, text, token_ids):
            self.turn += 1
            reward = float(text.strip() == self.answer)
            if self.turn == 2 or not reward:
                return EnvStep(reward, done=True, solved=bool(reward))
            return EnvStep(reward, observation=" Again: ")
"""

from __future__ import annotations

import ast
import operator
import re
import time
from dataclasses import dataclass

from app.tasks.problems import Problem
from app.tasks.registry import resolve_named


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn."""

    reward: float = 0.0  # this turn's reward; an episode's reward is the sum over its turns
    observation: str | list[int] | None = None  # what the model reads next (text or token ids); None when done
    done: bool = False
    solved: bool | None = None  # at the end: did the episode succeed (held-out accuracy); None: reward > 0


class EnvLost(Exception):
    """An environment's own account of why its episode is lost: `cause` names the counter, `env/errors/<cause>`."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


class Environment:
    """One episode's environment. Subclasses implement `reset` and `step`; constructor keywords come from
    `env.kwargs`."""

    def reset(self, problem: Problem) -> None:
        """Start an episode; the model's first turn answers `problem.prompt`."""
        raise NotImplementedError

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        """React to the model's turn (`text` decoded from `token_ids`, special tokens skipped)."""
        raise NotImplementedError

    def close(self) -> None:
        """The episode is over (done, cut, or lost): release what it held. Nothing by default."""


class ChainedArithmetic(Environment):
    """`Compute 12+34. Answer: 46`, then `Add 7. Answer: 53`, ...: each correct answer reveals the next operand.

    The problem's `chain` column holds the operands still to add. A wrong answer ends the episode; each
    correct turn earns 1 / (turns in the chain), so the episode's reward is the share of its chain answered.
    `latency_s` makes every answer take that long, as a slow tool or sandbox does (`env.kwargs`), so that on
    the tiny model an episode spans several policy versions."""

    OBSERVATION = " Add {operand}. Answer: "

    def __init__(self, latency_s: float = 0.0):
        if latency_s < 0:
            raise ValueError(f"latency_s={latency_s}: expected seconds >= 0")
        self.latency_s = latency_s

    def reset(self, problem: Problem) -> None:
        self.total = int(problem.answer)
        self.remaining = list(problem.columns["chain"])
        self.per_turn = 1.0 / (1 + len(self.remaining))

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        time.sleep(self.latency_s)  # in the rollout's worker thread, under env.timeout_s
        if text.strip() != str(self.total):
            return EnvStep(0.0, done=True, solved=False)
        if not self.remaining:
            return EnvStep(self.per_turn, done=True, solved=True)
        operand = self.remaining.pop(0)
        self.total += operand
        return EnvStep(self.per_turn, observation=self.OBSERVATION.format(operand=operand))


# `calc 12+34*2`: integers, + - * and parentheses, nothing else (no names, no powers, no division).
CALL = re.compile(r"\s*calc\s+([0-9+\-*() ]{1,64})\s*$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_OPERAND = 10**12


def calculate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses; ValueError for anything else."""
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            result = -value(node.operand)
        else:
            raise ValueError(f"unsupported in {expression!r}: {type(node).__name__}")
        if abs(result) > MAX_OPERAND:  # bounded, so no call can make the environment slow
            raise ValueError(f"{expression!r}: beyond {MAX_OPERAND}")
        return result

    return value(tree)


class Calculator(Environment):
    """A tool: the model may write `calc <expression>` and read ` = <value>. Answer: `, then answer.

    Any other turn is the final answer: 1.0 if it equals the gold, else 0. At most `max_calls` calls; a
    malformed call is answered with ` = error. Answer: ` (and still counts as a call)."""

    def __init__(self, max_calls: int = 2):
        self.max_calls = max_calls

    def reset(self, problem: Problem) -> None:
        self.answer, self.calls = problem.answer.strip(), 0

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        call = CALL.match(text)
        if call is None or self.calls >= self.max_calls:
            correct = text.strip() == self.answer
            return EnvStep(float(correct), done=True, solved=correct)
        self.calls += 1
        try:
            result = str(calculate(call.group(1)))
        except ValueError:
            result = "error"
        return EnvStep(0.0, observation=f" = {result}. Answer: ")


REGISTRY: dict[str, type[Environment]] = {"chained_arithmetic": ChainedArithmetic, "calculator": Calculator}


def resolve_environment(name: str) -> type[Environment]:
    """A registered name, or `package.module:Class` for a user's own environment."""
    found = resolve_named(name, REGISTRY, "environment", "module:Class")
    if not (isinstance(found, type) and callable(getattr(found, "step", None))):
        raise ValueError(f"environment {name!r} is not a class with reset() and step()")
    return found
