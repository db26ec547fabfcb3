"""A verified local copy of a committed folder, and the cache of such copies.

Readers trust nothing that the manifest does not list and checksum: every file is downloaded into a staging
folder of this process, checked against its manifest's size and sha256, and the folder renamed into place
whole, so nobody ever sees half a folder and concurrent fetches of one version need no lock. A fetched
folder is cached under a key of the bucket and the commit id (a bucket wiped and reused never serves an
old copy).

The cache is shared by every process of the machine that fetches from the same bucket (the replicas of one node),
and pruned by each of them: `prune_cached` keeps the newest few versions of a prefix, `drop_cached` a prefix whose
run left, and neither ever deletes a folder that a process holds (`hold`: a shared `flock` on the folder, taken
right after the fetch and kept while the folder is in use; the kernel lets go of it when the process dies, so a
preempted replica holds nothing). A pruner renames a folder away under an exclusive lock before it deletes it, so
a fetch that found the folder just before sees, once it holds it, that it is gone, and fetches it again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.auth import redact
from core.bucket.filesystem import BucketError, IntegrityError, VersionNotFound, is_missing
from core.bucket.manifest import COMMIT, MANIFEST, hash_file

if TYPE_CHECKING:
    from core.bucket.committed import CommittedStore

_STALE_STAGING_S = 3600  # a fetch staging folder this old belongs to a process that died


def cache_root(store: CommittedStore) -> Path:
    """Where fetched folders of this bucket live: a readable slug plus a hash of URL and endpoint."""
    where = f"{store._scheme}://{store._root}"
    endpoint = store.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    key = hashlib.sha256(f"{where}|{endpoint or ''}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", where).strip("-")[-40:]
    return store.cache_dir / f"{slug}-{key}" / store.kind


def holds(folder: Path, manifest: dict) -> bool:
    """`folder` is a finished download of exactly this commit (sizes re-checked; hashes were on arrival)."""
    try:
        if json.loads((folder / MANIFEST).read_bytes()) != manifest:
            return False
        return all((folder / rel).stat().st_size == spec["size"] for rel, spec in manifest["files"].items())
    except (OSError, ValueError):
        return False


def fetch_verified(store: CommittedStore, op: str, number: int, dest) -> Path:
    number = store._check_number(number)
    url = store._url_of(number)
    with store._errors(op, url):
        manifest, raw = store._read_manifest(op, number)
        # The default place is keyed by commit: a bucket wiped and reused never serves an old cache.
        final = (
            Path(dest).expanduser().absolute()
            if dest is not None
            else (cache_root(store) / f"{store._name(number)}.{manifest['commit']}")
        )
        if final.exists():
            if holds(final, manifest):
                return final
            if dest is not None and (not final.is_dir() or any(final.iterdir())):
                raise BucketError(f"{op} {redact(url)}: {final} exists and holds something else")
            if dest is None:  # a damaged cache entry: move it out of the way, then fetch afresh
                trash = final.with_name(f".{final.name}.trash-{uuid.uuid4().hex[:8]}")
                with contextlib.suppress(FileNotFoundError):
                    final.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        sweep_staging(final.parent)
        # Each process downloads into its own staging folder and renames it into place, so nobody
        # ever sees half a folder and concurrent fetches of one version need no lock.
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.part-", dir=final.parent))
        try:
            for rel, spec in manifest["files"].items():
                local = staging / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                remote = store._path(number, manifest["commit"], rel)
                try:
                    store._retry(op, url, f"download {rel}", store._fs.get_file, remote, str(local))
                except Exception as exc:
                    if not is_missing(exc):
                        raise
                    if store._read_or_none(op, url, store._path(number, MANIFEST)) is None:
                        raise VersionNotFound(f"{op} {redact(url)}: collected while being fetched") from None
                    raise IntegrityError(f"{op} {redact(url)}: {rel} is listed in {MANIFEST} but missing") from None
                size, digest = hash_file(local)
                if size != spec["size"] or digest != spec["sha256"]:
                    what = f"size {size} != {spec['size']}" if size != spec["size"] else "sha256 mismatch"
                    raise IntegrityError(f"{op} {redact(url)}: {rel} does not match its manifest ({what})")
            (staging / MANIFEST).write_bytes(raw)
            try:
                os.rename(staging, final)
            except OSError as exc:
                # Another process renamed its copy first; theirs is as good as ours.
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not holds(final, manifest):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return final


def sweep_staging(folder: Path) -> None:
    cutoff = time.time() - _STALE_STAGING_S
    for path in folder.glob(".*.part-*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)


class HeldFolder:
    """A local adapter folder in use: a cached one is held (`hold`) until `release`, so that no prune deletes it."""

    def __init__(self, path: Path, fd: int | None = None):
        self.path, self._fd = path, fd

    def __repr__(self) -> str:
        return f"HeldFolder({str(self.path)!r})"

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def hold(folder: Path) -> int | None:
    """A shared lock on a cached folder, so that no pruner of this machine deletes it while it is in use: its open
    descriptor (close it to let go), or None when the folder was pruned since it was found."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a pruner holds it, for the moment of a rename
    with contextlib.suppress(FileNotFoundError):
        if os.stat(folder).st_ino == os.fstat(fd).st_ino:  # still there, not renamed away meanwhile
            return fd
    os.close(fd)
    return None


