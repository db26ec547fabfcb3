"""Spot interruption notices: what one is, where each cloud says it, and a watcher that hears it first.

A spot machine is taken back with a warning: AWS gives two minutes (IMDS `spot/instance-action`, and often
a rebalance recommendation earlier), GCP about 30 s (metadata `instance/preempted`, and
`instance/maintenance-event` before host maintenance), Kubernetes and SkyPilot a SIGTERM with a grace
period, and some schedulers write a file. Ray watches for none of these. `NoticeWatcher` polls them in a
thread of the process that hosts a role (the learner, a replica, the driver) and calls that role's
handlers once with a `Notice`: the node is then drained in Ray, the learner checkpoints, the replicas hand
their work back (`app.spot`, `deployments`).

The metadata services are reached where the clouds' own SDKs reach them, honouring their variables:
`AWS_EC2_METADATA_SERVICE_ENDPOINT` (botocore's, a URL; `AWS_EC2_METADATA_DISABLED=true` turns AWS off)
and `GCE_METADATA_HOST` (google-auth's, host:port), so tests point them at a fake server on 127.0.0.1.
IMDSv2 first (a session token, then GETs that carry it); where the token is refused, IMDSv1 (plain GETs).
Off a cloud (a laptop, CI) the first short probe finds nothing and the watcher stops asking, from its own
thread: start-up never waits for it.

Both sides need this (the learner's and the replicas' nodes are spot alike), so it sits below them.
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("spotrl.notices")

AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
AWS_DISABLED_ENV = "AWS_EC2_METADATA_DISABLED"
GCE_HOST_ENV = "GCE_METADATA_HOST"
METADATA_IP = "169.254.169.254"  # both clouds' default, when their variable is not set
AWS_TOKEN_TTL_S = 21600
# The token answers that mean this instance offers no IMDSv2 (botocore's reading too): then IMDSv1. Any other failure
# (throttling, a server error) is asked again at the next poll.
IMDSV2_UNAVAILABLE = (403, 404, 405)
GCP_NOTICE_S = 30.0  # GCP's preemption notice; its maintenance notice is 60 s
GCP_MAINTENANCE_S = 60.0
# A node that outlives its deadline by this much was not taken after all: the roles on it carry on (the learner trains
# on rather than abandon every step, a replica takes work again) and watch for the next notice.
OUTLIVED_S = 60.0


class MetadataError(RuntimeError):
    """A metadata service answered, but not with what was asked (a throttled or failing token request)."""


@dataclass(frozen=True)
class Notice:
    """The machine will go away (or, `binding` False, a cloud recommends moving off it)."""

    source: str  # aws, aws-rebalance, gcp, gcp-maintenance, sigterm, file
    deadline: float | None  # unix seconds when the machine goes; None: not said
    detail: str = ""

    @property
    def binding(self) -> bool:
        """An interruption, not a recommendation: AWS's rebalance recommendation promises nothing."""
        return self.source != "aws-rebalance"

    @property
    def drains_node(self) -> bool:
        """Whether acting on it includes draining the node in Ray. Not for a SIGTERM to this process, which says the
        process ends, not the node: Ray itself sends one to the workers of a job that ends or an actor it kills, and
        a scheduler stopping the node signals Ray's own processes, whose handler drains it (`RayDrain` hears that).
        Not for Ray's drain either, which is under way already."""
        return self.binding and self.source not in ("sigterm", "ray-drain")

    def remaining_s(self, now: float | None = None) -> float | None:
        return None if self.deadline is None else self.deadline - (time.time() if now is None else now)

    def describe(self) -> str:
        left = self.remaining_s()
        when = f", {left:.0f} s left" if left is not None else ""
        return f"{self.source} notice{when}{f' ({self.detail})' if self.detail else ''}"


def on_head_node() -> bool:
    """Whether this process runs on its Ray cluster's head node (False without Ray). The head is the cluster itself
    (its GCS, Serve's controller and proxy, the driver): on the embedded default everything runs there, and the
    driver answers a notice for that machine (`app.spot`); the roles on other nodes answer their own."""
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized():
        return False
    node_id = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == node_id and "node:__internal_head__" in n.get("Resources", {}) for n in ray.nodes())


def drain_this_node(notice: Notice) -> bool:
    """Tell Ray that the node this process runs on is going (reason preemption, with the notice's deadline): nothing
    new is scheduled on it, and Serve starts replacements for its replicas elsewhere. False when Ray is not running
    here, on the head node (draining the cluster's own head would only stop the replicas there, with nowhere to
    start others, before the driver has checkpointed), or when Ray refused (it says why in the log); Ray's own
    SIGTERM handler makes the same call."""
    import ray

    if not ray.is_initialized() or on_head_node():
        return False
    from ray._private.worker import global_worker
    from ray.core.generated import autoscaler_pb2

    node_id = ray.get_runtime_context().get_node_id()
    deadline = notice.deadline if notice.deadline is not None else time.time() + GCP_NOTICE_S
    accepted, why = global_worker.gcs_client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"spotrl: {notice.describe()}",
        int(deadline * 1000),
    )
    if not accepted:
        log.warning("spot: Ray refused to drain node %s: %s", node_id[:12], why)
    else:
        log.warning("spot: node %s drained in Ray (%s)", node_id[:12], notice.describe())
    return bool(accepted)


def _parse_utc(stamp: str) -> float:
    """`2026-12-02T08:22:00Z` as unix seconds."""
    return float(calendar.timegm(time.strptime(stamp.replace(".000", ""), "%Y-%m-%dT%H:%M:%SZ")))


