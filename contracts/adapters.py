"""Adapter names: one spelling for the fleet's name of a version, its key in the bucket, and the run it belongs to.

A trainer publishes a lineage of versions under one stem: spotrl's learner `policy-v1, policy-v2, ...`,
TRL's AsyncGRPOTrainer `trl-policy-v1, ...`. A learner whose run self-distils from an average of its own versions
(an `ema` self teacher) publishes that average as a second lineage of the run, `ema-v1, ema-v2, ...`, beside its
policy in the same prefix and signed with the same key: the fleet pins, loads and removes it like the policy's. Only the newest `max_staleness + 1` versions of a lineage
can still be named by a sample in flight, so a replica pins LoRA slots per lineage (`family_of`),
whoever the client. A name without a `-v<N>` suffix is a family of its own.

On a shared fleet a run's adapters are namespaced by the run: `alice/policy-v3` is version 3 of run
`alice`'s lineage `alice/policy`, published under the run's own prefix of the fleet's bucket
(`<bucket>/runs/alice/adapters/policy-v3`). The full name is what the router seeds its hash chain with
and what the ingress checks a caller's token against. `AdapterRef` is that mapping, in one place:

    ref = AdapterRef(3, "alice")
    ref.name                          # "alice/policy-v3"  (what the fleet serves, what a request names)
    ref.key                           # "policy-v3"        (the version's folder under the run's prefix)
    run_prefix("s3://b/fleet", "alice")  # "s3://b/fleet/runs/alice"  (the run's bucket.url)

A fleet's own records of its runs live beside the runs' prefixes, inside none (`RECORDS_PREFIX`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What a client puts in `model`: letters, digits, '.', '_', '-'; never the base model's own name. A run's
# adapters carry `<run>/` in front.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
MAX_ADAPTER_NAME_CHARS = 32 + 1 + 128
POLICY_STEM = "policy"
EMA_STEM = "ema"  # the exponential average of a run's policy versions, an `ema` self teacher's lineage
BUCKET_STEMS = (POLICY_STEM, EMA_STEM)  # the lineages a learner publishes to the bucket, each `<stem>-v<N>`
# The bucket versions: `policy-v<N>` (or `ema-v<N>`) of the fleet's own learner, `<run>/policy-v<N>` of a run's.
_BUCKET_VERSION = re.compile(r"(?:(?P<run>[a-z0-9][a-z0-9_-]{0,31})/)?(?P<stem>policy|ema)-v(?P<version>0|[1-9][0-9]*)")
# A committed version's URL: `<lineage's bucket.url>/adapters/policy-v<N>`.
_VERSION_URL = re.compile(r"(?P<prefix>[a-z][a-z0-9+.-]*://.+?)/adapters/policy-v(?P<version>0|[1-9][0-9]*)/?")
# `<family>-v<N>`, no leading zeros (v03 would alias v3).
_VERSIONED = re.compile(r"(?P<family>.+)-v(?P<version>0|[1-9][0-9]*)")


@dataclass(frozen=True)
class AdapterRef:
    """Version `version` of the `stem` lineage (policy or ema) of `run` (None: the fleet's own, at the bucket's root)."""

    version: int
    run: str | None = None
    stem: str = POLICY_STEM

    @property
    def key(self) -> str:
        """The version's name inside its lineage's prefix of the bucket: `policy-v3`, `ema-v3`."""
        return f"{self.stem}-v{self.version}"

    @property
    def name(self) -> str:
        """What the fleet serves it as and a request names: `alice/policy-v3`, or `policy-v3` for the fleet's own."""
        return f"{self.run}/{self.key}" if self.run else self.key

    @property
    def family(self) -> str:
        """Its lineage, whose versions share pinned LoRA slots: `alice/policy`."""
        return family_of(self.name)[0]

    @classmethod
    def parse(cls, name: str) -> AdapterRef | None:
        """The bucket version a name means (`policy-v3`, `alice/policy-v3`, `alice/ema-v3`), else None (another
        client's name)."""
        match = _BUCKET_VERSION.fullmatch(name)
        return cls(int(match.group("version")), match.group("run"), match.group("stem")) if match else None


def adapter_name(version: int, run: str | None = None, stem: str = POLICY_STEM) -> str:
    """`AdapterRef(version, run, stem).name`: the name under which the fleet serves a version of a lineage."""
    return AdapterRef(version, run, stem).name


def in_lineage(name: str, stem: str) -> str:
    """The same version of the run's `stem` lineage: `alice/policy-v3`, "ema" -> `alice/ema-v3` (what an ema teacher
    scores a group sampled by policy-v3 with); ValueError for a name that is no bucket version's."""
    ref = AdapterRef.parse(name)
    if ref is None:
        raise ValueError(f"{name!r} names no bucket version")
    return AdapterRef(ref.version, ref.run, stem).name


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


def split_version_url(url: str) -> tuple[str, int] | None:
    """(its lineage's prefix, version) of a committed version's URL (`s3://b/run/adapters/policy-v3` ->
    ("s3://b/run", 3)), else None."""
    match = _VERSION_URL.fullmatch(url)
    return (match.group("prefix"), int(match.group("version"))) if match else None


def run_prefix(bucket_url: str, run: str | None) -> str:
    """The prefix of the fleet's bucket that run `run` publishes under (its `bucket.url`); the bucket itself for
    the fleet's own lineage."""
    return f"{bucket_url.rstrip('/')}/runs/{run}" if run else bucket_url


def bucket_of(prefix: str, run: str | None) -> str:
    """The fleet's bucket that `prefix` is run `run`'s prefix of (`run_prefix`, inverted)."""
    suffix = f"/runs/{run}" if run else ""
    if not prefix.endswith(suffix):
        raise ValueError(f"{prefix!r} is not run {run!r}'s prefix of a fleet's bucket")
    return prefix[: len(prefix) - len(suffix)] if suffix else prefix


# Where a fleet keeps its records of runs: `<bucket>/fleet/`, beside the runs' prefixes (`<bucket>/runs/<name>`) and
# inside none of them, so that no run can rewrite its own registration; only the ingress writes there.
RECORDS_PREFIX = "fleet"
