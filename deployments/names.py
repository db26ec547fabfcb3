"""Adapter names: what a client may call an adapter, and which names are versions of one lineage.

A trainer publishes a lineage of versions under one stem: spotrl's learner `policy-v1, policy-v2, ...`,
TRL's AsyncGRPOTrainer `trl-policy-v1, ...`. Only the newest `max_staleness + 1` versions of a lineage
can still be named by a sample in flight, so a replica pins LoRA slots per lineage (`family`,
`deployments.slots`), whoever the client: a lineage the fleet does not know is no reason to let vLLM
evict an adapter silently once `max_loras` is full. A name without a `-v<N>` suffix is a family of its own.

On a shared fleet a run's adapters are namespaced by the run: `alice/policy-v3` is version 3 of run
`alice`'s lineage `alice/policy`, published under the run's own prefix of the fleet's bucket
(`<bucket>/runs/alice/adapters/policy-v3`). The full name is what the router seeds its hash chain with
and what the ingress checks a caller's token against (`deployments.runs`).
"""

from __future__ import annotations

import re

# What a client puts in `model`: letters, digits, '.', '_', '-'; never the base model's own name. A run's
# adapters carry `<run>/` in front.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
MAX_ADAPTER_NAME_CHARS = 32 + 1 + 128
# The bucket versions: `policy-v<N>` of the fleet's own learner, `<run>/policy-v<N>` of a run's.
_BUCKET_VERSION = re.compile(r"(?:(?P<run>[a-z0-9][a-z0-9_-]{0,31})/)?policy-v(?P<version>0|[1-9][0-9]*)")
# `<family>-v<N>`, no leading zeros (v03 would alias v3).
_VERSIONED = re.compile(r"(?P<family>.+)-v(?P<version>0|[1-9][0-9]*)")


def family_of(name: str) -> tuple[str, int | None]:
    """(family, version) of an adapter name: `trl-policy-v3` -> ("trl-policy", 3), `my-lora` -> ("my-lora", None)."""
    match = _VERSIONED.fullmatch(name)
    return (match.group("family"), int(match.group("version"))) if match else (name, None)


def split_run(name: str) -> tuple[str | None, str]:
    """(run, name within the run): `alice/policy-v3` -> ("alice", "policy-v3"), `policy-v3` -> (None, "policy-v3")."""
    run, sep, local = name.partition("/")
    return (run, local) if sep else (None, name)


def is_adapter_name(name: object) -> bool:
    """Whether `name` may name an adapter: a plain name, or `<run>/<name>` with a valid run name."""
    if not isinstance(name, str):
        return False
    run, local = split_run(name)
    return bool(ADAPTER_NAME.fullmatch(local)) and (run is None or bool(RUN_NAME.fullmatch(run)))


def bucket_version(name: str) -> tuple[str | None, int] | None:
    """(run, version) when `name` is a bucket version (`policy-v3`, `alice/policy-v3`), else None."""
    match = _BUCKET_VERSION.fullmatch(name)
    return (match.group("run"), int(match.group("version"))) if match else None


def run_bucket_url(bucket_url: str, run: str) -> str:
    """The prefix of the fleet's bucket that run `run` publishes under (its `bucket.url`)."""
    return f"{bucket_url.rstrip('/')}/runs/{run}"