@contextlib.contextmanager
def _alone(folder: Path) -> Iterator[int | None]:
    """An exclusive lock on `folder` unless some process holds it (`hold`): its descriptor, or None when held.
    FileNotFoundError when the folder is gone."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)  # and with it the lock


def is_held(folder: Path) -> bool:
    """Whether some process holds the folder (`hold`) right now."""
    try:
        with _alone(folder) as fd:
            return fd is None
    except FileNotFoundError:
        return False


def remove_unheld(folder: Path) -> bool:
    """Delete a cached folder unless some process holds it (`hold`); whether it is gone."""
    trash = folder.with_name(f".{folder.name}.trash-{uuid.uuid4().hex[:8]}")
    try:
        with _alone(folder) as fd:
            if fd is None or os.stat(folder).st_ino != os.fstat(fd).st_ino:
                return False  # in use, or fetched anew since it was opened: another round will see
            folder.rename(trash)
    except FileNotFoundError:
        return True
    shutil.rmtree(trash, ignore_errors=True)
    return True


def cached_versions(store: CommittedStore) -> dict[int, list[Path]]:
    """The cached folders of `store`, by version (several commits of one version if the bucket was reused)."""
    root = cache_root(store)
    entries: dict[int, list[Path]] = {}
    for path in root.glob("*.*") if root.is_dir() else ():
        name, _, commit = path.name.rpartition(".")
        number = store._parse_name(name)
        if number is not None and COMMIT.fullmatch(commit):
            entries.setdefault(number, []).append(path)
    return entries


def prune_cached(store: CommittedStore, keep: int) -> list[Path]:
    """Delete the cached folders of `store` but those some process holds and the newest `keep` others; the deleted."""
    entries = cached_versions(store)
    removed, spare = [], keep
    for number in sorted(entries, reverse=True):
        for path in entries[number]:
            if is_held(path):
                continue
            if spare > 0:
                spare -= 1
            elif remove_unheld(path):
                removed.append(path)
    return removed


def drop_cached(store: CommittedStore) -> bool:
    """Delete every cached folder of `store` that no process holds, and its part of the cache once empty; whether
    nothing of it is left."""
    root = cache_root(store)
    if not root.is_dir():
        return True
    sweep_staging(root)
    for paths in cached_versions(store).values():
        for path in paths:
            remove_unheld(path)
    for folder in (root, root.parent):  # <slug-key>/<kind>, then <slug-key>: each only if empty
        with contextlib.suppress(OSError):
            folder.rmdir()
    return not root.exists()


def cache_usage(store: CommittedStore) -> tuple[int, int]:
    """(folders, bytes) of `store`'s cached versions."""
    folders = [path for paths in cached_versions(store).values() for path in paths]
    size = 0
    for folder in folders:
        for file in folder.rglob("*"):
            with contextlib.suppress(OSError):
                size += file.stat().st_size if file.is_file() else 0
    return len(folders), size
