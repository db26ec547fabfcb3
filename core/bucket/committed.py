"""The bucket: the only thing the learner and the vLLM fleet share.

Adapters (`adapters/policy-v{N}/`) and learner checkpoints (`checkpoints/step-{S}/`) travel through
one fsspec URL, `file://` on one machine or `s3://` (through s3fs) in a cluster, never through NCCL.
A folder exists only once its `MANIFEST.json` (size and sha256 of every file) has been written with a
create-only write (`If-None-Match: *` on S3, a hard link on a local disk): S3 has no atomic rename, so
the manifest is the commit point, and readers trust nothing that it does not list and checksum.

Each publish uploads its files under a fresh commit id (`policy-v3/<commit>/adapter_model...`) and
names that id in the manifest (signed, in a store with a key: `core.bucket.manifest`). Two publishers of one
version therefore never overwrite each other's bytes: the one whose manifest lands first wins, the other gets `VersionExists`, and a publisher that
died half-way leaves only an orphan folder that no reader looks at and `gc` sweeps away. Files are
never overwritten once written.

Transient failures (connection refused, 5xx, throttling, timeouts) are retried here with jittered
exponential backoff and a bound; s3fs's and botocore's own retries are switched off so that there is
one retry policy, not three multiplied together. Error messages name the URL and the operation and
go through `redact`, so they cannot carry credentials.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contracts.auth import Secret, redact
from contracts.retry import Backoff, retry
from core.bucket.filesystem import (
    BucketError,
    IntegrityError,
    InvalidName,
    NotSigned,
    VersionExists,
    VersionNotFound,
    describe_error,
    error_chain,
    is_missing,
    is_precondition_failed,
    is_transient,
    make_filesystem,
    parse_url,
    s3_error_code,
)
from core.bucket.manifest import (
    COMMIT,
    HEX64,
    MANIFEST,
    MANIFEST_FORMAT,
    SIGNATURE,
    check_relative,
    hash_file,
    manifest_signature,
    signed_by,
)

log = logging.getLogger(__name__)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommittedStore(abc.ABC):
    """Numbered folders under `<root>/<kind>/` that exist only once their manifest is committed."""

    kind = ""  # "adapters" or "checkpoints": the folder under the bucket's prefix
    noun = ""  # "version" or "step", for messages

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 6,
        backoff_s: float = 0.2,
        cache_dir: str | os.PathLike = "~/.cache/spotrl/adapters",
        signing_key: Secret | None = None,
    ):
        if max_attempts < 1 or backoff_s < 0:
            raise ValueError("max_attempts must be >= 1 and backoff_s >= 0")
        self.url = url
        self.endpoint_url = endpoint_url
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.cache_dir = Path(cache_dir).expanduser()
        self._scheme, self._root = parse_url(url)
        self._fs, _ = make_filesystem(url, endpoint_url=endpoint_url, region=region)
        self._local = self._scheme == "file"
        # With a key, what it commits is signed, and what it reads must be (`contracts.auth.lineage_key`).
        self.signing_key = signing_key
        self._sleep = time.sleep  # replaced by unit tests that count backoff instead of waiting

    @classmethod
    def from_config(cls, cfg, signing_key: Secret | None = None):
        """The store a run's config names (`cfg.bucket_url` with `cfg.bucket.*`)."""
        return cls.at(cfg.bucket_url, cfg.bucket, signing_key)

    @classmethod
    def at(cls, url: str, bucket, signing_key: Secret | None = None):
        """The store at `url` with the retries, endpoint and cache of a `BucketConfig`."""
        return cls(
            url,
            endpoint_url=bucket.endpoint_url,
            region=bucket.region,
            max_attempts=bucket.max_attempts,
            backoff_s=bucket.backoff_s,
            cache_dir=bucket.cache_dir,
            signing_key=signing_key,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"

    # ---- names --------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _name(self, number: int) -> str:
        """The folder name of a number: `policy-v3`, `step-40`."""

    def _parse_name(self, name: str) -> int | None:
        stem = self._name(0)[:-1]  # the spelling without its number: "policy-v", "step-"
        m = re.fullmatch(re.escape(stem) + r"(0|[1-9][0-9]*)", name)  # no leading zeros: v03 would alias v3
        return int(m.group(1)) if m else None

    def _check_number(self, number: Any) -> int:
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise InvalidName(f"{self.noun} {number!r}: must be an integer >= 0")
        return number

    def _path(self, number: int, *parts: str) -> str:
        return "/".join([self._root, self.kind, self._name(number), *parts])

    def _url_of(self, number: int) -> str:
        path = self._path(self._check_number(number))
        return f"file://{path}" if self._local else f"s3://{path}"

    # ---- plumbing: retries and errors ---------------------------------------------------------------

    def _retry(self, op: str, url: str, what: str, fn, *args, **kwargs):
        """fn(*args) retried on transient errors; other errors go up unchanged for the caller to read."""

        def warn(exc: BaseException, attempt: int, pause_s: float) -> None:
            log.warning(
                "%s %s: %s failed (%s), retry %d/%d in %.2fs",
                *(op, redact(url), what, describe_error(exc), attempt, self.max_attempts - 1, pause_s),
            )

        backoff = Backoff(attempts=self.max_attempts, first_s=self.backoff_s)
        try:
            return retry(lambda: fn(*args, **kwargs), backoff, is_transient, warn, sleep=self._sleep)
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise BucketError(
                f"{op} {redact(url)}: {what} failed after {self.max_attempts} attempts: {describe_error(exc)}"
            ) from None

    @contextlib.contextmanager
    def _errors(self, op: str, url: str):
        """Whatever escapes becomes one BucketError naming op and URL; `from None` keeps credentials-bearing
        internals (botocore request dumps) out of tracebacks."""
        try:
            yield
        except BucketError:
            raise
        except Exception as exc:
            if any(s3_error_code(e)[0] == "NoSuchBucket" for e in error_chain(exc)):
                raise BucketError(f"{op} {redact(url)}: the bucket does not exist") from None
            raise BucketError(f"{op} {redact(url)}: {describe_error(exc)}") from None

    def _read_or_none(self, op: str, url: str, path: str) -> bytes | None:
        try:
            return self._retry(op, url, f"read {path.rsplit('/', 1)[-1]}", self._fs.cat_file, path)
        except Exception as exc:
            if is_missing(exc):
                return None
            raise

    def _create_only(self, path: str, data: bytes) -> None:
        """Write `data` at `path` only if nothing is there; a lost race raises (is_precondition_failed)."""
        if not self._local:
            self._fs.pipe_file(path, data, mode="create")
            return
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".manifest-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # atomic, refuses an existing name, and the content is complete when visible
            _fsync_dir(folder)
        finally:
            os.unlink(tmp)

    def _upload(self, source: Path | bytes, remote: str) -> None:
        if isinstance(source, bytes):
            self._fs.pipe_file(remote, source)
        else:
            self._fs.put_file(str(source), remote)
        if self._local:  # the manifest may only commit bytes that are on the disk
            with open(remote, "rb+") as f:
                os.fsync(f.fileno())

    def _remove(self, op: str, url: str, path: str, recursive: bool) -> None:
        try:
            self._retry(op, url, f"remove {path}", self._fs.rm, path, recursive=recursive)
        except Exception as exc:
            if not is_missing(exc):  # a concurrent gc got there first
                raise

    # ---- the commit protocol ------------------------------------------------------------------------

    def _commit(self, op: str, number: int, sources: Mapping[str, Path | bytes], extra: dict) -> dict:
        number = self._check_number(number)
        name, url = self._name(number), self._url_of(number)
        for rel in sources:
            check_relative(rel)
        with self._errors(op, url):
            if self._read_or_none(op, url, self._path(number, MANIFEST)) is not None:
                raise VersionExists(f"{op} {redact(url)}: {name} is already committed")
            commit = uuid.uuid4().hex[:12]
            files = {}
            for rel, source in sorted(sources.items()):
                if isinstance(source, bytes):
                    size, digest = len(source), hashlib.sha256(source).hexdigest()
                else:
                    size, digest = hash_file(source)
                self._retry(op, url, f"upload {rel}", self._upload, source, self._path(number, commit, rel))
                files[rel] = {"size": size, "sha256": digest}
            manifest = {
                "format": MANIFEST_FORMAT,
                "kind": self.kind,
                "name": name,
                self.noun: number,
                "commit": commit,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "created_unix": time.time(),
                "publisher": {"host": socket.gethostname(), "pid": os.getpid()},
                "files": files,
                **extra,
            }
            if self.signing_key is not None:
                manifest[SIGNATURE] = manifest_signature(manifest, self.signing_key.value)
            data = json.dumps(manifest, indent=2, sort_keys=True).encode()
            try:
                self._retry(op, url, "commit manifest", self._create_only, self._path(number, MANIFEST), data)
            except Exception as exc:
                if not is_precondition_failed(exc):
                    raise
                # A retried create whose first try landed reads back as our own bytes: that is a win.
                if self._read_or_none(op, url, self._path(number, MANIFEST)) == data:
                    return manifest
                with contextlib.suppress(Exception):  # best effort: gc sweeps orphan uploads anyway
                    self._remove(op, url, self._path(number, commit), recursive=True)
                raise VersionExists(f"{op} {redact(url)}: another publisher committed {name} first") from None
            return manifest

    def _scan(self, op: str) -> tuple[set[int], set[int]]:
        """(committed numbers, every number with a folder at all) from one listing, uncached."""
        base = f"{self._root}/{self.kind}"
        url = f"file://{base}" if self._local else f"s3://{base}"
        with self._errors(op, url):
            try:
                paths = self._retry(op, url, "list", self._fs.find, base)
            except Exception as exc:
                if not is_missing(exc):
                    raise
                paths = []
        committed, present = set(), set()
        for path in paths:
            if not path.startswith(base + "/"):
                continue
            parts = path[len(base) + 1 :].split("/")
            number = self._parse_name(parts[0])
            if number is None or len(parts) < 2:
                continue
            present.add(number)
            if parts[1:] == [MANIFEST]:  # never trust a prefix: empty folders linger in SeaweedFS listings
                committed.add(number)
        return committed, present

    def _committed(self, op: str) -> list[int]:
        return sorted(self._scan(op)[0], reverse=True)

    def _read_manifest(self, op: str, number: int) -> tuple[dict, bytes]:
        url = self._url_of(number)
        raw = self._read_or_none(op, url, self._path(number, MANIFEST))
        if raw is None:
            raise VersionNotFound(f"{op} {redact(url)}: {self._name(number)} is not committed")
        try:
            manifest = json.loads(raw)
            files = manifest["files"]
            ok = (
                manifest.get("format") == MANIFEST_FORMAT
                and manifest.get("name") == self._name(number)
                and COMMIT.fullmatch(str(manifest.get("commit")))
                and isinstance(files, dict)
                and files
            )
            for rel, spec in files.items() if ok else ():
                check_relative(rel)
                ok = ok and isinstance(spec.get("size"), int) and bool(HEX64.fullmatch(str(spec.get("sha256"))))
        except (ValueError, KeyError, TypeError, AttributeError, InvalidName):
            ok = False
        if not ok:
            raise IntegrityError(f"{op} {redact(url)}: {MANIFEST} is malformed")
        if self.signing_key is not None and not signed_by(manifest, self.signing_key.value):
            raise NotSigned(f"{op} {redact(url)}: not signed with this lineage's key; refused, whoever wrote it")
        return manifest, raw

    def _delete(self, op: str, number: int) -> None:
        url = self._url_of(number)
        with self._errors(op, url):
            # Manifest first: from this moment no reader starts on it, and fetches under way
            # notice the missing files and report the version as collected, not corrupt.
            self._remove(op, url, self._path(number, MANIFEST), recursive=False)
            self._remove(op, url, self._path(number), recursive=True)

    def delete(self, number: int) -> None:
        """Remove `number` (manifest first, as gc does); removing one that is not there is no error."""
        self._delete("delete", self._check_number(number))

    def _gc(self, op: str, keep: int) -> list[int]:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        committed, present = self._scan(op)
        ordered = sorted(committed, reverse=True)
        doomed = ordered[keep:]
        for number in doomed:
            self._delete(op, number)
        # Uploads that never committed (a publisher died or lost a race), older than anything kept;
        # newer ones may be a publish in progress.
        kept = ordered[:keep]
        for number in sorted(present - committed):
            if kept and number < kept[-1]:
                url = self._url_of(number)
                with self._errors(op, url):
                    self._remove(op, url, self._path(number), recursive=True)
        return doomed
