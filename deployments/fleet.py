"""Builds and runs the fleet: one Serve application = an Ingress in front of N VLLMReplicas.

Two ways in, one builder (`fleet_app`), both with a fleet's config (`core.config.FleetConfig`):
- `serve run serve_config.yaml` (`make serve`) imports `launch.serve:build_app`, which reads a fleet config file;
- the driver calls `deploy_fleet(cfg.own_fleet(), model_path)` on an already initialised Ray and gets the
  base URL back once every replica has loaded the live adapters; `fleet_is_running` and `shutdown_fleet`
  complete the lifecycle.

Two ways to reach it: HTTP at `fleet_url` (the ingress's own front door on the head, `deployments.ingress.front_door`,
with Serve's proxy behind it at `fleet.proxy_port`) for clients outside the cluster and for the driver's side on the head; `contracts.serving.serve_address` for callers on other
nodes (the learner), who get an `app.fleet_client.ServeFleet`, a Serve handle to the ingress. fleet.host is an address as the
head sees it: 127.0.0.1, or 0.0.0.0 read as 127.0.0.1, is the learner node itself over there.

Paths are made absolute here, in the process that reads the config, because replicas run in other
processes (other machines, in a cluster) whose working directory means nothing to the config file.

The fleet's signing secret (`contracts.auth.signing_secret`, from the admin token) travels to the ingress and the
replicas the same way, one value for all of them: the keys the ingress hands runs must be those the replicas verify
with. The admin token travels to the ingress alone, as a `contracts.auth.Secret` argument: the fleet config
that the replicas and the ingress get is `cfg.model_dump()`, which never holds it, and `serve run`'s
overrides (Serve shows them as the application's config) may not set it. A fleet that others could
reach (an HTTP host beyond loopback), or whose inference is to be protected, is refused without one
(`contracts.auth.check_exposure`), here and again in the ingress's own process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from contracts.serving import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT
from core.bucket.filesystem import absolute_bucket_url
from core.config import HEAD_NODE, FleetConfig

log = logging.getLogger("ray.serve")  # Serve shows this logger's lines in the app-build and controller logs

PREFIX_ROUTER = "deployments.routing.router:PrefixHashRouter"
# One access-log line per request drowns the replicas' own messages (and a joined driver's terminal) at
# hundreds of requests a second; request counts and latencies are in Serve's metrics.
QUIET = {"enable_access_log": False}
ROUTING_STATS_PERIOD_S = 2.0


def most_replicas(fleet) -> int:
    """The most replicas the fleet may have: `num_replicas`, or the autoscaling's `max_replicas`."""
    return fleet.autoscaling.max_replicas if fleet.autoscaling else fleet.num_replicas


