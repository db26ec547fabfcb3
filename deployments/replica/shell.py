"""A replica of the fleet: one vLLM engine per Ray Serve replica, serving the base model and LoRA versions from the
bucket.

The learner never talks to an engine directly. It publishes `policy-v{N}` to the bucket and asks
the fleet to load it; each replica pulls the verified folder (`deployments.replica.adapter_sources`) and adds it
to its engine. Because the bucket is the durable record, a replica that starts or restarts (a spot
machine came back) loads the newest `max_staleness + 1` committed versions before it reports
healthy, and a request for a committed version it somehow missed (published while it was starting)
loads it on the spot: nobody has to remember to tell a new replica anything.

Generations arrive as `contracts.serving.GenerateRequest`s and admin calls as `contracts.control`
commands; failures leave as `ReplicaError`s, whose HTTP status the ingress answers with. A replica's node
may be going (a spot notice): it then takes no new work and hands its unfinished generations back
(`deployments.replica.notices`, `deployments.replica.inflight`). A run may cut its generations in flight under older
versions (`CutGenerations`, partial rollouts): the replica aborts them in vLLM, and each answers its caller at
once with the tokens it had. Two classes, as
vLLM splits its `EngineCore` from the process that hosts it: `Replica` is the request path and the
control calls over its parts (the engine, `deployments.replica.engine`; the LoRA slots,
`deployments.replica.adapter_slots`), built from them and unit-tested with a stand-in engine; `VLLMReplica` is
what Serve hosts: it reads the fleet config, starts the parts and answers Serve's hooks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from contracts.auth import Secret
from contracts.control import (
    CacheReset,
    Command,
    Cut,
    CutGenerations,
    DescribeEngine,
    EngineReport,
    ForgetRun,
    HandBack,
    HandedBack,
    ListAdapters,
    LoadAdapter,
    Pause,
    PauseState,
    Ping,
    Pong,
    ReplicaTables,
    ReportEngine,
    ResetPrefixCache,
    Resume,
    UndoLoad,
    UnloadAdapter,
)
from contracts.serving import (
    ABORTED,
    INGRESS_DEPLOYMENT,
    PAUSE_MODES,
    BadRequest,
    EngineDied,
    GenerateBundle,
    Generated,
    GenerateRequest,
    ReplicaError,
    ReplicaUnavailable,
    SampledChoice,
    Sampling,
)
from core.config import FleetConfig
from deployments.replica.adapter_slots import AdapterSlots
from deployments.replica.adapter_sources import AdapterSources
from deployments.replica.engine import Engine, sampling_params
from deployments.replica.inflight import InFlight
from deployments.replica.notices import ReplicaNotices
from deployments.replica.warm_start import adapters_to_serve

log = logging.getLogger("ray.serve")


def unstarted(sampling: Sampling, handed_back: bool) -> list[SampledChoice]:
    """The answer of a generation cut before it reached the engine: handed back, no choice (the ingress sends the
    whole request elsewhere); cut by its run (partial rollouts), each of its choices with no token, finish reason
    `ABORTED` (the run continues each under its newest version)."""
    if handed_back:
        return []
    logprobs = [] if sampling.logprobs is not None else None
    top = [] if (sampling.logprobs or 0) > 0 else None
    return [SampledChoice(i, [], logprobs, top, ABORTED, None) for i in range(sampling.n)]


def _the_requests_own(failure: BaseException) -> bool:
    """A failure of the request (refused, aborted as asked), not of the replica, which would fail it anywhere."""
    return isinstance(failure, ReplicaError) and not isinstance(failure, ReplicaUnavailable | EngineDied)


class Replica:
    """Replica `replica_id`'s generations and control calls, over its `engine` and the adapter `slots` in it.

    A `/pause` holds the engine for at most `pause_lease_s`."""

    def __init__(self, replica_id: str, engine: Engine, slots: AdapterSlots, pause_lease_s: float):
        self.replica_id, self.engine, self.slots, self.pause_lease_s = replica_id, engine, slots, pause_lease_s
        self._pause_lease: asyncio.Task | None = None
        self.inflight = InFlight(engine)
        self.notices: ReplicaNotices | None = None  # watching its node: `VLLMReplica`

    async def generate(self, request: GenerateRequest) -> Generated:
        """Sample completions of a token-id prompt under `request.model`, the base model's name or an adapter's."""
        self._check_engine()
        if self.notices is not None:
            self.notices.check_accepting()
        params = sampling_params(request.sampling)  # first: a request vLLM refuses loads no adapter
        with self.inflight.track(request.model, request.sampling.n) as request_id:
            async with self.slots.use(request.model) as lora:
                if self.inflight.start(request_id):
                    choices = await self.engine.sample(request.prompt_ids, params, lora, request_id)
                else:  # cut or handed back while it waited for its adapter: nothing sampled
                    choices = unstarted(request.sampling, self.inflight.was_handed_back(request_id))
                    return Generated(self.replica_id, choices, handed_back=not choices)
            handed_back = self.inflight.was_handed_back(request_id)
        if choices is None:  # aborted before any output, e.g. by /pause?mode=abort
            # 503 but not ReplicaUnavailable: the abort was asked for, so the ingress must not send it elsewhere.
            raise ReplicaError(f"replica {self.replica_id}: the request was aborted", 503)
        return Generated(self.replica_id, choices, handed_back)

    async def generate_bundle(self, bundle: GenerateBundle) -> list[Generated | ReplicaError]:
        """Each request of `bundle` sampled as a request of its own, all at once, in one call: each one's answer, or
        its own failure (a 400, an abort asked for). A failure of the replica (its node going, its engine dead) fails
        the whole call, as it would each request alone, so that the ingress sends them elsewhere."""
        self._check_engine()
        if self.notices is not None:
            self.notices.check_accepting()
        answers = await asyncio.gather(*(self.generate(r) for r in bundle.requests), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not _the_requests_own(answer):
                raise answer
        return answers

    async def control(self, command: Command) -> Any:
        """Every admin call of the ingress (`contracts.control`): the command's typed reply."""
        match command:
            case Ping():
                self._check_engine()
                return Pong(self.replica_id)
            case ListAdapters():
                return self.slots.listing()
            case LoadAdapter(name=name, ref=ref, load_id=load_id):
                return await self.slots.load(name, ref, load_id)
            case UndoLoad(name=name, load_id=load_id):
                return await self.slots.undo_load(name, load_id)
            case UnloadAdapter(name=name):
                return await self.slots.unload(name)
            case ForgetRun(run=run):
                return await self.slots.forget_run(run)
            case Pause(mode=mode):
                return await self.pause(mode)
            case Resume():
                return await self.resume()
            case HandBack():
                return HandedBack(self.replica_id, await self.inflight.hand_back())
            case CutGenerations(models=models):
                return Cut(self.replica_id, await self.inflight.cut(models))
            case ResetPrefixCache():
                return CacheReset(self.replica_id, await self.engine.reset_prefix_cache())
            case ReportEngine():
                return await self._report()
            case DescribeEngine():
                return self.engine.config_json()
        raise BadRequest(f"unknown control command {type(command).__name__}")

    def _check_engine(self) -> None:
        """A replica whose engine is dead serves nothing: the ingress tries another one (`/health` counts it out)."""
        if self.engine.errored:
            raise ReplicaUnavailable(f"replica {self.replica_id}: engine is dead")

    async def pause(self, mode: str) -> PauseState:
        """Stop scheduling. `keep` freezes in-flight requests until resume (what TRL asks for).

        A pause is a lease of `pause_lease_s`: a client that paused and vanished (or died before
        its /resume) cannot hold every other client of the fleet up for longer. Pausing again renews it.
        The replica holds the lease itself, so it expires even if the ingress that passed it on is gone.
        """
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode {str(mode)[:20]!r}: expected one of {', '.join(PAUSE_MODES)}")
        await self.engine.pause(mode)
        lease_s = self.pause_lease_s
        self._end_pause_lease()
        self._pause_lease = asyncio.get_running_loop().create_task(self._expire_pause(lease_s))
        return PauseState(self.replica_id, paused=True, lease_s=lease_s)

    async def _expire_pause(self, lease_s: float) -> None:
        await asyncio.sleep(lease_s)
        self._pause_lease = None
        log.warning("replica %s: paused %.0fs without a /resume (lease expired): resuming", self.replica_id, lease_s)
        await self.engine.resume()

    def _end_pause_lease(self) -> None:
        lease, self._pause_lease = self._pause_lease, None
        if lease is not None:
            lease.cancel()

    async def resume(self) -> PauseState:
        self._end_pause_lease()
        await self.engine.resume()
        return PauseState(self.replica_id, paused=False)

    async def _report(self) -> EngineReport:
        cached_versions, cache_bytes = await self.slots.sources.cache_usage()
        return EngineReport(
            replica=self.replica_id,
            pid=os.getpid(),  # the replica's process; its engines run in child processes
            paused=await self.engine.is_paused(),
            counters=self.engine.counters.snapshot(),
            adapters=self.slots.names,
            # vLLM's own count: equal to ours (adapters + draining) unless vLLM dropped one by itself.
            engine_adapters=len(await self.engine.lora_ids()),
            draining=self.slots.draining,
            tables=ReplicaTables(**self.slots.sizes(), cached_versions=cached_versions, cache_bytes=cache_bytes),
        )


