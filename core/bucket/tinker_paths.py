"""The tinker paths a tenant was handed, recorded in its prefix of the fleet's bucket, and the numbers behind them.

A tinker path (`tinker://<model>/<segment>/<name>`) names a saved state, a sampler version or an export, each a
number in a store of its own (`store`), and each store numbers from 1: so a number means nothing without its kind.
The learner records every path beside what it names (`tinker/paths/` of the tenant's prefix), with the kind of store
its number counts in, written when it was saved (`kind`): a route checks the record's kind, never a number alone.

A number is never handed out twice in one store, so that nothing that kept one (a download link, a training client's
last state, the fleet's name for a version) can come to mean other weights: a deleted one leaves a marker
(`tinker/retired/<kind>/`) before it goes, a new one is taken above every number committed or retired, and committed
create-only, the next number tried on a collision (two learners saving for one key at once).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from contracts.adapters import bucket_of
from contracts.auth import Secret
from contracts.retry import Backoff
from contracts.tinker import EXPORTS_PREFIX, PUBLIC_PREFIX, STATES_PREFIX
from core.bucket.filesystem import VersionExists
from core.bucket.records import JsonRecords

PATHS = "tinker/paths"  # under a tenant's prefix: one small JSON per tinker path the service handed out
RETIRED = "tinker/retired"  # under a tenant's prefix: one marker per deleted number, by kind
KEPT = "tinker/kept"  # under a tenant's prefix: per training client, the state the service saved for it on a notice
# A tinker path's middle segment and the kind of what it names (the SDK's `CheckpointType`).
PATH_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
COMMIT_ATTEMPTS = 16  # numbers tried past the first free one before a save gives up


def path_kind(path: str) -> str:
    """`training`, `sampler` or `external`: what a tinker path (`tinker://<model>/<segment>/<name>`) names."""
    parts = path.removeprefix("tinker://").split("/")
    kind = PATH_KINDS.get(parts[1]) if len(parts) >= 3 else None
    if kind is None:
        raise ValueError(f"{path[:200]!r} is not a tinker path of saved weights")
    return kind


def record_kind(record: dict) -> str:
    """The kind of store a record's number counts in: as the learner wrote it (records from before say it by their
    path, which the learner built for what it saved)."""
    return record.get("kind") or path_kind(record["path"])


def record_name(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()  # a path is the user's text: never a name in the bucket


def expired(record: dict) -> bool:
    return record.get("expires") is not None and record["expires"] <= time.time()


def records(url: str, folder: str) -> JsonRecords:
    """Small JSON records under `folder` of the bucket at `url`, each call retried while the bucket's errors pass."""
    return JsonRecords(url, folder, backoff=Backoff(attempts=5, first_s=0.2))


def paths(prefix: str) -> JsonRecords:
    """The records of the tinker paths a tenant was given, in its prefix of the bucket."""
    return records(prefix, PATHS)


def own_record(prefix: str, path: str) -> dict | None:
    """The record of `path` under a tenant's `prefix`; None when it has none, or it expired."""
    saved = paths(prefix).get(record_name(path))
    return None if saved is None or saved.get("path") != path or expired(saved) else saved


def public(prefix: str, run: str) -> JsonRecords:
    """The pointers to the paths their owners published, in the fleet's bucket beside the tenants' prefixes (`run`'s
    prefix is `prefix`), where only the learner writes."""
    return records(bucket_of(prefix, run), PUBLIC_PREFIX)


def owner_run(prefix: str) -> str:
    """The run whose prefix of a fleet's bucket `prefix` is (`contracts.adapters.run_prefix`)."""
    head, sep, run = prefix.rstrip("/").rpartition("/runs/")
    if not sep or not head or not run or "/" in run:
        raise ValueError(f"{prefix[:200]!r} is no run's prefix of a fleet's bucket")
    return run


def store(prefix: str, kind: str, cache_dir: str, signing_key: Secret | None = None):
    """The store of a tenant's saved states, sampler versions or exports under its `prefix`."""
    from core.bucket.store import AdapterStore, CheckpointStore

    if kind == "sampler":
        return AdapterStore(prefix, cache_dir=cache_dir, signing_key=signing_key)
    folder = EXPORTS_PREFIX if kind == "external" else STATES_PREFIX
    return CheckpointStore(f"{prefix}/{folder}", cache_dir=cache_dir)


def _retired(prefix: str, kind: str) -> JsonRecords:
    return records(prefix, f"{RETIRED}/{kind}")


def retire(prefix: str, kind: str, number: int) -> None:
    """Mark `number` of the tenant's `kind` store as used for good: call it before deleting what it names."""
    _retired(prefix, kind).put(str(number), {"number": number, "time": time.time()})


def commit_new(prefix: str, kind: str, committed: Callable[[], int | None], commit: Callable[[int], object]) -> int:
    """Commit with `commit(number)` under a number of the tenant's `kind` store never used before: above the newest
    `committed()` and every retired one, the next one tried while another saver takes it first; the number."""
    newest = committed() or 0  # the store first, the markers after: a number deleted between the two reads is marked
    markers = _retired(prefix, kind)
    marked = [int(r["number"]) for r in markers.all()]
    retired = max(marked, default=0)
    for below in (n for n in marked if n < retired):  # only the highest marker matters: the others go
        markers.delete(str(below))
    number = max(newest, retired) + 1
    for _ in range(COMMIT_ATTEMPTS):
        try:
            commit(number)
            return number
        except VersionExists:
            number += 1
    raise VersionExists(f"{kind} store of {prefix}: no free number from {number - COMMIT_ATTEMPTS} on")


def remember(prefix: str, path: str, kind: str, number: int, **fields) -> dict | None:
    """Record the tinker `path` the user was given for `number` of the tenant's `kind` store (with `fields`: `model`,
    `expires`, the adapter's, `size_bytes`, `user_metadata`); the record it replaced, if any."""
    before = paths(prefix).get(record_name(path))  # expired or not: what it names goes too
    before = before if before is not None and before.get("path") == path else None
    record = {"path": path, "kind": kind, "number": number, "time": time.time(), **fields}
    paths(prefix).put(record_name(path), record)
    return before


def keep(prefix: str, model: str, number: int, kept: int = 2) -> list[int]:
    """Record state `number` as the newest the service saved for training client `model` (a spot notice's, which no
    path names); the states recorded before it beyond the newest `kept` (two: a save that answered late may still be
    the one the service restores from), which are superseded."""
    saves = records(prefix, KEPT)
    before = saves.get(record_name(model))
    numbers = [int(n) for n in (before or {}).get("numbers", [])] + [number]
    saves.put(record_name(model), {"model": model, "numbers": numbers[-kept:], "time": time.time()})
    return [n for n in numbers[:-kept] if n != number]
