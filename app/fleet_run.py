"""A run of a shared fleet: join a fleet that is already running, over HTTP alone, stay alive on it, leave it.

`make train ARGS="--fleet http://HOST:PORT"` (`join.url`) trains against a fleet somebody else
started, whether or not this driver shares its Ray cluster: everything goes through the fleet's HTTP
API (`deployments.api.run_routes`). On the fleet the run is `logging.run_name`, its adapters `<run>/policy-vN`
(`RunConfig.fleet_run`), and its token is either

- `SPOTRL_RUN_TOKEN`: a token the admin registered for it (`POST /v1/runs`); the fleet says which run it
  belongs to, which must be this one. At the end the run unloads its adapters and stays registered: the
  admin who registered it removes it;
- or minted here with the admin token (`SPOTRL_ADMIN_TOKEN`): the driver registers the run, and removes
  it at the end (success, error and Ctrl-C alike), which unloads its adapters everywhere.

A driver that dies says nothing: the fleet releases the run after `fleet.run_idle_timeout_s` with no
request or heartbeat. So the driver sends a heartbeat from a thread meanwhile: the rollout's requests
count too, but start-up, evaluation and a long learner step send none.

The run publishes where the fleet tells it (`GET /v1/runs/NAME`): its own prefix of the fleet's bucket,
the only place the fleet loads a run's adapters from, so `bucket.url` is that prefix whatever the config says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from app.fleet_client import FleetClient, FleetError
from contracts.auth import RUN_TOKEN_PREFIX, Secret, admin_token, redact
from core.models import check_same_base_model

log = logging.getLogger("spotrl.fleet_run")

RUN_TOKEN_ENV = "SPOTRL_RUN_TOKEN"
LONGEST_HEARTBEAT_S = 30.0
GONE = (401, 404)  # what a heartbeat answers once the fleet no longer knows the run or its token


@dataclass
class FleetRun:
    """This run as a tenant of a fleet: where, under which name, with which token, publishing where."""

    url: str
    name: str
    token: Secret
    bucket_url: str
    idle_timeout_s: float
    registered_with: Secret | None  # the admin token the driver registered the run with; None: token handed over

    @property
    def heartbeat_s(self) -> float:
        """Often enough that two heartbeats in a row may be lost before the fleet gives up on the run."""
        return min(self.idle_timeout_s / 4, LONGEST_HEARTBEAT_S)


def join(cfg, model_path: str) -> FleetRun:
    """Become run `logging.run_name` of the fleet at `join.url`, whose base model must be `model_path`;
    SystemExit with the reason when it cannot."""
    url, name = cfg.join.url, cfg.logging.run_name
    handed_over = os.environ.get(RUN_TOKEN_ENV)
    registered_with = None
    if handed_over:
        if not handed_over.startswith(RUN_TOKEN_PREFIX):  # the admin token there would pass for any run's
            raise SystemExit(f"{RUN_TOKEN_ENV} is not a run token ({RUN_TOKEN_PREFIX}..., from POST /v1/runs)")
        token = handed_over
        with contextlib.closing(FleetClient(url, token=token)) as client:
            owned = _call(client.list_runs, f"{RUN_TOKEN_ENV} on {url}")
        if owned != [name]:
            whose = f"run {owned[0]!r}" if owned else "no run (the admin's token, or one no longer registered)"
            raise SystemExit(f"{RUN_TOKEN_ENV} belongs to {whose}, not logging.run_name={name!r}")
    else:
        admin = admin_token(cfg)
        if not admin:
            raise SystemExit(
                f"join.url: joining {url} needs {RUN_TOKEN_ENV} (a run token from POST /v1/runs) "
                "or SPOTRL_ADMIN_TOKEN (to register this run and mint its token)"
            )
        with contextlib.closing(FleetClient(url, token=admin)) as client:
            token = _call(
                lambda: client.register_run(
                    name, max_staleness=cfg.rollout.max_staleness, lora_rank=cfg.lora.rank, lineages=cfg.lineages
                )["token"],
                f"registering run {name!r} on {url}",
            )
        registered_with = Secret(admin)
        log.info("registered run %s on the fleet at %s", name, url)
    try:
        with contextlib.closing(FleetClient(url, token=token)) as client:
            info = _call(lambda: client.run_info(name), f"asking {url} about run {name!r}")
            if not info.get("bucket_url"):
                raise SystemExit(f"the fleet at {url} has no bucket for its runs to publish to")
            check_base_model(client, model_path, cfg.model.revision)
            check_terms(cfg, info, url)
    except SystemExit:
        if registered_with is not None:  # registered a moment ago: not left behind for the idle timeout
            leave(FleetRun(url, name, Secret(token), "", cfg.fleet.run_idle_timeout_s, registered_with))
        raise
    run = FleetRun(url, name, Secret(token), info["bucket_url"], float(info["idle_timeout_s"]), registered_with)
    log.info("run %s publishes to %s, heartbeat every %.0f s", name, run.bucket_url, run.heartbeat_s)
    return run


def check_base_model(client: FleetClient, model_path: str, revision: str | None) -> None:
    """SystemExit unless the fleet behind `client` serves `model_path` (`core.models.check_same_base_model`)."""
    served = _call(client.server_info, f"asking {client.base_url} which base model it serves")["spotrl"]
    check_same_base_model(served.get("base_fingerprint"), model_path, revision, client.base_url)


def check_terms(cfg, info: dict, url: str) -> None:
    """SystemExit when the run was registered (by the admin, for a handed-over token) with a staleness window, a
    LoRA rank or lineages smaller than this run's config: the fleet would unpin versions its samples still use,
    refuse its adapters, or count no slots for its ema average."""
    registered = info.get("max_staleness")
    if registered is not None and cfg.rollout.max_staleness > registered:
        raise SystemExit(
            f"rollout.max_staleness={cfg.rollout.max_staleness}: run {cfg.logging.run_name!r} is registered on {url} with "
            f"max_staleness {registered}; use at most that, or have the admin register it with yours"
        )
    rank = info.get("lora_rank")
    if rank is not None and cfg.lora.rank > rank:
        raise SystemExit(
            f"lora.rank={cfg.lora.rank}: run {cfg.logging.run_name!r} is registered on {url} with lora_rank {rank}"
        )
    lineages = info.get("lineages")
    if lineages is not None and cfg.lineages > lineages:
        raise SystemExit(
            f"distill: an ema teacher publishes a second lineage, but run {cfg.logging.run_name!r} is registered on "
            f"{url} with lineages {lineages}; have the admin register it with lineages {cfg.lineages}"
        )


def check_same_bucket(client: FleetClient, bucket_url: str) -> None:
    """SystemExit unless the fleet behind `client` loads its own lineage (`policy-vN`) from `bucket_url`: a run
    that uses a fleet it found running, without joining it as a run, publishes there."""
    served = _call(client.server_info, f"asking {client.base_url} which bucket it serves from")["spotrl"]
    if served.get("bucket_url") != redact(bucket_url):
        raise SystemExit(
            f"bucket.url: the fleet running at {client.base_url} loads adapters from {served.get('bucket_url')}, "
            f"not from this run's {redact(bucket_url)}; join it as a run of it (--fleet {client.base_url}) instead"
        )


def _call(fn, what: str):
    try:
        return fn()
    except FleetError as e:
        raise SystemExit(f"{what}: {e}") from None


def publish_to_fleet_bucket(cfg, run: FleetRun) -> None:
    """Point `bucket.url` at the run's prefix of the fleet's bucket (as a template: braces are doubled)."""
    if cfg.bucket_url != run.bucket_url:
        log.info("bucket.url is the fleet's prefix for this run: %s (was %s)", run.bucket_url, cfg.bucket_url)
    cfg.bucket.url = run.bucket_url.replace("{", "{{").replace("}", "}}")


def leave(run: FleetRun) -> None:
    """Release what the run holds: remove it (registered here) or unload its adapters (token handed over).

    Never raises: a fleet that cannot be told releases the run by itself after the idle timeout."""
    try:
        if run.registered_with is not None:
            with contextlib.closing(FleetClient(run.url, token=run.registered_with.value)) as admin:
                unloaded = admin.remove_run(run.name)["unloaded"]
            log.info("removed run %s from the fleet (unloaded %d adapters)", run.name, len(unloaded))
            return
        with contextlib.closing(FleetClient(run.url, token=run.token.value)) as client:
            mine = [m["id"] for m in client.models() if m["id"].startswith(f"{run.name}/")]
            for name in mine:
                client.unload_adapter(name)
        log.info("unloaded run %s's %d adapters; it stays registered", run.name, len(mine))
    except FleetError as e:
        log.warning(
            "could not release run %s on %s (%s): the fleet releases it after %.0f s without a heartbeat",
            run.name,
            run.url,
            e,
            run.idle_timeout_s,
        )


class Heartbeat:
    """A daemon thread that keeps the run alive on the fleet until the `with` block ends.

    A fleet that no longer knows the run (its token 401, the run 404: the admin removed it, or it was
    released after the idle timeout) would refuse every request from now on, and the driver would wait for
    groups forever: so the heartbeat says why in the log and calls `on_lost`, by default a SIGINT to this
    process, which stops the run the way Ctrl-C does (a real signal: it wakes a main thread blocked in Ray)."""

    def __init__(self, run: FleetRun, on_lost: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGINT)):
        self.run, self.on_lost = run, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{run.name}", daemon=True)
        self.beats = 0
        self.lost: str | None = None  # why the fleet no longer knows the run

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _beat(self) -> None:
        with contextlib.closing(FleetClient(self.run.url, token=self.run.token.value, timeout_s=10.0)) as client:
            while not self._stop.wait(self.run.heartbeat_s):
                try:
                    client.heartbeat(self.run.name)
                    self.beats += 1
                except FleetError as e:
                    if e.status in GONE:
                        self.lost = str(e)
                        log.error(
                            "the fleet no longer knows run %s (%s): removed by the admin, or released after %.0f s "
                            "without a heartbeat; stopping the run",
                            self.run.name,
                            e,
                            self.run.idle_timeout_s,
                        )
                        self.on_lost()
                        return
                    log.warning("heartbeat of run %s: %s", self.run.name, e)  # the next one may pass
