"""What a committed folder's manifest is: the files it lists, their sizes and sha256, checked names.

The manifest is the commit point of every folder in the bucket (`core.bucket.committed`); a reader trusts
nothing it does not list and checksum (`core.bucket.fetching`). An adapter version's manifest is also signed with
its lineage's key (`contracts.auth.lineage_key`): sizes and sha256 of every file under an HMAC, so the signature
covers the weights.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path

from core.bucket.filesystem import BucketError, InvalidName

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "spotrl-manifest/1"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
HEX64 = re.compile(r"[0-9a-f]{64}")
COMMIT = re.compile(r"[0-9a-f]{12}")


def hash_file(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return f.tell(), digest


def check_relative(name: str) -> str:
    """A file name inside a version folder: relative, POSIX, no traversal, not the manifest itself."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if not name or "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts) or name == MANIFEST:
        raise InvalidName(f"file name {name!r}: must be a relative path without empty, . or .. parts")
    return name


def files_of_dir(local_dir: Path) -> dict[str, Path]:
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
    for rel, path in files_of_dir(Path(local_dir)).items():
        digest.update(f"{rel}\0{hash_file(path)[1]}\0".encode())
    return digest.hexdigest()


SIGNATURE = "signature"


def manifest_signature(manifest: dict, key: str) -> str:
    """HMAC-SHA256 under `key` (hex) of the manifest without its signature, as canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(bytes.fromhex(key), canonical, hashlib.sha256).hexdigest()


def signed_by(manifest: dict, key: str) -> bool:
    """Whether `manifest` carries a signature under `key`."""
    signature = manifest.get(SIGNATURE)
    return isinstance(signature, str) and hmac.compare_digest(signature, manifest_signature(manifest, key))
