"""An OpenEnv environment that misbehaves on request, served with OpenEnv's own `create_app` like any other, for the
fault tests of `app.tasks.openenv_env` (tests/integration/test_openenv.py).

The model's turn (the action's `message`) says what the step does: `hang` sleeps past any test's timeout, `garbage`
answers an observation whose text field is not text, `raise` raises inside the environment (OpenEnv's server answers
an error frame); anything else is a good turn (reward 1, ` next: ` to read), and the second good turn ends it.
"""

from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

HANG_S = 20.0  # far past the tests' env.timeout_s (the server is SIGKILLed 10 s into its shutdown if still sleeping)


class FaultAction(Action):
    message: str = Field(..., description="What the step should do.")


class FaultObservation(Observation):
    message: Any = Field("", description="Text, except when asked for garbage.")


class FaultEnvironment(Environment[FaultAction, FaultObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> FaultObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return FaultObservation(message="start")

    def step(self, action: FaultAction, timeout_s=None, **kwargs) -> FaultObservation:
        what = action.message.strip()
        if what == "hang":
            time.sleep(HANG_S)
        if what == "garbage":
            return FaultObservation(message={"not": "text"}, reward=1.0)
        if what == "raise":
            raise RuntimeError("the environment broke")
        self._state.step_count += 1
        return FaultObservation(message=" next: ", reward=1.0, done=self._state.step_count >= 2)

    @property
    def state(self) -> State:
        return self._state


app = create_app(FaultEnvironment, FaultAction, FaultObservation, env_name="faults", max_concurrent_envs=64)
