"""The registrations of a shared fleet's runs, kept in its bucket so that they outlive the ingress.

The registry itself lives in the ingress's memory (`deployments.control.runs`); these records let an ingress that
restarts (its node lost, the application redeployed) know its runs, and their tokens, again.
"""

from __future__ import annotations

import json
import time

from contracts.adapters import RECORDS_PREFIX
from contracts.auth import redact
from contracts.retry import Backoff, retry
from core.bucket.filesystem import BucketError, describe_error, is_missing, is_transient, make_filesystem


class RunRecords:
    """The runs registered on a shared fleet (`deployments.control.runs`), one small JSON each under `<bucket>/fleet/runs/`.

    The records lie outside every run's prefix (`contracts.adapters.RECORDS_PREFIX`): a run may write its own
    prefix, and must not be able to rewrite its weight or register runs by planting a record. What lets an ingress that restarts (its node lost, the application redeployed) know its runs again:
    the registry otherwise lives in its memory alone. A record holds the run's name and what the fleet keeps
    of its registration (its token's sha256, never the token; its weight, window and rank). Written whole and
    removed whole; the newest write of a name wins.
    """

    FILE = "RUN.json"

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None, backoff: Backoff):
        self.url = url  # the fleet's bucket; the records lie under its `fleet/` prefix
        self._fs, root = make_filesystem(url, endpoint_url=endpoint_url, region=region)
        self._records = f"{root.rstrip('/')}/{RECORDS_PREFIX}/runs"
        self._backoff = backoff

    @classmethod
    def from_config(cls, cfg, url: str) -> RunRecords:
        b = cfg.bucket
        backoff = Backoff(attempts=b.max_attempts, first_s=b.backoff_s)
        return cls(url, endpoint_url=b.endpoint_url, region=b.region, backoff=backoff)

    def __repr__(self) -> str:
        return f"RunRecords({redact(self.url)!r})"

    def _path(self, name: str) -> str:
        return f"{self._records}/{name}/{self.FILE}"

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
            paths = self._retry("list runs", self._fs.glob, f"{self._records}/*/{self.FILE}")
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
