"""Small JSON records kept in a bucket, and the registrations of a shared fleet's runs among them.

`JsonRecords` is a folder of small JSON objects, each written whole and removed whole, every call retried while the
bucket's errors are transient: what a service keeps in the bucket so that it outlives the process (the Tinker API's
paths, `app.learner.tinker_learner`). `RunRecords` are the shared fleet's: the registry itself lives in the
ingress's memory (`deployments.control.runs`); these records let an ingress that restarts (its node lost, the
application redeployed) know its runs, and their tokens, again.
"""

from __future__ import annotations

import json
import time

from contracts.adapters import RECORDS_PREFIX
from contracts.auth import redact
from contracts.retry import Backoff, retry
from core.bucket.filesystem import BucketError, describe_error, is_missing, is_transient, make_filesystem


class JsonRecords:
    """JSON records under `folder` of the bucket at `url`, one object per name (`layout`: its path in the folder)."""

    def __init__(
        self,
        url: str,
        folder: str,
        *,
        layout: str = "{name}.json",
        endpoint_url: str | None = None,
        region: str | None = None,
        backoff: Backoff,
    ):
        self.url = url
        self._fs, root = make_filesystem(url, endpoint_url=endpoint_url, region=region)
        self._folder = f"{root.rstrip('/')}/{folder}"
        self._layout = layout
        self._backoff = backoff

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"

    def _path(self, name: str) -> str:
        return f"{self._folder}/{self._layout.format(name=name)}"

    def _retry(self, op: str, fn, *args):
        try:
            return retry(lambda: fn(*args), self._backoff, is_transient)
        except Exception as exc:
            if is_missing(exc):
                raise
            raise BucketError(f"{op} {redact(self.url)}: {describe_error(exc)}") from None

    def all(self) -> list[dict]:
        """Every record (none when the folder does not exist)."""
        try:
            paths = self._retry("list records", self._fs.glob, self._path("*"))
        except Exception as exc:
            if is_missing(exc):
                return []
            raise
        return [json.loads(self._retry("read record", self._fs.cat_file, path)) for path in sorted(paths)]

    def get(self, name: str) -> dict | None:
        """Record `name`, or None when there is none."""
        try:
            return json.loads(self._retry("read record", self._fs.cat_file, self._path(name)))
        except Exception as exc:
            if is_missing(exc):
                return None
            raise

    def put(self, name: str, record: dict) -> None:
        """Write record `name` whole (the newest write of a name wins)."""
        self._retry("write record", self._fs.pipe_file, self._path(name), json.dumps(record).encode())

    def delete(self, name: str) -> None:
        """Remove record `name` (none there is no error: S3 does not say whether there was one)."""
        try:
            self._retry("remove record", self._fs.rm, self._path(name))
        except Exception as exc:
            if not is_missing(exc):
                raise


class RunRecords(JsonRecords):
    """The runs registered on a shared fleet (`deployments.control.runs`), one small JSON each under `<bucket>/fleet/runs/`.

    The records lie outside every run's prefix (`contracts.adapters.RECORDS_PREFIX`): a run may write its own
    prefix, and must not be able to rewrite its weight or register runs by planting a record. A record holds the
    run's name and what the fleet keeps of its registration (its token's sha256, never the token; its weight, window
    and rank).
    """

    FILE = "RUN.json"

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None, backoff: Backoff):
        # url: the fleet's bucket; the records lie under its `fleet/` prefix
        super().__init__(
            url,
            f"{RECORDS_PREFIX}/runs",
            layout="{name}/" + self.FILE,
            endpoint_url=endpoint_url,
            region=region,
            backoff=backoff,
        )

    @classmethod
    def from_config(cls, cfg, url: str) -> RunRecords:
        b = cfg.bucket
        backoff = Backoff(attempts=b.max_attempts, first_s=b.backoff_s)
        return cls(url, endpoint_url=b.endpoint_url, region=b.region, backoff=backoff)

    def load(self) -> dict[str, dict]:
        """{run name: its record} of every record."""
        return {record.pop("name"): record for record in self.all()}

    def save(self, name: str, record: dict) -> None:
        """Record run `name` (`record`: what the fleet keeps of its registration, JSON)."""
        self.put(name, {"name": name, **record, "registered_unix": time.time()})
