"""A reward that takes its time: an evaluation set scored by it is slow, as a big held-out set on a busy fleet is, so
that a test sees whether the training steps wait for it (`app.periodic_eval`: they must not)."""

from __future__ import annotations

import time

from app.tasks.rewards import exact_answer

SLOW_S = 2.0


def slow_exact_answer(completions, prompts, completion_ids, answer, **kwargs) -> list[float]:
    """`exact_answer`, after `SLOW_S` seconds."""
    time.sleep(SLOW_S)
    return exact_answer(completions, prompts, completion_ids, answer, **kwargs)
