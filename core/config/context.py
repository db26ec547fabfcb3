"""The teacher-prompt templates of self-distillation, read as config: which fields a template names, and whether it
is one at all. Shared by the self teacher (`core.config.teacher`) and the tiny model's warm-up
(`core.config.sections.TinyModelConfig.warmup_context`), which must lay the privileged prompt out alike; the rendering
itself is the app's (`app.tasks.privileged`).
"""

from __future__ import annotations

import string

# The fields every task has (besides its problems' own columns): the student's prompt, the gold answer, a worked
# solution (where the task gives one) and, for episodes, what the environment said of a failed one.
CONTEXT_FIELDS = ("prompt", "answer", "solution", "feedback")


def template_fields(template: str) -> set[str]:
    """The fields `template` names (`{answer}`, ...); ValueError for a template `str.format` could not fill, or one
    with positional (`{}`), indexed or attribute fields, which no problem gives."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{template!r} is not a template: {e}") from None
    names = set()
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{template!r}: {{{name}}} is not a field name (expected e.g. {{prompt}}, {{answer}})")
        if spec and "{" in spec:
            raise ValueError(f"{template!r}: nested fields are not supported")
        names.add(name)
    return names


def check_template(template: str) -> str:
    """A teacher-prompt template that shows the student's prompt (`{prompt}`) and something more; ValueError else."""
    names = template_fields(template)
    if "prompt" not in names:
        raise ValueError(f"{template!r} must show the student's prompt ({{prompt}})")
    if names == {"prompt"}:
        raise ValueError(
            f"{template!r} shows the teacher nothing the student is not shown: name a context field "
            f"({', '.join(CONTEXT_FIELDS[1:])} or a column of the task)"
        )
    return template
