"""Download links for exported weights (`save_weights_external`): signed URLs that the SDK fetches without its key.

Tinker hands out one signed URL per file of an export (`RestClient.get_external_weights_urls`), and the SDK's
`tinker checkpoint download` fetches each with a plain `urllib` GET, no API key. Here such a URL points back at this
service (`GET /api/v1/exported/<token>/<file>`): the token names the export's store and number and when the link
expires, signed with a key of the service (HMAC-SHA256; derived from the admin token, so every replica of the service,
and one started again, accepts the links of the others). A signature only says what a link was given for: at each
download the export's record, as its owner's prefix holds it now (`core.bucket.tinker_paths`), must still name the
same number, and, for a link given to another key, still be published; so a link stops working the moment its export
is deleted, expires or is unpublished, or once the admin revokes the key it was given to, and never reaches the
export that came after it. A download fetches the export once from the bucket, checked
against its manifest (`core.bucket.CheckpointStore.load`), into a local cache that the upkeep empties of copies older
than a link's lifetime, and serves files from there.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from contracts.auth import Secret
from contracts.tinker import EXPORTS_PREFIX

LINK_TTL_S = 3600.0  # how long a download link works (the SDK signs again when one is about to expire)


class LinkRefused(Exception):
    """A download link that is malformed, forged or expired."""


class LinkGone(Exception):
    """A download link whose export is no longer there for its holder: deleted, expired, replaced or unpublished."""


@dataclass(frozen=True)
class Link:
    """What a download link was signed for: export `number`, recorded as `path` in the owner's `prefix`, handed to the
    owner itself (`owner`) or to another key (which reaches it only while it is published), that key being run
    `holder`'s (the link ends when the admin revokes it)."""

    prefix: str
    path: str
    number: int
    owner: bool
    holder: str

    @property
    def store_url(self) -> str:
        return f"{self.prefix}/{EXPORTS_PREFIX}"


class ExportLinks:
    """Signs and checks download links, and serves an export's files from a verified local copy."""

    def __init__(self, admin_token: Secret | None, cache_dir: str | os.PathLike):
        seed = admin_token.value.encode() if admin_token is not None else os.urandom(32)
        self._key = hashlib.sha256(b"spotrl-tinker-export-links\0" + seed).digest()
        self.cache = Path(cache_dir).expanduser() / "tinker-exports"
        self._locks: dict[str, asyncio.Lock] = {}

    # ---- links ------------------------------------------------------------------------------------------

    def sign(self, link: Link, expires: float) -> str:
        """A token for `link`, valid until `expires` (epoch seconds)."""
        fields = [link.prefix, link.path, link.number, link.owner, link.holder, expires]
        payload = base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")
        return f"{payload}.{self._mac(payload)}"

    def check(self, token: str) -> Link:
        """The link a token was signed for; `LinkRefused` for a forged, malformed or expired one."""
        payload, _, mac = token.partition(".")
        if not mac or not hmac.compare_digest(mac, self._mac(payload)):
            raise LinkRefused("this download link is not one of this service's")
        try:
            prefix, path, number, owner, holder, expires = json.loads(
                base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
            )
        except ValueError:  # signed by this service for another shape of link (before an upgrade)
            raise LinkRefused("this download link is of an older form; ask for new ones") from None
        if expires <= time.time():
            raise LinkRefused("this download link has expired; ask for new ones (get_external_weights_urls)")
        return Link(prefix, path, int(number), bool(owner), str(holder))

    @staticmethod
    def still_there(link: Link) -> None:
        """`LinkGone` unless the owner's record of the link's path still names its export, and, for a link handed to
        another key, is still published (blocking: run it in a thread)."""
        from core.bucket.tinker_paths import own_record, record_kind

        record = own_record(link.prefix, link.path)
        if record is None or record_kind(record) != "external" or int(record["number"]) != link.number:
            raise LinkGone("the export this link was given for was deleted, expired or replaced")
        if not link.owner and not record.get("public"):
            raise LinkGone("the export this link was given for is no longer published")

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    # ---- files ------------------------------------------------------------------------------------------

    def files(self, store_url: str, number: int) -> dict[str, int]:
        """The export's files and their sizes, from its manifest (blocking: run it in a thread)."""
        from core.bucket.store import CheckpointStore

        manifest = CheckpointStore(store_url, cache_dir=self.cache).manifest(number)
        return {rel: spec["size"] for rel, spec in manifest["files"].items()}

    async def local_file(self, store_url: str, number: int, rel: str) -> Path | None:
        """A verified local copy of file `rel` of the export; None when the export has no such file."""
        folder = self.cache / hashlib.sha256(f"{store_url}\0{number}".encode()).hexdigest()[:32]
        lock = self._locks.setdefault(folder.name, asyncio.Lock())
        async with lock:  # one download of a folder at a time; the next request finds it there
            if not (folder / ".complete").exists():
                await asyncio.to_thread(self._fetch, store_url, number, folder)
        target = (folder / rel).resolve()
        if target.name == ".complete" or not target.is_relative_to(folder.resolve()) or not target.is_file():
            return None
        return target

    def _fetch(self, store_url: str, number: int, folder: Path) -> None:
        from core.bucket.store import CheckpointStore

        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        CheckpointStore(store_url, cache_dir=self.cache).load(number, folder)
        (folder / ".complete").touch()

    def prune(self) -> None:
        """Drop local copies fetched longer ago than a link lives: the links that fetched them have expired."""
        if not self.cache.is_dir():
            return
        for folder in self.cache.iterdir():
            marker = folder / ".complete"
            if marker.exists() and marker.stat().st_mtime < time.time() - LINK_TTL_S:
                shutil.rmtree(folder, ignore_errors=True)
                self._locks.pop(folder.name, None)
