"""The run's two stores in the bucket: adapter versions and learner checkpoints.

`AdapterStore` holds `adapters/policy-v{N}/` (the learner publishes, every replica fetches), `EmaAdapterStore` the
run's second lineage beside it, `adapters/ema-v{N}/` (the average an `ema` self teacher scores with),
`CheckpointStore` holds `checkpoints/step-{S}/`; both follow the commit protocol of
`core.bucket.committed` (a folder exists only once its manifest is committed, readers verify every file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from contracts.adapters import EMA_STEM, POLICY_STEM, AdapterRef
from contracts.auth import redact
from core.bucket.committed import CommittedStore
from core.bucket.fetching import HeldFolder, cache_usage, drop_cached, fetch_verified, hold, prune_cached
from core.bucket.filesystem import BucketError, InvalidName, NotSigned
from core.bucket.manifest import ADAPTER_WEIGHTS, files_of_dir


class AdapterStore(CommittedStore):
    """LoRA adapter versions `adapters/policy-v{N}/`: the learner publishes, every replica fetches."""

    kind, noun = "adapters", "version"
    stem = POLICY_STEM  # the lineage's stem: its versions are `<stem>-v<N>`, the other stems' are not listed

    def _name(self, number: int) -> str:
        return AdapterRef(number, stem=self.stem).key

    def key_of(self, version: int) -> str:
        """A version's folder name in this lineage: `policy-v3` (or `ema-v3`)."""
        return self._name(version)

    def publish(self, local_dir, version: int) -> dict:
        """Upload a PEFT adapter folder as `<stem>-v{version}` and commit it; returns the manifest.

        Raises VersionExists when that version is already committed (by anyone, including a racer)."""
        local_dir = Path(local_dir)
        self._check_number(version)
        try:
            peft = json.loads((local_dir / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise BucketError(
                f"publish {local_dir}: no readable adapter_config.json (not a PEFT folder): {exc}"
            ) from None
        files = files_of_dir(local_dir)
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
        """Committed versions, newest first, listed afresh on every call (signed or not: see `signed`)."""
        return self._committed("versions")

    def signed(self, version: int) -> bool:
        """Whether committed `version` is signed with this store's key: this lineage's own, not one planted in its
        prefix by another writer of the bucket."""
        with self._errors("signed", self._url_of(version)):
            try:
                self._read_manifest("signed", self._check_number(version))
            except NotSigned:
                return False
        return True

    def latest(self) -> int | None:
        committed = self.versions()
        return committed[0] if committed else None

    def fetch(self, version: int, dest=None) -> Path:
        """A local folder holding the verified adapter (default: the cache); idempotent, safe across processes.

        Raises VersionNotFound when not committed, IntegrityError on a size or sha256 mismatch."""
        return fetch_verified(self, "fetch", version, dest)

    def fetch_held(self, version: int, attempts: int = 3) -> HeldFolder:
        """`fetch` into the cache, the folder held in use until released (`core.bucket.fetching.hold`): what a replica
        serves from, and no prune of this machine deletes meanwhile. Fetched again if pruned before it was held."""
        for _ in range(attempts):
            path = self.fetch(version)
            fd = hold(path)
            if fd is not None:
                return HeldFolder(path, fd)
        raise BucketError(f"fetch {redact(self.url_of(version))}: pruned from the cache {attempts} times as it arrived")

    def gc(self, keep: int) -> list[int]:
        """Remove committed versions older than the newest `keep` (manifest first); returns them, newest first."""
        return self._gc("gc", keep)

    def prune_cache(self, keep: int) -> list[Path]:
        """Remove this bucket's cached folders (a replica's disk) but those a process of the machine holds
        (`fetch_held`) and the newest `keep` others; the folders removed."""
        return prune_cached(self, keep)

    def drop_cache(self) -> bool:
        """Delete every cached folder of this prefix that no process of the machine holds; whether none is left."""
        return drop_cached(self)

    def cache_usage(self) -> tuple[int, int]:
        """(folders, bytes) of this prefix's cached versions on this machine."""
        return cache_usage(self)

    def url_of(self, version: int) -> str:
        """The full URL of that version's folder."""
        return self._url_of(version)

    def resolve(self, ref: str) -> int:
        """The version a reference names: `policy-v3`, `adapters/policy-v3` or this bucket's URL of it (`ema-v3`...
        for the ema lineage's store).

        Anything else (another spelling, a path outside this bucket's prefix, `..`) is InvalidName."""
        bad = InvalidName(
            f"adapter reference {redact(str(ref))!r}: expected {self.stem}-v<N> inside {redact(self.url)}"
        )
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


class EmaAdapterStore(AdapterStore):
    """The run's ema lineage, `adapters/ema-v{N}/` beside its policy versions: the learner's exponential average of
    them, which an `ema` self teacher scores with; committed, signed and verified as the policy's are."""

    stem = EMA_STEM


def adapter_store(stem: str) -> type[AdapterStore]:
    """The store class of a lineage's stem (`policy`, `ema`)."""
    return EmaAdapterStore if stem == EMA_STEM else AdapterStore


class CheckpointStore(CommittedStore):
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
            sources = files_of_dir(Path(files_or_dir))
        return self._commit("save", step, sources, {"meta": meta or {}})

    def steps(self) -> list[int]:
        """Committed steps, newest first, listed afresh on every call."""
        return self._committed("steps")

    def latest(self) -> int | None:
        committed = self.steps()
        return committed[0] if committed else None

    def load(self, step: int, dest=None) -> Path:
        """A local folder holding the verified checkpoint; `dest` must be absent, empty, or this checkpoint."""
        return fetch_verified(self, "load", step, dest)

    def manifest(self, step: int) -> dict:
        """The committed manifest of a step (its files and `meta`), without downloading the files."""
        with self._errors("manifest", self._url_of(step)):
            return self._read_manifest("manifest", self._check_number(step))[0]

    def gc(self, keep: int) -> list[int]:
        """Remove committed steps older than the newest `keep` (manifest first); returns them, newest first."""
        return self._gc("gc", keep)

    def url_of(self, step: int) -> str:
        return self._url_of(step)
