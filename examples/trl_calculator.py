"""A tool-using environment written for TRL 1.16's `environment_factory`, which spotrl plays unchanged.

Nothing here knows spotrl: pass `CalculatorEnv` to TRL's `GRPOTrainer(environment_factory=CalculatorEnv)` or
`AsyncGRPOTrainer(...)`, or name it in a spotrl config (`env: {factory: "examples.trl_calculator:CalculatorEnv"}`).
`tests/integration/test_trl_environment.py` plays it through both and compares the prompts token by token.

The model gets the problem, may `add` numbers as often as it likes, and `submit`s its answer; `get_reward` scores
the submission (TRL's extra reward source named after the class), and `submitted` is what a reward function can read
from the episode's instance (`environments=`). `demonstration` is a right play, for a model that has never called a
tool to be warmed up on.
"""

import re


class CalculatorEnv:
    """One episode of an addition: tools to add and to submit the answer."""

    def reset(self, answer: str, **row) -> str | None:
        """Start an episode from a dataset row: remember its answer, ask for a submission."""
        self.answer, self.submitted, self.calls = int(answer), None, 0
        return " Use the tools, then submit."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            Their sum.
        """
        self.calls += 1
        return a + b

    def submit(self, answer: int) -> str:
        """Submit the final answer; only the first submission counts.

        Args:
            answer: The answer to the problem.

        Returns:
            An acknowledgement.
        """
        if self.submitted is None:
            self.submitted = int(answer)
        return "submitted"

    def get_reward(self) -> float:
        return float(self.submitted == self.answer)


def demonstration(row: dict) -> list[dict]:
    """A right play of a row's episode as the assistant's messages: add the problem's two numbers, submit the sum,
    say it. What a small model is first taught to call the tools on (spotrl's `model.tiny.warmup_tools`), as a
    dataset of worked traces would teach a real one; the environment answers each call when it is played."""
    a, b = map(int, re.search(r"(\d+)\+(\d+)", row["prompt"][-1]["content"]).groups())

    def call(name: str, **arguments) -> dict:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
        }

    return [call("add", a=a, b=b), call("submit", answer=a + b), {"role": "assistant", "content": str(a + b)}]
