"""What a tinker path may be, and what it may reach, checked before anything is saved under it or loaded from it.

A checkpoint's name becomes the last segment of its path (`tinker://<model>/<segment>/<name>`): a name that the SDK's
own parser would not give back (a `/`, say) would be saved, and then break every listing of the key, so it is refused
at once. Each kind of checkpoint numbers from 1 in a store of its own, so a path's number is used only for the kind
its record says (`core.bucket.tinker_paths`): another kind is a 400, never another checkpoint. A published sampler
version is copied into another key's lineage only under the owner's signature, with the key the fleet derives for
the owner (`contracts.auth.lineage_key`).
"""

from __future__ import annotations

import time

from tinker.types.checkpoint import ParsedCheckpointTinkerPath

from contracts.auth import Secret, lineage_key, signing_secret
from core.bucket.tinker_paths import PATH_KINDS, owner_run, record_kind

SEGMENTS = {kind: segment for segment, kind in PATH_KINDS.items()}
MAX_NAME = 256
MAX_METADATA = 64  # entries of a checkpoint's user_metadata
MAX_METADATA_TEXT = 1024  # characters of one key or value
TTL_RANGE_S = (3600, 10 * 365 * 86400)  # a checkpoint's ttl_seconds, as the SDK documents it: 1 hour to 10 years


class PathRefused(Exception):
    """A name, path or metadata that the route refuses (a 400 in the SDK's error shape)."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    """The tinker path of checkpoint `name` of `kind` saved by training client `model_id`, the name checked: one the
    SDK's parser gives back unchanged, of at most `MAX_NAME` printable characters, not `.` or `..`."""
    path = f"tinker://{model_id}/{SEGMENTS[kind]}/{name}"
    if not 0 < len(name) <= MAX_NAME or name in (".", "..") or not name.isprintable() or "\\" in name:
        raise PathRefused(f"checkpoint name {name[:80]!r}: 1 to {MAX_NAME} printable characters, no '\\', not . or ..")
    try:
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError:
        parsed = None
    if parsed is None or parsed.checkpoint_id != f"{SEGMENTS[kind]}/{name}":
        raise PathRefused(f"checkpoint name {name[:80]!r}: a name may not contain '/'")
    return path


def require_kind(record: dict, kind: str, path: str) -> None:
    """Refuse a path whose record is of another kind than the route takes (its number counts in another store)."""
    found = record_kind(record)
    if found != kind:
        raise PathRefused(
            f"{path[:200]}: names {found} weights; this call takes {kind} weights ({SEGMENTS[kind]} paths)"
        )


def user_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """A checkpoint's `user_metadata`, bounded: it is kept in the bucket beside the checkpoint and listed with it."""
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA or any(
        len(k) > MAX_METADATA_TEXT or len(v) > MAX_METADATA_TEXT for k, v in metadata.items()
    ):
        raise PathRefused(f"user_metadata: at most {MAX_METADATA} entries of at most {MAX_METADATA_TEXT} characters")
    return dict(metadata)


def owner_key(admin_token: Secret | None, prefix: str) -> str:
    """The key the versions under `prefix` (a run's prefix of the fleet's bucket) are signed with, derived as the fleet
    derives it from its admin token (`deployments.fleet`): what a published version must verify under."""
    return lineage_key(signing_secret(admin_token.value if admin_token else None), owner_run(prefix)).value


def parsed(path: str) -> ParsedCheckpointTinkerPath:
    """A tinker path as the SDK's parser reads it; a 400 for one it does not."""
    try:
        return ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as exc:
        raise PathRefused(f"tinker path {path[:200]!r}: {exc}") from None


def route_path(training_run_id: str, checkpoint_id: str) -> str:
    """The tinker path a checkpoint route names (`/training_runs/{id}/checkpoints/{checkpoint_id}`), checked."""
    path = f"tinker://{training_run_id}/{checkpoint_id}"
    parsed(path)
    return path


def expiry(ttl_seconds: int | None) -> float | None:
    """When a checkpoint saved (or given a TTL) now with `ttl_seconds` expires, in epoch seconds; None: never."""
    if ttl_seconds is None:
        return None
    low, high = TTL_RANGE_S
    if not low <= ttl_seconds <= high:
        raise PathRefused(f"ttl_seconds {ttl_seconds}: must be between {low} (1 hour) and {high} (10 years)")
    return time.time() + ttl_seconds