class AwsMetadata:
    """EC2's instance metadata service: `spot/instance-action` and the rebalance recommendation."""

    name = "aws"

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

    name = "gcp"

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


def cloud_sources(timeout_s: float, interval_s: float = 5.0) -> list:
    """The metadata services to ask (every `interval_s`): AWS's unless disabled, GCP's."""
    sources = [] if os.environ.get(AWS_DISABLED_ENV, "").lower() == "true" else [AwsMetadata(timeout_s=timeout_s)]
    return [*sources, GcpMetadata(timeout_s=timeout_s, interval_s=interval_s)]


class NoticeWatcher:
    """Polls the notice sources every `interval_s` in a daemon thread and calls each handler once per notice.

    A binding notice (an interruption) is reported once, and the watcher then polls nothing more (the machine is
    going) until the role says the node outlived it (`clear`); a recommendation (AWS rebalance) is reported once, and
    the watcher goes on watching for the interruption itself. A source that fails (a metadata server that
    errs, Ray's GCS out of reach) is logged and asked again later, backing off, never the end of watching the
    others or itself. `sigterm_grace_s` makes a SIGTERM to this process a notice with
    that deadline (installed only from the main thread; the previous handler still runs after ours, so what
    SIGTERM did before, it still does; with `chain_sigterm` False only on a second SIGTERM, so that a process that
    must checkpoint first, the learner, lives on until the grace period ends)."""

    def __init__(
        self,
        handlers: list[Callable[[Notice], None]],
        *,
        interval_s: float = 5.0,
        probe_timeout_s: float = 1.0,
        notice_file: str | None = None,
        sources: list | None = None,
        sigterm_grace_s: float | None = None,
        chain_sigterm: bool = True,
    ):
        self.handlers = list(handlers)
        self.interval_s = interval_s
        self.sources = cloud_sources(probe_timeout_s, interval_s) if sources is None else list(sources)
        if notice_file:
            self.sources.append(NoticeFile(notice_file, sigterm_grace_s or GCP_NOTICE_S))
        self.notices: list[Notice] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `stop` and `clear`: the thread looks again at once
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="spot-notices", daemon=True)
        if sigterm_grace_s is not None:
            self._install_sigterm(sigterm_grace_s, chain_sigterm)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def binding(self) -> Notice | None:
        """The interruption notice, once one came."""
        return next((n for n in self.notices if n.binding), None)

    def clear(self, notice: Notice) -> None:
        """The node outlived `notice` (the machine was not taken after all): watch for the next one."""
        with self._lock:
            self.notices = [n for n in self.notices if n is not notice]
        self._wake.set()

    def _install_sigterm(self, grace_s: float, chain: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            notice = Notice("sigterm", time.time() + grace_s, f"SIGTERM, {grace_s:.0f} s grace")
            if not chain:
                # The process lives on to act on it (its handlers make RPCs: not from inside a signal handler); a
                # second SIGTERM, or the grace period's SIGKILL, ends it.
                if self.binding is not None and callable(previous):
                    previous(signum, frame)
                threading.Thread(target=self.report, args=(notice,), name="spot-sigterm", daemon=True).start()
                return
            self.report(notice)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def report(self, notice: Notice) -> None:
        """Hand `notice` to every handler, unless a notice of its kind (binding or not) came already."""
        with self._lock:
            if any(n.binding == notice.binding for n in self.notices):
                return
            self.notices.append(notice)
        log.warning("spot: %s", notice.describe())
        for handler in self.handlers:
            try:
                handler(notice)
            except Exception:  # noqa: BLE001 - one role's failure must not keep the others from acting
                log.exception("spot: a notice handler failed")

    def _watch(self) -> None:
        live = [s for s in self.sources if self._answers(s)]
        if not live:
            log.info("spot: no metadata service or notice file answers here; not watching")
        failing = {source: _Failing() for source in live}
        while live and not self._stop.is_set():
            if self.binding is None:
                for source in live:
                    self._poll(source, failing[source])
            # Nothing to poll for while the machine is going: woken by `clear` (it stayed) or `stop`.
            self._wake.wait(self.interval_s if self.binding is None else None)
            self._wake.clear()
        for source in self.sources:
            source.close()

    def _poll(self, source, failing: _Failing) -> None:
        if not failing.due():
            return
        try:
            notice = source.poll()
        except Exception as e:  # noqa: BLE001 - a source that errs is asked again later, never the end of watching
            failing.failed(source.name, e, self.interval_s)
            return
        failing.answered(source.name)
        if notice is not None:
            self.report(notice)

    @staticmethod
    def _answers(source) -> bool:
        try:
            return source.probe()
        except Exception:  # noqa: BLE001 - whatever a source fails with at the first probe, it is not here
            return False


MAX_BACKOFF_S = 60.0


class _Failing:
    """A source's consecutive failures: asked again after the poll interval, doubled per failure (at most
    `MAX_BACKOFF_S`); the first failure and the recovery are logged."""

    def __init__(self):
        self.failures, self.next_at = 0, 0.0

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self, name: str, error: Exception, interval_s: float) -> None:
        self.failures += 1
        pause = min(interval_s * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        self.next_at = time.monotonic() + pause
        say = log.warning if self.failures == 1 else log.debug
        say(
            "spot: the %s notice source failed (%s: %s); asking again in %.0f s",
            name,
            type(error).__name__,
            error,
            pause,
        )

    def answered(self, name: str) -> None:
        if self.failures:
            log.warning("spot: the %s notice source answers again after %d failures", name, self.failures)
        self.failures, self.next_at = 0, 0.0
