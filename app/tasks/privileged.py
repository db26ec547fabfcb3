"""The privileged prompt of self-distillation: the student's prompt with what the student is not shown.

A self teacher (`teacher: {self: {model: ..., context: TEMPLATE}}`) is the student's own model, scoring the student's
sampled tokens under another prompt: the template filled with the problem's prompt and its privileged context, the
gold answer or a worked solution (SDFT), or what the environment said of a failed episode (SDPO). Both the rollout's
teacher (`app.rollout.teacher`) and the tiny model's warm-up (`tiny.context`, which teaches the embedded default
to read an answer given so) render it here, so that the two never lay it out differently.

The fields a template may name: `prompt` (the student's prompt; for a chat prompt, its last user message), `answer`
(the gold answer), `solution` (a worked solution, where the task gives one), `feedback` (a failed episode's last
observation, SDPO; empty where the episode succeeded or is single-turn), and every column of the task's problems.
A field the task does not have, or leaves empty for a problem, is refused at start (`check_context`), in one line.
"""

from __future__ import annotations

import string
from dataclasses import replace
from typing import Any

from app.tasks.problems import Problem
from core.config.context import CONTEXT_FIELDS, template_fields


def context_values(problem: Problem, feedback: str = "") -> dict[str, Any]:
    """What a template may name for `problem`: its columns, then the fixed fields (which win over a column of the
    same name). `solution` is absent where the task gives none."""
    values: dict[str, Any] = dict(problem.columns)
    values["answer"] = problem.answer
    if problem.completion is not None:
        values["solution"] = problem.completion
    values["feedback"] = feedback
    return values


def privileged_prompt(template: str, problem: Problem, feedback: str = "") -> str | list[dict[str, str]]:
    """The teacher's prompt: `template` filled with the problem's fields, `{prompt}` its prompt text. A chat prompt
    stays a chat, its last user message replaced by the filled template."""
    values = context_values(problem, feedback)
    if isinstance(problem.prompt, str):
        return string.Formatter().vformat(template, (), {**values, "prompt": problem.prompt})
    messages = [dict(m) for m in problem.prompt]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    messages[last]["content"] = string.Formatter().vformat(
        template, (), {**values, "prompt": messages[last]["content"]}
    )
    return messages


def privileged_problem(template: str, problem: Problem, feedback: str = "") -> Problem:
    """`problem` as the teacher is shown it: the same problem under its privileged prompt."""
    return replace(problem, prompt=privileged_prompt(template, problem, feedback))


def check_context(template: str, problems: list[Problem], where: str) -> None:
    """ValueError (one line, naming `where`) when `template` names a field the task's problems do not have, or leave
    empty: a teacher shown nothing privileged would teach the student nothing the student does not know."""
    names = template_fields(template) - {"prompt", "feedback"}
    for problem in problems:
        values = context_values(problem)
        missing = sorted(n for n in names if n not in values)
        if missing:
            known = sorted(set(values) | {"prompt"} | set(CONTEXT_FIELDS))
            raise ValueError(
                f"{where}={template!r} names {', '.join(missing)}, which problem {problem.id!r} of the task does not "
                f"have (it has: {', '.join(known)})"
            )
        empty = sorted(n for n in names if values[n] in ("", None))
        if empty:
            raise ValueError(
                f"{where}={template!r}: problem {problem.id!r} has no {', '.join(empty)} to show the teacher"
            )
