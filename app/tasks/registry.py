"""Finding a reward function or an environment by the name a config gives it.

Both are named alike: a registered short name (`exact_answer`, `chained_arithmetic`) or a
`package.module:attribute` path to a user's own, so that one rule, and one error message, serves both.
"""

from __future__ import annotations

import importlib
from typing import Any


def resolve_named(name: str, registry: dict[str, Any], kind: str, form: str) -> Any:
    """`registry[name]`, or the attribute a `module:attribute` name points to; ValueError saying what to use."""
    if name in registry:
        return registry[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{kind} {name!r} cannot be imported: {e}") from None
    raise ValueError(f"unknown {kind} {name!r}: use one of {sorted(registry)} or {form}")
