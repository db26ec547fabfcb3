"""The bucket: the only thing the learner and the vLLM fleet share.

Adapters (`adapters/policy-v{N}/`) and learner checkpoints (`checkpoints/step-{S}/`) travel through
one fsspec URL, `file://` on one machine or `s3://` (through s3fs) in a cluster, never through NCCL.
A folder exists only once its `MANIFEST.json` (size and sha256 of every file) has been written with a
create-only write (`If-None-Match: *` on S3, a hard link on a local disk): S3 has no atomic rename, so
the manifest is the commit point, and readers trust nothing that it does not list and checksum.

Each publish uploads its files under a fresh commit id (`policy-v3/<commit>/adapter_model...`) and
names that id in the manifest. Two publishers of one version therefore never overwrite each other's
bytes: the one whose manifest lands first wins, the other gets `VersionExists`, and a publisher that
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
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.bucket.filesystem import (
    BucketError,
    IntegrityError,
    InvalidName,
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
from contracts.adapters import adapter_name
from contracts.auth import redact
from contracts.retry import Backoff, retry

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "spotrl-manifest/1"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_STALE_STAGING_S = 3600  # a fetch staging folder this old belongs to a process that died
_HEX64 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{12}")


def _hash_file(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return f.tell(), digest


def _check_relative(name: str) -> str:
    """A file name inside a version folder: relative, POSIX, no traversal, not the manifest itself."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if not name or "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts) or name == MANIFEST:
        raise InvalidName(f"file name {name!r}: must be a relative path without empty, . or .. parts")
    return name


def _files_of_dir(local_dir: Path) -> dict[str, Path]:
    if not local_dir.is_dir():
        raise BucketError(f"{local_dir}: not a folder")
    files = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
    files.pop(MANIFEST, None)  # a fetched folder carries the manifest it was checked against: never re-upload it
    if not files:
        raise BucketError(f"{local_dir}: no files to upload")
    return files