def fleet_app(cfg: FleetConfig, model_path: str, *, request_router_class: str = PREFIX_ROUTER):
    """The Serve application (not yet running): Ingress(handle to VLLMReplica x num_replicas, or autoscaled), and a
    handle to each model deployment's replicas the fleet has (a teacher's, a judge's: `deployments.replica.teacher`)
    by the model name requests give it."""
    from ray import serve

    from contracts.auth import Secret, admin_token, check_exposure, signing_secret
    from deployments.api.routing import route_factories
    from deployments.ingress.shell import DoorAddress, Ingress
    from deployments.replica.teacher import deployment_apps

    fleet = cfg.fleet
    route_factories(fleet.routes)  # a name that does not import fails here, before any replica starts
    token = admin_token(cfg)
    host, proxy_port = _proxy_address(cfg)
    check_exposure(host, fleet.protect_inference, token)
    max_connections = max(1000, fleet.max_ongoing_requests * most_replicas(fleet))
    door_port: int | None = fleet.port
    if proxy_port == fleet.port:  # a Serve config of an older release: its proxy holds the fleet's port
        log.warning(
            "Serve's proxy listens on fleet.port %d, so the fleet has no front door of its own and every request "
            "pays the proxy's hop (docs/architecture.md); give the proxy another port (http_options.port)",
            fleet.port,
        )
        door_port = None
    model_path = str(Path(model_path).expanduser().resolve()) if Path(model_path).expanduser().exists() else model_path
    # Requests name the base model by its folder (as vLLM does, and as TRL sends it) or by the config's name.
    aliases = sorted({cfg.model.name_or_path, model_path, Path(model_path).name} - {model_path})
    config = cfg.model_dump(mode="json")
    bucket_url = absolute_bucket_url(cfg.bucket_url)
    replica_deployment = _replica_deployment(fleet, request_router_class)
    signing = signing_secret(token)  # one secret for the ingress and every replica, however their environments differ
    replica = replica_deployment.bind(model_path, model_path, config, bucket_url, signing)
    deployed = deployment_apps(cfg, model_path, bucket_url, replica_deployment, signing)  # {} without any
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=max_connections,
        # On the head node, beside the only HTTP proxy: losing a spot node never takes the front door with it.
        ray_actor_options={"num_cpus": 0, "resources": dict(HEAD_NODE)},
        logging_config=QUIET,
    )
    # The router class is part of the ingress's arguments so that changing it restarts the ingress,
    # whose handle then builds the new router (the benchmark swaps routers on the same replicas).
    secret = Secret(token) if token else None
    return ingress.bind(
        replica,
        model_path,
        aliases,
        model_path,
        config,
        secret,
        request_router_class,
        DoorAddress(host, door_port, proxy_port, max_connections),
        bucket_url,
        deployed,
        signing,
    )


def _replica_deployment(fleet, request_router_class: str):
    """The VLLMReplica deployment (not yet bound): its replicas, their resources, the router, Serve's timings."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.autoscaling import autoscaling_config
    from deployments.replica.shell import VLLMReplica

    on_gpu = fleet.num_gpus_per_replica > 0
    return serve.deployment(
        VLLMReplica,
        name=REPLICA_DEPLOYMENT,
        # Elastic (`deployments.autoscaling`): Serve sizes it from num_replicas on, within the configured bounds.
        num_replicas=None if fleet.autoscaling else fleet.num_replicas,
        autoscaling_config=autoscaling_config(fleet),
        # An engine batches hundreds of sequences; Serve's default of 5 would starve it.
        max_ongoing_requests=fleet.max_ongoing_requests,
        # On a CPU box the engines pin cores themselves (VLLM_CPU_OMP_THREADS_BIND per replica); reserving
        # Ray CPUs for them as well would starve the learner of the same machine.
        ray_actor_options={
            "num_cpus": 0,
            **({"num_gpus": fleet.num_gpus_per_replica} if on_gpu else {}),
            **({"resources": dict(fleet.replica_resources)} if fleet.replica_resources else {}),
        },
        # Routing stats say whether a replica drains (a spot notice): read every few seconds.
        request_router_config=RequestRouterConfig(
            request_router_class=request_router_class, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S
        ),
        logging_config=QUIET,
        health_check_period_s=10,
        health_check_timeout_s=60,
        # A draining replica hands its generations back as this begins (`deployments.replica.notices`).
        graceful_shutdown_timeout_s=30,
    )


def _serve_client():
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False)


def fleet_is_running(cfg: FleetConfig) -> bool:
    """Whether the fleet's Serve application is up and RUNNING on the connected Ray cluster."""
    from ray import serve

    if _serve_client() is None:
        return False
    app = serve.status().applications.get(cfg.fleet.app_name)
    return app is not None and app.status == "RUNNING"


def _proxy_address(cfg: FleetConfig) -> tuple[str, int]:
    """Where Serve's HTTP proxy listens: its actual address when Serve runs, else the configured one."""
    import ray

    client = _serve_client() if ray.is_initialized() else None  # never start a Ray just to ask
    return (client.http_config.host, client.http_config.port) if client else (cfg.fleet.host, proxy_port(cfg))


