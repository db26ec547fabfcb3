"""The rollout's tests' shared problems, and running one of their coroutines with a bound."""

from __future__ import annotations

import asyncio

from app.tasks.problems import make_arithmetic

PROBLEMS = make_arithmetic(2, 200, 10, seed=0).train


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))
