"""A verified local copy of a committed folder, and the cache of such copies.

Readers trust nothing that the manifest does not list and checksum: every file is downloaded into a staging
folder of this process, checked against its manifest's size and sha256, and the folder renamed into place
whole, so nobody ever sees half a folder and concurrent fetches of one version need no lock. A fetched
folder is cached under a key of the bucket and the commit id (a bucket wiped and reused never serves an
old copy); `prune_cached` keeps a replica's disk to the newest few versions.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from app.bucket.filesystem import BucketError, IntegrityError, VersionNotFound, is_missing
from app.bucket.manifest import COMMIT, MANIFEST, hash_file
from contracts.auth import redact

if TYPE_CHECKING:
    from app.bucket.committed import CommittedStore

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


def prune_cached(store: CommittedStore, keep: int) -> list[Path]:
    root = cache_root(store)
    entries: dict[int, list[Path]] = {}
    for path in root.glob("*.*") if root.is_dir() else ():
        name, _, commit = path.name.rpartition(".")
        number = store._parse_name(name)
        if number is not None and COMMIT.fullmatch(commit):
            entries.setdefault(number, []).append(path)
    removed = []
    for number in sorted(entries, reverse=True)[keep:]:
        for path in entries[number]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
