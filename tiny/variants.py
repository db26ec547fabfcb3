"""The warm-ups `model.tiny` switches on beside the task's own, in the order their builds take precedence: a self
teacher's context is taught on top of the model without it, whatever that one is (tools, chat or neither)."""

from __future__ import annotations

from tiny.arithmetic import CHAT
from tiny.context import CONTEXT
from tiny.recipe import Variant
from tiny.tools import TOOLS

VARIANTS: tuple[Variant, ...] = (CONTEXT, TOOLS, CHAT)