def proxy_port(cfg: FleetConfig) -> int:
    """The port Serve's proxy is to take behind the fleet's front door: `fleet.proxy_port`, else a free one now."""
    if cfg.fleet.proxy_port is not None:
        return cfg.fleet.proxy_port
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((cfg.fleet.host, 0))
        except OSError:  # not an address of this machine (a config built elsewhere): one free on all of them
            sock.bind(("", 0))
        return sock.getsockname()[1]


def fleet_url(cfg: FleetConfig) -> str:
    """Base URL of the fleet: where its ingress says its front door is when the fleet runs (Serve's proxy if it has
    none), else the configured `fleet.host:fleet.port`."""
    from deployments.ingress.front_door import reachable

    if fleet_is_running(cfg):
        from ray import serve

        from contracts.serving import INGRESS_DEPLOYMENT

        ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, cfg.fleet.app_name)
        door = ingress.front_door.remote().result(timeout_s=60)
        if door is not None:
            return door
        host, port = _proxy_address(cfg)
        return f"http://{reachable(host)}:{port}"
    return f"http://{reachable(cfg.fleet.host)}:{cfg.fleet.port}"


def deploy_fleet(
    cfg: FleetConfig, model_path: str, *, timeout_s: float = 900.0, request_router_class: str = PREFIX_ROUTER
) -> str:
    """Run the fleet on the already initialised Ray; return its base URL once every replica is healthy.

    Healthy means each replica finished start-up, which includes loading the newest committed
    adapter versions from the bucket, and answers `/health`. Deploying again replaces the running
    fleet (Ray Serve versions every imperative deploy anew, so the engines restart): call
    `fleet_is_running` first to reuse one. `request_router_class` swaps the router (the benchmark
    compares PrefixHashRouter with Serve's own).
    """
    from ray import serve
    from ray.serve.config import HTTPOptions

    # One HTTP proxy, on the head (on-demand) node, behind the fleet's front door (the ingress, on the head too):
    # clients have one address that outlives spot nodes.
    serve.start(http_options=HTTPOptions(host=cfg.fleet.host, port=proxy_port(cfg)), proxy_location="HeadOnly")
    proxy = _proxy_address(cfg)
    if cfg.fleet.proxy_port is not None and proxy != (cfg.fleet.host, cfg.fleet.proxy_port):
        log.warning("Serve was already running, its proxy at %s:%d, not at fleet.proxy_port", *proxy)
    started = time.monotonic()
    serve.run(
        fleet_app(cfg, model_path, request_router_class=request_router_class),
        name=cfg.fleet.app_name,
        route_prefix="/",
    )
    base_url = fleet_url(cfg)
    wait_healthy(base_url, cfg.fleet.num_replicas, timeout_s=max(1.0, timeout_s - (time.monotonic() - started)))
    log.info("fleet up at %s in %.0fs", base_url, time.monotonic() - started)
    return base_url


def wait_healthy(base_url: str, num_replicas: int, *, timeout_s: float = 300.0) -> None:
    """Block until `/health` reports `num_replicas` live replicas."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(base_url=base_url, timeout=10.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                response = client.get("/health")
                live = response.json().get("replicas", 0) if response.status_code == 200 else 0
                if live >= num_replicas:
                    return
                last = f"{live} of {num_replicas} replicas live" if response.status_code == 200 else response.text[:200]
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(1.0)
    raise TimeoutError(f"fleet at {base_url} not healthy after {timeout_s:.0f}s: {last}")


def shutdown_fleet(cfg: FleetConfig, *, stop_serve: bool = True) -> None:
    """Delete the fleet's application (stopping its engines); shut Serve down if nothing else runs on it.

    `stop_serve=False` when Ray itself is about to stop: its shutdown ends Serve's controller anyway,
    and stopping Serve first only races it (Ray then reports a failed graceful_shutdown task).
    """
    from ray import serve

    if _serve_client() is None:
        return
    if cfg.fleet.app_name in serve.status().applications:
        serve.delete(cfg.fleet.app_name)
    if stop_serve and not serve.status().applications:
        serve.shutdown()
