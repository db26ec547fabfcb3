"""The fleet's front door as a Ray Serve deployment: the HTTP API over a handle to the vLLM replicas.

One ingress replica holds the tokenizer and a `DeploymentHandle` to `VLLMReplica` (and one to a teacher
deployment's replicas, for requests that name the teacher: `deployments.replica.teacher`); each handle's
request router is a PrefixHashRouter, so it lives in this process and `/router/stats` reads its
counters directly. Generations go through the handle as one `GenerateRequest` each
(`contracts.serving`), the type the router reads and the replica samples from.

The ingress is where failures are hidden from clients: a generation whose replica died (spot
preemption, OOM) is sent again (`contracts.retry.aretry`, whose docstring says who retries what), and the
router, told of the death by Serve, picks a live replica; a generation during which an engine died is
sent once more at most, then refused as poison (`deployments.ingress.poison`). A replica whose node is going (a
spot notice) refuses new generations, which go elsewhere, and hands its unfinished ones back: they are
continued on another replica and stitched, token-exact (`deployments.ingress.handback`); its routers route nothing
more to it (`replica_draining`). Admin calls are broadcast to every live replica. Serve runs the app's
lifespan in this replica, so the control layer's upkeep (`deployments.control.upkeep`: idle runs released,
slots gauges, the fair share's budget) runs here, beside the requests.

Callers inside the Ray cluster (the learner, on another node) reach the fleet through a handle to
this deployment instead of HTTP: the HTTP proxy listens on the head, at an address that may mean
nothing elsewhere (127.0.0.1). `load_adapter` is that entry, the same all-or-nothing load as
`/v1/load_lora_adapter`; it needs no token, since only a member of the cluster can call it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.auth import Secret, check_exposure, redact, signing_secret
from contracts.auth import admin_token as resolve_admin_token
from contracts.control import CONTROL_METHOD, Command, DescribeEngine
from contracts.retry import Backoff, aretry
from contracts.serving import (
    BUNDLE_METHOD,
    GENERATE_METHOD,
    EngineDied,
    GenerateBundle,
    Generated,
    GenerateRequest,
    ReplicaDraining,
    ReplicaUnavailable,
)
from core.bucket.records import RunRecords
from core.bucket.store import AdapterStore
from core.config import FleetConfig
from core.models import model_fingerprint
from deployments.api import ApiSettings, make_app
from deployments.api.bodies import RequestLimits
from deployments.api.routing import route_factories
from deployments.control.broadcast import load_everywhere
from deployments.control.errors import ApiError
from deployments.control.fair_share import FairShare
from deployments.control.run_metrics import RunMetrics
from deployments.control.runs import Registration, Runs
from deployments.ingress.front_door import ForwardUnmatched, FrontDoor, reachable
from deployments.ingress.handback import continue_handed_back
from deployments.ingress.poison import ENGINE_DEATHS_PER_REQUEST, PoisonTable, fingerprint

log = logging.getLogger("ray.serve")

# Attempts of one generation across replica deaths: the first retry normally lands on a live
# replica; the later ones cover the seconds before Serve has noticed that a replica is gone
# (pauses 0.5, 1, 2, 2, 2 s, jittered: about 7.5 s in all).
GENERATE_BACKOFF = Backoff(attempts=6, first_s=0.5, max_s=2.0)


def _raised(exc: BaseException, kinds) -> bool:
    """`exc` is one of `kinds`, or Ray's wrapper of one (a replica's exception comes back as its `cause`)."""
    return isinstance(exc, kinds) or isinstance(getattr(exc, "cause", None), kinds)


def replica_failed(exc: BaseException) -> bool:
    """The replica, not the request, failed: worth sending again elsewhere."""
    from ray.exceptions import RayActorError

    return _raised(exc, RayActorError | ReplicaUnavailable)


def engine_died(exc: BaseException) -> bool:
    """The replica's engine died while serving the request, maybe because of it (`deployments.ingress.poison`)."""
    return _raised(exc, EngineDied)


def own_internal_request_id() -> None:
    """Give the handle call this task makes next an internal request id of its own.

    Ray Serve 2.60 stamps every handle call made while serving one HTTP request with that request's
    internal id, and its RequestRouter hands a chosen replica to the pending request with that id:
    of two calls in flight at once (the prompts of one /v1/completions batch), the second is never
    indexed, never gets a replica and hangs. Serve's own routers escape it through FIFOMixin, which
    PrefixHashRouter must not use (`deployments.routing.router`). The request context is a contextvar, so
    this changes only the calling task's copy (each prompt's `generate` runs in a task of its own).
    """
    import dataclasses

    from ray.serve._private.utils import generate_request_id
    from ray.serve.context import _get_serve_request_context, _serve_request_context

    context = _get_serve_request_context()
    _serve_request_context.set(dataclasses.replace(context, _internal_request_id=generate_request_id()))


