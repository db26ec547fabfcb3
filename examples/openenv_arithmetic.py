"""A small OpenEnv environment of spotrl's own, built with OpenEnv's server helpers as any OpenEnv environment is: the
chained additions of `chained_arithmetic` (`Compute 12+34. Answer: 46`, then ` Add 7. Answer: 53`, ...), served over
OpenEnv's WebSocket protocol, so that a run through an OpenEnv server plays exactly the episodes the shipped
multi-turn task plays (and its tiny model knows).

    .venv-openenv/bin/python -m uvicorn examples.openenv_arithmetic:app --host 127.0.0.1 --port 8001
    # or env.openenv.app in a run's config; it runs in the OpenEnv venv, as openenv cannot share the run's

`reset(answer=..., chain=[...])` takes the problem as spotrl sends it (the problem's answer and its columns); without
them (OpenEnv's own clients, its web playground) it draws a problem from `seed`. Each correct answer reveals the next
operand and earns 1 / (turns in the chain); a wrong one ends the episode with 0.
"""

from __future__ import annotations

import random
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class ArithmeticAction(Action):
    """The model's turn: its answer, as text."""

    message: str = Field(..., description="The answer the model wrote.")


class ArithmeticObservation(Observation):
    """What the model reads next."""

    message: str = Field("", description="The next instruction (empty once the episode is done).")


class ArithmeticEnvironment(Environment[ArithmeticAction, ArithmeticObservation, State]):
    """Chained additions: one instance per WebSocket session."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance and shares nothing

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.total, self.remaining, self.per_turn = 0, [], 1.0

    def reset(self, seed=None, episode_id=None, answer=None, chain=None, **kwargs) -> ArithmeticObservation:
        if answer is None:  # no problem given: draw one as chained_arithmetic does
            rng = random.Random(seed)
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            answer, chain = str(a + b), [rng.randint(1, 9) for _ in range(rng.randint(1, 2))]
            prompt = f"Compute {a}+{b}. Answer: "
        else:
            prompt = str(kwargs.get("prompt", ""))
        self.total, self.remaining = int(answer), [int(x) for x in (chain or [])]
        self.per_turn = 1.0 / (1 + len(self.remaining))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return ArithmeticObservation(message=prompt)

    def step(self, action: ArithmeticAction, timeout_s=None, **kwargs) -> ArithmeticObservation:
        self._state.step_count += 1
        if action.message.strip() != str(self.total):  # metadata's `solved`: spotrl's held-out verdict
            return ArithmeticObservation(done=True, reward=0.0, metadata={"solved": False})
        if not self.remaining:
            return ArithmeticObservation(done=True, reward=self.per_turn, metadata={"solved": True})
        operand = self.remaining.pop(0)
        self.total += operand
        return ArithmeticObservation(message=f" Add {operand}. Answer: ", reward=self.per_turn)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    ArithmeticEnvironment,
    ArithmeticAction,
    ArithmeticObservation,
    env_name="arithmetic",
    max_concurrent_envs=256,  # a run plays num_generations episodes per group, several groups at once
)