class VLLMReplica(Replica):
    """A Ray Serve deployment class: wrap with `serve.deployment` (see `deployments.fleet`)."""

    async def __init__(
        self,
        model_path: str,
        base_model: str,
        config: dict,
        bucket_url: str,
        signing_secret: Secret,
        *,
        first_rank: int = 0,
        lineage: bool = True,
    ):
        """`base_model` is the `model` name that means "no adapter"; `config` a dumped `FleetConfig`;
        `signing_secret` the fleet's, under whose lineage keys every version loaded must verify. A teacher
        deployment's replicas (`deployments.replica.teacher`) pin cores from `first_rank` on and serve no `lineage`."""
        from ray import serve

        self.cfg = cfg = FleetConfig.model_validate(config)
        fleet = cfg.fleet
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id
        started = time.monotonic()
        # Held at once, so that `__del__` shuts the engine down if what follows fails.
        self.engine = engine = Engine.start(cfg, model_path, replica_id, first_rank + context.rank.rank)
        await engine.score_at_temperature()
        sources = AdapterSources(
            bucket_url,
            cfg.bucket,
            signing_secret=signing_secret,
            window=cfg.window,
            listing_interval_s=fleet.version_listing_interval_s,
            trusted_dirs=fleet.extra_adapter_dirs,
            cache_keep=fleet.adapter_cache_keep,
            other_lineages=fleet.extra_adapter_buckets,
        )
        slots = AdapterSlots(
            replica_id,
            engine,
            sources,
            base_model=base_model,
            max_loras=cfg.max_loras,
            window=cfg.window,
            slot_wait_s=fleet.lora_slot_wait_s,
        )
        super().__init__(replica_id, engine, slots, fleet.pause_lease_s)
        # Before it takes traffic: the fleet's own versions and every registered run's, each lineage's window (a
        # teacher deployment's replicas serve no lineage).
        loaded = await adapters_to_serve(cfg, sources, bucket_url) if lineage else []
        for name, ref in loaded:
            try:
                await slots.load(name, ref)
            except ReplicaError as e:  # one that does not verify (planted), or gone meanwhile: never the replica's end
                log.warning("VLLMReplica %s: %s not loaded at start: %s", replica_id, name, e.message)
        await sources.tidy()  # what an earlier replica of this node left that nothing loaded now holds
        self.notices = ReplicaNotices(
            replica_id, self.inflight, cfg.spot, self._tell_ingress, self._serve_stops_me
        ).watch()
        log.info(
            "VLLMReplica %s ready in %.1fs (block %d, max_loras %d, CPU bind %s), adapters %s",
            replica_id,
            time.monotonic() - started,
            engine.block_size,
            cfg.max_loras,
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-"),
            [name for name, _ in loaded],
        )

    async def _tell_ingress(self, draining: bool) -> None:
        """This replica drains: the ingress's routers route nothing more to it (`deployments.replica.notices`); or,
        `draining` False, it serves again."""
        from ray import serve

        handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, self.cfg.fleet.app_name)
        await handle.replica_draining.remote(self.replica_id, draining)

    async def _serve_stops_me(self) -> bool:
        """Whether Serve's controller is stopping this replica (`deployments.replica.serve_state`)."""
        from deployments.replica.serve_state import serve_stops

        return await serve_stops(self.replica_id)

    # ---- Serve hooks ------------------------------------------------------------------------------------

    def record_replica_metadata(self) -> dict[str, Any]:
        """Published once to the router: the engine's block size and the run's routing settings."""
        router = self.cfg.fleet.router
        return {
            "router": {
                "block_size": self.engine.block_size,
                "spill_threshold": router.spill_threshold,
                "max_table_entries": router.max_table_entries,
            }
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by the router every `request_routing_stats_period_s`: a draining replica is routed nothing."""
        return {"draining": self.notices is not None and self.notices.draining}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the fleet autoscales on (`deployments.autoscaling`): sequences in flight, running or waiting."""
        return {"sequences": float(self.inflight.sequences)}

    async def check_health(self) -> None:
        if self.engine.errored:
            raise RuntimeError(f"vLLM engine of replica {self.replica_id} is dead: {self.engine.dead_error}")

    def __del__(self):
        notices = getattr(self, "notices", None)
        if notices is not None:
            notices.stop()
        engine = getattr(self, "engine", None)  # None when the engine failed to start
        if engine is not None:
            engine.shutdown()