def mark_draining(replica_id: str, draining: bool = True) -> None:
    """The routers of this process (the ingress's) route nothing more to replica `replica_id`: its node is going (or,
    `draining` False, route to it again: its node outlived the notice)."""
    from deployments.routing.router import mark_draining as mark

    mark(replica_id, draining)


def _log_retry(exc: BaseException, attempt: int, pause_s: float) -> None:
    what = "its engine died while serving it" if engine_died(exc) else "it hit a dead replica"
    log.warning("generation failed, %s (%s); retry %d in %.1fs", what, type(exc).__name__, attempt, pause_s)


class ServeBackend:
    """`deployments.control.backend.Backend` over a DeploymentHandle to the VLLMReplica deployment."""

    def __init__(self, handle, poison: PoisonTable | None = None, deployed: dict[str, Any] | None = None):
        self._handle = handle
        # Each model deployment's handle (a teacher's, a judge's) by its model name (`deployments.replica.teacher`).
        self._deployed = deployed or {}
        self._server_info: dict[str, Any] | None = None
        self._poison = PoisonTable() if poison is None else poison
        # Generations a draining replica handed back (continued elsewhere), new ones it refused (sent elsewhere), and
        # attempts lost with a replica that died (sent again from their start).
        self.spot = {"handed_back": 0, "refused_draining": 0, "replica_failures": 0}

    async def generate(self, request: GenerateRequest) -> Generated:
        return await self._finish(request, await self._generate(request))

    async def _finish(self, request: GenerateRequest, result: Generated) -> Generated:
        if result.handed_back:  # its replica's node is going: continued elsewhere, stitched into one answer
            self.spot["handed_back"] += 1
            mark_draining(result.replica)
            result = await continue_handed_back(self.generate, request, result)
        return result

    async def _generate(self, request: GenerateRequest) -> Generated:
        key = fingerprint(request)
        self._poison.check(key)  # it killed two engines lately: not a third
        engine_deaths = 0

        def count(exc: BaseException) -> None:
            nonlocal engine_deaths
            engine_deaths += engine_died(exc)

        def retryable(exc: BaseException) -> bool:
            # A dead replica (a preempted node) as often as GENERATE_BACKOFF allows; a dead engine once.
            return replica_failed(exc) or (engine_died(exc) and engine_deaths < ENGINE_DEATHS_PER_REQUEST)

        try:
            return await self._call(request.model, GENERATE_METHOD, request, retryable, count)
        except Exception as exc:
            if not engine_died(exc):
                raise
            # Never a 503, which clients send again: it would come back with a fresh count.
            raise self._poison.engine_failure(key, engine_deaths) from None

    async def generate_many(self, requests: list[GenerateRequest]) -> list[Generated | Exception]:
        """Requests that route alike (one model and session, one first block: `deployments.control.coalesce`) in one
        replica call (`GenerateBundle`), each one's answer or failure in order. Each is what `generate` would answer:
        a poisoned one is refused alone, a handed-back one continued elsewhere; and when an engine died under the
        bundle, each goes again alone, so that the poison table finds the one that kills engines."""
        refused: dict[int, Exception] = {}
        for i, request in enumerate(requests):
            try:
                self._poison.check(fingerprint(request))
            except Exception as exc:
                refused[i] = exc
        bundle = GenerateBundle(tuple(r for i, r in enumerate(requests) if i not in refused))
        answers: list[Generated | Exception] = []
        if bundle.requests:
            try:
                answers = await self._call(bundle.requests[0].model, BUNDLE_METHOD, bundle, replica_failed)
            except Exception as exc:
                if not engine_died(exc):
                    raise
                answers = [exc] * len(bundle.requests)
        settled = iter(
            await asyncio.gather(*(self._settle(r, a) for r, a in zip(bundle.requests, answers, strict=True)))
        )
        return [refused[i] if i in refused else next(settled) for i in range(len(requests))]

    async def _settle(self, request: GenerateRequest, answer: Generated | Exception) -> Generated | Exception:
        """A bundled request's answer as `generate` would give it: continued elsewhere if handed back, sent again
        alone if an engine died under its bundle."""
        try:
            if isinstance(answer, Generated):
                return await self._finish(request, answer)
            if engine_died(answer):
                return await self.generate(request)
            return answer
        except Exception as exc:
            return exc

    async def _call(
        self,
        model: str,
        method: str,
        payload: GenerateRequest | GenerateBundle,
        retryable: Callable[[BaseException], bool],
        failed: Callable[[BaseException], None] = lambda exc: None,
    ) -> Any:
        """One replica call, retried across replicas while `retryable` says so. The handle's router (PrefixHashRouter)
        reads the payload's `prompt_ids` and `model` to pick the replica; a retry is routed afresh, away from the
        replica Serve now knows is dead, or that said it drains."""
        handle = self._deployed.get(model, self._handle)

        async def send():
            own_internal_request_id()
            try:
                return await handle.options(method_name=method).remote(payload)
            except Exception as exc:
                failed(exc)
                if _raised(exc, ReplicaDraining):  # sent again, to a replica that stays
                    self.spot["refused_draining"] += 1
                    mark_draining(getattr(exc, "cause", exc).replica)
                elif replica_failed(exc):
                    self.spot["replica_failures"] += 1
                raise

        return await aretry(send, GENERATE_BACKOFF, retryable, _log_retry)

    async def broadcast(self, command: Command) -> list[Any]:
        """Each live replica's reply or exception. A replica that died meanwhile is left out, not counted as a
        failure: it is no longer part of the fleet, and its replacement reads the live versions from the bucket."""
        results = await self._handle.broadcast(CONTROL_METHOD, command).results_async(return_exceptions=True)
        return [r for r in results if not (isinstance(r, BaseException) and replica_failed(r))]

    async def server_info(self) -> dict[str, Any]:
        if self._server_info is None:  # every replica runs the same engine config: ask one, once
            self._server_info = await self._handle.options(method_name=CONTROL_METHOD).remote(DescribeEngine())
        return self._server_info

    def router_stats(self) -> dict[str, Any]:
        from deployments.routing.router import router_stats

        return {**router_stats(), "spot": dict(self.spot)}

    def sizes(self) -> dict[str, int]:
        return {"poison_entries": len(self._poison)}


