"""Adapter names: what a client may call an adapter, and which names are versions of one lineage.

A trainer publishes a lineage of versions under one stem: spotrl's learner `policy-v1, policy-v2, ...`,
TRL's AsyncGRPOTrainer `trl-policy-v1, ...`. Only the newest `max_staleness + 1` versions of a lineage
can still be named by a sample in flight, so a replica pins LoRA slots per lineage (`family`,
`deployments.slots`), whoever the client: a lineage the fleet does not know is no reason to let vLLM
evict an adapter silently once `max_loras` is full. A name without a `-v<N>` suffix is a family of its own.
"""

from __future__ import annotations

import re

# What a client puts in `model`: letters, digits, '.', '_', '-'; never the base model's own name.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# `<family>-v<N>`, no leading zeros (v03 would alias v3).
_VERSIONED = re.compile(r"(?P<family>.+)-v(?P<version>0|[1-9][0-9]*)")


def family_of(name: str) -> tuple[str, int | None]:
    """(family, version) of an adapter name: `trl-policy-v3` -> ("trl-policy", 3), `my-lora` -> ("my-lora", None)."""
    match = _VERSIONED.fullmatch(name)
    return (match.group("family"), int(match.group("version"))) if match else (name, None)
