"""Where each cloud says that a machine goes: the metadata services, a scheduler's file, Ray's own drain.

The metadata services are reached where the clouds' own SDKs reach them, honouring their variables:
`AWS_EC2_METADATA_SERVICE_ENDPOINT` (botocore's, a URL; `AWS_EC2_METADATA_DISABLED=true` turns AWS off)
and `GCE_METADATA_HOST` (google-auth's, host:port), so tests point them at a fake server on 127.0.0.1.
Whether they are asked at all is `spot.metadata` (`metadata_clouds`): by default only on a node that is a cloud
instance, judged without network, so that a laptop's run sends nothing to 169.254.169.254.
IMDSv2 first (a session token, then GETs that carry it); where the instance offers no tokens, IMDSv1 (plain GETs).
Each source answers `probe` (is it here at all: off a cloud the first short probe finds nothing) and `poll` (a
`contracts.notices.Notice`, or None); `contracts.notice_watcher` asks them.
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.notices import GCP_MAINTENANCE_S, GCP_NOTICE_S, Notice

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("spotrl.notices")

AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
AWS_DISABLED_ENV = "AWS_EC2_METADATA_DISABLED"
GCE_HOST_ENV = "GCE_METADATA_HOST"
METADATA_IP = "169.254.169.254"  # both clouds' default, when their variable is not set
AWS, GCP = "aws", "gcp"
# The machine's firmware strings, which name the cloud on its instances: "Amazon EC2" (sys_vendor, bios_vendor on
# Nitro), "4.11.amazon" (bios_version on Xen), "Google" / "Google Compute Engine" (google-auth's own check reads
# product_name). Readable without root and without network.
DMI_DIR = Path("/sys/class/dmi/id")
DMI_FILES = ("sys_vendor", "bios_vendor", "bios_version", "product_name")
AWS_TOKEN_TTL_S = 21600
# The token answers that mean this instance offers no IMDSv2 (botocore's reading too): then IMDSv1. Any other failure
# (throttling, a server error) is asked again at the next poll.
IMDSV2_UNAVAILABLE = (403, 404, 405)


class MetadataError(RuntimeError):
    """A metadata service answered, but not with what was asked (a throttled or failing token request)."""


def _parse_utc(stamp: str) -> float:
    """`2026-12-02T08:22:00Z` as unix seconds."""
    return float(calendar.timegm(time.strptime(stamp.replace(".000", ""), "%Y-%m-%dT%H:%M:%SZ")))


class AwsMetadata:
    """EC2's instance metadata service: `spot/instance-action` and the rebalance recommendation."""

    name = AWS

    def __init__(self, endpoint: str | None = None, timeout_s: float = 1.0):
        import httpx  # here, not at import: the learner imports this module where only its constants are needed

        self.endpoint = (endpoint or os.environ.get(AWS_ENDPOINT_ENV) or f"http://{METADATA_IP}").rstrip("/")
        self._client = httpx.Client(base_url=self.endpoint, timeout=timeout_s, trust_env=False)
        self._token: str | None = None
        self._token_until = 0.0
        self._v1 = False  # IMDSv2 is not offered here: plain GETs (IMDSv1)

    def _headers(self) -> dict[str, str]:
        if self._v1:
            return {}
        if self._token is None or time.monotonic() > self._token_until:
            r = self._client.put(
                "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
            )
            if r.status_code in IMDSV2_UNAVAILABLE:
                log.warning(
                    "spot: %s offers no IMDSv2 session tokens (%d): reading IMDSv1", self.endpoint, r.status_code
                )
                self._v1 = True
                return {}
            if r.status_code != 200:  # throttled (429), a server error: no token this time, asked again next time
                raise MetadataError(f"{self.endpoint}: IMDSv2 token request answered {r.status_code}")
            self._token, self._token_until = r.text, time.monotonic() + AWS_TOKEN_TTL_S / 2
        return {"X-aws-ec2-metadata-token": self._token}

    def _get(self, path: str) -> httpx.Response:
        r = self._client.get(f"/latest/meta-data/{path}", headers=self._headers())
        if r.status_code == 401:
            # With a token: it expired early. Without one: the instance wants IMDSv2 after all. Either way a
            # fresh token, once.
            if self._v1:
                log.warning("spot: %s wants IMDSv2 session tokens after all", self.endpoint)
            self._token, self._v1 = None, False
            r = self._client.get(f"/latest/meta-data/{path}", headers=self._headers())
        return r

    def probe(self) -> bool:
        return self._get("instance-id").status_code == 200

    def poll(self) -> Notice | None:
        action = self._get("spot/instance-action")
        if action.status_code == 200:
            body = action.json()
            return Notice("aws", _parse_utc(body["time"]), f"spot {body.get('action', 'terminate')}")
        rebalance = self._get("events/recommendations/rebalance")
        if rebalance.status_code == 200:
            return Notice("aws-rebalance", None, f"rebalance recommended at {rebalance.json().get('noticeTime')}")
        return None

    def close(self) -> None:
        self._client.close()