def tokenizer_functions(model_path: str):
    """(encode, decode, chat_ids, vocab_size) with the round-trip-checked tokenizer of the model folder."""
    from core.models import completion_text, load_tokenizer

    tokenizer = load_tokenizer(model_path)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(ids: list[int]) -> str:  # as the rollout decodes a choice it stitched after a cut
        return completion_text(tokenizer, ids)

    def chat_ids(messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return encode(text)

    config_file = Path(model_path) / "config.json"
    vocab_size = len(tokenizer)
    if config_file.is_file():  # the embedding table may be larger than the tokenizer
        vocab_size = max(vocab_size, int(json.loads(config_file.read_text()).get("vocab_size") or 0))
    return encode, decode, chat_ids, vocab_size


@dataclass(frozen=True)
class DoorAddress:
    """Where the fleet answers HTTP: its front door at host:port (`deployments.ingress.front_door`; port None: no door,
    Serve's proxy alone), Serve's proxy at host:proxy_port behind it, and how many connections the door holds."""

    host: str
    port: int | None
    proxy_port: int
    max_connections: int

    @property
    def proxy_url(self) -> str:
        return f"http://{reachable(self.host)}:{self.proxy_port}"


class Ingress:
    """A Ray Serve deployment class; `deployments.fleet` wraps it with `serve.ingress()` and `serve.deployment`."""

    def __init__(
        self,
        replicas,
        base_model: str,
        model_aliases: list[str],
        model_path: str,
        config: dict,
        admin_token: Secret | None = None,
        request_router: str = "",
        door: DoorAddress | None = None,
        bucket_url: str = "",
        deployed: dict[str, Any] | None = None,
        signing: Secret | None = None,
    ):
        cfg = FleetConfig.model_validate(config)
        # The environment of the ingress process wins, then a token handed over by the builder, then the config
        # (which reaches this process without it: `fleet.admin_token` is never dumped). The builder checked the
        # same in its own process; this process's environment may differ, and decides what the API enforces.
        token = resolve_admin_token(cfg, admin_token)
        check_exposure(door.host if door else "127.0.0.1", cfg.fleet.protect_inference, token)
        encode, decode, chat_ids, vocab_size = tokenizer_functions(model_path)
        settings = ApiSettings(
            base_model=base_model,
            base_fingerprint=model_fingerprint(model_path, cfg.model.revision),
            bucket_url=redact(bucket_url),
            model_aliases=frozenset(model_aliases),
            max_model_len=cfg.model.max_model_len,
            vocab_size=vocab_size,
            encode=encode,
            decode=decode,
            chat_ids=chat_ids,
            admin_token=token or None,
            protect_inference=cfg.fleet.protect_inference,
            autoscaling=(scaling.min_replicas, scaling.max_replicas) if (scaling := cfg.fleet.autoscaling) else None,
            limits=RequestLimits.of(cfg.fleet),
            max_loras=cfg.max_loras,
            max_staleness=cfg.max_staleness,
            max_lora_rank=cfg.max_lora_rank,
            run_idle_timeout_s=cfg.fleet.run_idle_timeout_s,
            inflight_budget=cfg.inflight_limit,
            inflight_per_replica=None if cfg.fleet.inflight_budget else cfg.fleet.max_num_seqs,
            default_run_weight=cfg.fleet.default_run_weight,
            coalesce_window_s=cfg.fleet.coalesce_window_s,
            routing_block_size=cfg.fleet.router.block_size,
            deployed_models=frozenset(d.name for d in cfg.deployments().values()),
            signing_secret=signing or signing_secret(token or None),
        )
        poison = PoisonTable(cfg.fleet.poison_ttl_s, cfg.fleet.poison_max_entries)
        self._backend = ServeBackend(replicas, poison, deployed)
        # The runs of a shared fleet outlive this process in the bucket (`deployments.control.tenancy`).
        records = RunRecords.from_config(cfg, bucket_url) if bucket_url else None
        runs = Runs.of(settings)
        if records is not None:
            runs.restore({name: Registration.from_record(r) for name, r in records.load().items()})
        gate = FairShare(
            settings.inflight_budget, runs.weight, RunMetrics(cfg.fleet.app_name), is_run=runs.__contains__
        )
        own = AdapterStore.at(bucket_url, cfg.bucket) if bucket_url else None  # the fleet's own policy-vN
        own_lineage = (lambda: own.latest() is not None) if own is not None else None
        routes = route_factories(cfg.fleet.routes)  # the fleet's own (`fleet.routes`), beside the shipped ones
        self._app = make_app(self._backend, settings, runs, records, gate, own_lineage, routes)
        # What the fleet does not answer, Serve's proxy does (the cluster's other apps), or another app's own door.
        self._forward = ForwardUnmatched(self._app, door.proxy_url) if door is not None else None
        self._door = None
        if door is not None and door.port is not None:
            self._door = FrontDoor(self._forward, door.host, door.port, max_connections=door.max_connections)
        log.info(
            "fleet ingress up: base model %s, router %s, admin token %s",
            base_model,
            request_router or "default",
            "set" if token else "not set",
        )

    def __serve_build_asgi_app__(self):
        return self._app

    async def front_door(self, wait_s: float = 30.0) -> str | None:
        """The URL of the fleet's front door once it is open (waiting up to `wait_s` for it); None: there is none, or
        it did not open, and the fleet answers at Serve's proxy alone."""
        return await self._door.opened(wait_s) if self._door is not None else None

    async def open_door(self, prefix: str, url: str, ttl_s: float) -> None:
        """Another Serve application's own door on loopback (the Tinker service's): the fleet's door hands it the paths
        under `prefix` for `ttl_s` seconds instead of Serve's proxy (`deployments.ingress.front_door`). A handle call:
        only a member of the cluster can make it."""
        if self._forward is not None:
            self._forward.open_door(prefix, url, ttl_s)

    def __del__(self):
        if getattr(self, "_door", None) is not None:
            self._door.stop()

    def replica_draining(self, replica_id: str, draining: bool = True) -> None:
        """A replica's node is going (it says so itself, `deployments.replica.notices`): route nothing more to it;
        `draining` False: the node outlived the notice, route to it again."""
        mark_draining(replica_id, draining)

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """`POST /v1/load_lora_adapter` for a DeploymentHandle caller: on every live replica or none."""
        try:
            return await load_everywhere(self._backend, name, path)
        except ApiError as e:  # its (status, message) constructor does not survive pickling back to the caller
            raise RuntimeError(f"{e.status} {e.message}") from None
