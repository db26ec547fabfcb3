"""The warm-ups `model.tiny` switches on beside the task's own, in the order their builds take precedence: a judge is
taught on top of the model without it, and a self teacher's context on top of the model without that, whatever that
one is (tools, chat or neither)."""

from __future__ import annotations

from tiny.arithmetic import CHAT
from tiny.context import CONTEXT
from tiny.judge import JUDGE
from tiny.recipe import Variant
from tiny.tools import TOOLS

VARIANTS: tuple[Variant, ...] = (JUDGE, CONTEXT, TOOLS, CHAT)