def folder_digest(local_dir: Path) -> str:
    """One sha256 over the names and contents of an adapter folder's files (its manifest left out).

    What "the same adapter" means to a replica: a name loaded again from a folder whose files changed
    (a trainer that reuses its output folder) must not keep the old weights under the old name.
    """
    digest = hashlib.sha256()
    for rel, path in _files_of_dir(Path(local_dir)).items():
        digest.update(f"{rel}\0{_hash_file(path)[1]}\0".encode())
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _CommittedStore(abc.ABC):
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
        self._sleep = time.sleep  # replaced by unit tests that count backoff instead of waiting

    @classmethod
    def from_config(cls, cfg):
        """The store a run's config names (`cfg.bucket_url` with `cfg.bucket.*`)."""
        b = cfg.bucket
        return cls(
            cfg.bucket_url,
            endpoint_url=b.endpoint_url,
            region=b.region,
            max_attempts=b.max_attempts,
            backoff_s=b.backoff_s,
            cache_dir=b.cache_dir,
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
            _check_relative(rel)
        with self._errors(op, url):
            if self._read_or_none(op, url, self._path(number, MANIFEST)) is not None:
                raise VersionExists(f"{op} {redact(url)}: {name} is already committed")
            commit = uuid.uuid4().hex[:12]
            files = {}
            for rel, source in sorted(sources.items()):
                if isinstance(source, bytes):
                    size, digest = len(source), hashlib.sha256(source).hexdigest()
                else:
                    size, digest = _hash_file(source)
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
                and _COMMIT.fullmatch(str(manifest.get("commit")))
                and isinstance(files, dict)
                and files
            )
            for rel, spec in files.items() if ok else ():
                _check_relative(rel)
                ok = ok and isinstance(spec.get("size"), int) and bool(_HEX64.fullmatch(str(spec.get("sha256"))))
        except (ValueError, KeyError, TypeError, AttributeError, InvalidName):
            ok = False
        if not ok:
            raise IntegrityError(f"{op} {redact(url)}: {MANIFEST} is malformed")
        return manifest, raw

    def _cache_root(self) -> Path:
        """Where fetched folders of this bucket live: a readable slug plus a hash of URL and endpoint."""
        where = f"{self._scheme}://{self._root}"
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        key = hashlib.sha256(f"{where}|{endpoint or ''}".encode()).hexdigest()[:10]
        slug = re.sub(r"[^A-Za-z0-9]+", "-", where).strip("-")[-40:]
        return self.cache_dir / f"{slug}-{key}" / self.kind

    @staticmethod
    def _holds(folder: Path, manifest: dict) -> bool:
        """`folder` is a finished download of exactly this commit (sizes re-checked; hashes were on arrival)."""
        try:
            if json.loads((folder / MANIFEST).read_bytes()) != manifest:
                return False
            return all((folder / rel).stat().st_size == spec["size"] for rel, spec in manifest["files"].items())
        except (OSError, ValueError):
            return False

    def _download(self, op: str, number: int, dest) -> Path:
        number = self._check_number(number)
        url = self._url_of(number)
        with self._errors(op, url):
            manifest, raw = self._read_manifest(op, number)
            # The default place is keyed by commit: a bucket wiped and reused never serves an old cache.
            final = (
                Path(dest).expanduser().absolute()
                if dest is not None
                else (self._cache_root() / f"{self._name(number)}.{manifest['commit']}")
            )
            if final.exists():
                if self._holds(final, manifest):
                    return final
                if dest is not None and (not final.is_dir() or any(final.iterdir())):
                    raise BucketError(f"{op} {redact(url)}: {final} exists and holds something else")
                if dest is None:  # a damaged cache entry: move it out of the way, then fetch afresh
                    trash = final.with_name(f".{final.name}.trash-{uuid.uuid4().hex[:8]}")
                    with contextlib.suppress(FileNotFoundError):
                        final.rename(trash)
                    shutil.rmtree(trash, ignore_errors=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            self._sweep_staging(final.parent)
            # Each process downloads into its own staging folder and renames it into place, so nobody
            # ever sees half a folder and concurrent fetches of one version need no lock.
            staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.part-", dir=final.parent))
            try:
                for rel, spec in manifest["files"].items():
                    local = staging / rel
                    local.parent.mkdir(parents=True, exist_ok=True)
                    remote = self._path(number, manifest["commit"], rel)
                    try:
                        self._retry(op, url, f"download {rel}", self._fs.get_file, remote, str(local))
                    except Exception as exc:
                        if not is_missing(exc):
                            raise
                        if self._read_or_none(op, url, self._path(number, MANIFEST)) is None:
                            raise VersionNotFound(f"{op} {redact(url)}: collected while being fetched") from None
                        raise IntegrityError(f"{op} {redact(url)}: {rel} is listed in {MANIFEST} but missing") from None
                    size, digest = _hash_file(local)
                    if size != spec["size"] or digest != spec["sha256"]:
                        what = f"size {size} != {spec['size']}" if size != spec["size"] else "sha256 mismatch"
                        raise IntegrityError(f"{op} {redact(url)}: {rel} does not match its manifest ({what})")
                (staging / MANIFEST).write_bytes(raw)
                try:
                    os.rename(staging, final)
                except OSError as exc:
                    # Another process renamed its copy first; theirs is as good as ours.
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not self._holds(final, manifest):
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return final

    @staticmethod
    def _sweep_staging(folder: Path) -> None:
        cutoff = time.time() - _STALE_STAGING_S
        for path in folder.glob(".*.part-*"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True)

    def _gc(self, op: str, keep: int) -> list[int]:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        committed, present = self._scan(op)
        ordered = sorted(committed, reverse=True)
        doomed = ordered[keep:]
        for number in doomed:
            url = self._url_of(number)
            with self._errors(op, url):
                # Manifest first: from this moment no reader starts on it, and fetches under way
                # notice the missing files and report the version as collected, not corrupt.
                self._remove(op, url, self._path(number, MANIFEST), recursive=False)
                self._remove(op, url, self._path(number), recursive=True)
        # Uploads that never committed (a publisher died or lost a race), older than anything kept;
        # newer ones may be a publish in progress.
        kept = ordered[:keep]
        for number in sorted(present - committed):
            if kept and number < kept[-1]:
                url = self._url_of(number)
                with self._errors(op, url):
                    self._remove(op, url, self._path(number), recursive=True)
        return doomed

    def _prune_cache(self, keep: int) -> list[Path]:
        root = self._cache_root()
        entries: dict[int, list[Path]] = {}
        for path in root.glob("*.*") if root.is_dir() else ():
            name, _, commit = path.name.rpartition(".")
            number = self._parse_name(name)
            if number is not None and _COMMIT.fullmatch(commit):
                entries.setdefault(number, []).append(path)
        removed = []
        for number in sorted(entries, reverse=True)[keep:]:
            for path in entries[number]:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed


class AdapterStore(_CommittedStore):
    """LoRA adapter versions `adapters/policy-v{N}/`: the learner publishes, every replica fetches."""

    kind, noun = "adapters", "version"

    def _name(self, number: int) -> str:
        return adapter_name(number)

    def publish(self, local_dir, version: int) -> dict:
        """Upload a PEFT adapter folder as `policy-v{version}` and commit it; returns the manifest.

        Raises VersionExists when that version is already committed (by anyone, including a racer)."""
        local_dir = Path(local_dir)
        self._check_number(version)
        try:
            peft = json.loads((local_dir / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise BucketError(
                f"publish {local_dir}: no readable adapter_config.json (not a PEFT folder): {exc}"
            ) from None
        files = _files_of_dir(local_dir)
        if not any(w in files for w in ADAPTER_WEIGHTS):
            raise BucketError(f"publish {local_dir}: no {' or '.join(ADAPTER_WEIGHTS)}")
        targets = peft.get("target_modules")
        extra = {
            "base_model": peft.get("base_model_name_or_path"),
            "lora_rank": peft.get("r"),
            "lora_alpha": peft.get("lora_alpha"),
            "target_modules": sorted(targets) if isinstance(targets, list | tuple | set) else targets,
            "peft_type": peft.get("peft_type"),
        }
        return self._commit("publish", version, files, extra)

    def versions(self) -> list[int]:
        """Committed versions, newest first, listed afresh on every call."""
        return self._committed("versions")

    def latest(self) -> int | None:
        committed = self.versions()
        return committed[0] if committed else None

    def fetch(self, version: int, dest=None) -> Path:
        """A local folder holding the verified adapter (default: the cache); idempotent, safe across processes.

        Raises VersionNotFound when not committed, IntegrityError on a size or sha256 mismatch."""
        return self._download("fetch", version, dest)

    def gc(self, keep: int) -> list[int]:
        """Remove committed versions older than the newest `keep` (manifest first); returns them, newest first."""
        return self._gc("gc", keep)

    def prune_cache(self, keep: int) -> list[Path]:
        """Remove this bucket's cached folders of all but the newest `keep` versions (a replica's disk)."""
        return self._prune_cache(keep)

    def url_of(self, version: int) -> str:
        """The full URL of that version's folder."""
        return self._url_of(version)

    def resolve(self, ref: str) -> int:
        """The version a reference names: `policy-v3`, `adapters/policy-v3` or this bucket's URL of it.

        Anything else (another spelling, a path outside this bucket's prefix, `..`) is InvalidName."""
        bad = InvalidName(f"adapter reference {redact(str(ref))!r}: expected policy-v<N> inside {redact(self.url)}")
        if not isinstance(ref, str) or "\\" in ref or "\x00" in ref:
            raise bad
        if "://" in ref:
            scheme, _, rest = ref.partition("://")
            if scheme != self._scheme:
                raise bad
            if self._local and not rest.startswith("/"):
                rest = os.path.join(os.getcwd(), rest)
            prefix = f"{self._root}/{self.kind}/"
        else:
            rest, prefix = ref, f"{self.kind}/"
        if rest.startswith(prefix):
            rest = rest[len(prefix) :]
        elif "://" in ref or "/" in rest.rstrip("/"):
            raise bad
        number = self._parse_name(rest[:-1] if rest.endswith("/") else rest)
        if number is None:
            raise bad
        return number


class CheckpointStore(_CommittedStore):
    """Learner checkpoints `checkpoints/step-{S}/` (adapter, optimizer, scheduler, RNG, cursors), same rule."""

    kind, noun = "checkpoints", "step"

    def _name(self, number: int) -> str:
        return f"step-{number}"

    def save(self, step: int, files_or_dir, meta: dict | None = None) -> dict:
        """Upload a folder, or {relative_name: local path or bytes}, as `step-{step}` and commit it.

        `meta` (JSON) goes into the manifest, e.g. policy version and data cursor for a quick look."""
        if isinstance(files_or_dir, Mapping):
            sources: dict[str, Path | bytes] = {}
            for rel, value in files_or_dir.items():
                if isinstance(value, bytes | bytearray | memoryview):
                    sources[rel] = bytes(value)
                elif Path(value).is_file():
                    sources[rel] = Path(value)
                else:
                    raise BucketError(f"save step-{step}: {rel}: {value} is not a file")
            if not sources:
                raise BucketError(f"save step-{step}: nothing to save")
        else:
            sources = _files_of_dir(Path(files_or_dir))
        return self._commit("save", step, sources, {"meta": meta or {}})

    def steps(self) -> list[int]:
        """Committed steps, newest first, listed afresh on every call."""
        return self._committed("steps")

    def latest(self) -> int | None:
        committed = self.steps()
        return committed[0] if committed else None

    def load(self, step: int, dest=None) -> Path:
        """A local folder holding the verified checkpoint; `dest` must be absent, empty, or this checkpoint."""
        return self._download("load", step, dest)

    def manifest(self, step: int) -> dict:
        """The committed manifest of a step (its files and `meta`), without downloading the files."""
        with self._errors("manifest", self._url_of(step)):
            return self._read_manifest("manifest", self._check_number(step))[0]

    def gc(self, keep: int) -> list[int]:
        """Remove committed steps older than the newest `keep` (manifest first); returns them, newest first."""
        return self._gc("gc", keep)

    def url_of(self, step: int) -> str:
        return self._url_of(step)


class RunRecords:
    """The runs registered on a shared fleet (`deployments.control.runs`), one small JSON each at
    `<bucket>/runs/<name>/RUN.json`.

    What lets an ingress that restarts (its node lost, the application redeployed) know its runs again:
    the registry otherwise lives in its memory alone. A record holds the run's name and what the fleet keeps
    of its registration (its token's sha256, never the token; its weight, window and rank). Written whole and
    removed whole; the newest write of a name wins.
    """

    FILE = "RUN.json"

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None, backoff: Backoff):
        self.url = url
        self._fs, self._root = make_filesystem(url, endpoint_url=endpoint_url, region=region)
        self._backoff = backoff

    @classmethod
    def from_config(cls, cfg, url: str) -> RunRecords:
        b = cfg.bucket
        backoff = Backoff(attempts=b.max_attempts, first_s=b.backoff_s)
        return cls(url, endpoint_url=b.endpoint_url, region=b.region, backoff=backoff)

    def __repr__(self) -> str:
        return f"RunRecords({redact(self.url)!r})"

    def _path(self, name: str) -> str:
        return f"{self._root}/runs/{name}/{self.FILE}"

    def _retry(self, op: str, fn, *args):
        try:
            return retry(lambda: fn(*args), self._backoff, is_transient)
        except Exception as exc:
            if is_missing(exc):
                raise
            raise BucketError(f"{op} {redact(self.url)}: {describe_error(exc)}") from None

    def load(self) -> dict[str, dict]:
        """{run name: its record} of every record."""
        try:
            paths = self._retry("list runs", self._fs.glob, f"{self._root}/runs/*/{self.FILE}")
        except Exception as exc:
            if is_missing(exc):
                return {}
            raise
        records = {}
        for path in sorted(paths):
            record = json.loads(self._retry("read run", self._fs.cat_file, path))
            records[record.pop("name")] = record
        return records

    def save(self, name: str, record: dict) -> None:
        """Record run `name` (`record`: what the fleet keeps of its registration, JSON)."""
        record = {"name": name, **record, "registered_unix": time.time()}
        self._retry("record run", self._fs.pipe_file, self._path(name), json.dumps(record).encode())

    def delete(self, name: str) -> None:
        try:
            self._retry("forget run", self._fs.rm, self._path(name))
        except Exception as exc:
            if not is_missing(exc):
                raise