class GcpMetadata:
    """GCE's metadata server: `instance/preempted` and `instance/maintenance-event`."""

    name = GCP

    def __init__(self, host: str | None = None, timeout_s: float = 1.0, interval_s: float = 5.0):
        import httpx

        self.host = host or os.environ.get(GCE_HOST_ENV) or METADATA_IP
        self._client = httpx.Client(
            base_url=f"http://{self.host}/computeMetadata/v1",
            headers={"Metadata-Flavor": "Google"},
            timeout=timeout_s,
            trust_env=False,
        )
        self.interval_s = interval_s  # how often it is polled: how late a notice may be seen
        self._clear_at: float | None = None  # when the last poll that saw no notice was sent

    def _get(self, path: str) -> str | None:
        r = self._client.get(f"/{path}")
        # A server that is no GCE metadata server (EC2's, say) does not answer with Google's flavor header.
        return r.text.strip() if r.status_code == 200 and r.headers.get("metadata-flavor") == "Google" else None

    def probe(self) -> bool:
        return self._get("instance/id") is not None

    def poll(self) -> Notice | None:
        """GCP says neither when the notice came nor when the VM goes: the notice came after the last poll that saw
        none, so its deadline is counted from that poll (from one interval ago at the first), never from now."""
        sent = time.time()
        since = self._clear_at if self._clear_at is not None else sent - self.interval_s
        if self._get("instance/preempted") == "TRUE":
            return Notice("gcp", since + GCP_NOTICE_S, "preempted")
        event = self._get("instance/maintenance-event")
        if event and event.startswith("TERMINATE"):  # MIGRATE_ON_HOST_MAINTENANCE moves the VM live: no notice
            return Notice("gcp-maintenance", since + GCP_MAINTENANCE_S, event)
        self._clear_at = sent
        return None

    def close(self) -> None:
        self._client.close()


class NoticeFile:
    """A file a scheduler writes when the machine is to go: empty, or JSON with `deadline` (unix) or `in_s`."""

    name = "file"

    def __init__(self, path: str | os.PathLike, default_grace_s: float):
        self.path, self.default_grace_s = Path(path).expanduser(), default_grace_s

    def probe(self) -> bool:
        return True  # a file may appear at any time: always asked

    def poll(self) -> Notice | None:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        try:
            spec = json.loads(text) if text else {}
        except ValueError:
            spec = {}
        spec = spec if isinstance(spec, dict) else {}
        if isinstance(spec.get("deadline"), int | float):
            deadline = float(spec["deadline"])
        else:
            in_s = spec.get("in_s")
            deadline = time.time() + (float(in_s) if isinstance(in_s, int | float) else self.default_grace_s)
        return Notice("file", deadline, str(self.path))

    def close(self) -> None:
        pass


class RayDrain:
    """Ray's own word that this process's node is draining: whoever drained it (Ray's SIGTERM handler on `ray start`,
    a watcher of another process on the node, an operator's `ray drain-node`), the roles on it act as on a notice.
    Asked only inside a Ray worker or driver (`probe`); a drain without a deadline is given `default_grace_s`."""

    name = "ray-drain"

    def __init__(self, default_grace_s: float = GCP_NOTICE_S):
        self.default_grace_s = default_grace_s

    def probe(self) -> bool:
        import sys

        if "ray" not in sys.modules:  # a process without Ray has no Ray node to drain
            return False
        import ray

        return ray.is_initialized()

    def poll(self) -> Notice | None:
        import ray
        from ray._private.worker import global_worker

        node_id = ray.get_runtime_context().get_node_id()
        deadline_ms = global_worker.gcs_client.get_draining_nodes().get(node_id)
        if deadline_ms is None:
            return None
        deadline = deadline_ms / 1000 if deadline_ms else time.time() + self.default_grace_s
        return Notice(self.name, deadline, "the node is draining in Ray")

    def close(self) -> None:
        pass


def detected_clouds(environ: Mapping[str, str], dmi_dir: Path) -> set[str]:
    """The clouds whose metadata service this node has, judged without network: the SDKs' endpoint variable of a
    cloud (a service moved off its default address, as the tests' fake one on 127.0.0.1), or the machine's DMI
    strings naming Amazon or Google."""
    clouds = {AWS} if environ.get(AWS_ENDPOINT_ENV) else set()
    if environ.get(GCE_HOST_ENV):
        clouds.add(GCP)
    firmware = " ".join(_read(dmi_dir / name) for name in DMI_FILES).lower()
    if "amazon" in firmware:
        clouds.add(AWS)
    if "google" in firmware:
        clouds.add(GCP)
    return clouds


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:  # absent (a laptop without DMI, a container that hides /sys), or unreadable
        return ""


def metadata_clouds(metadata: str, joined: bool, environ: Mapping[str, str] | None = None) -> set[str]:
    """Whose metadata service to watch (`spot.metadata`): `on` both clouds', `off` none, `auto` those this node is
    an instance of (`detected_clouds`), or both on a node of a cluster that was joined (`--address`, or a node that
    is not its cluster's head: a cluster's nodes are the cloud's machines, even where a container hides DMI)."""
    if metadata == "off":
        return set()
    if metadata == "on" or joined:
        return {AWS, GCP}
    return detected_clouds(os.environ if environ is None else environ, DMI_DIR)


def cloud_sources(timeout_s: float, interval_s: float = 5.0, clouds: Collection[str] = (AWS, GCP)) -> list:
    """The metadata services of `clouds` to ask (every `interval_s`): AWS's unless disabled, GCP's."""
    aws = AWS in clouds and os.environ.get(AWS_DISABLED_ENV, "").lower() != "true"
    return [
        *([AwsMetadata(timeout_s=timeout_s)] if aws else []),
        *([GcpMetadata(timeout_s=timeout_s, interval_s=interval_s)] if GCP in clouds else []),
    ]


def watched_sources(spot, joined: bool) -> list:
    """The metadata services that `spot` (a `core.config.SpotConfig`) watches on this node (`metadata_clouds`)."""
    clouds = metadata_clouds(spot.metadata, joined)
    return cloud_sources(spot.probe_timeout_s, spot.poll_interval_s, clouds)
