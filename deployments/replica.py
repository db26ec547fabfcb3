"""A replica of the fleet: one vLLM engine per Ray Serve replica, serving the base model and LoRA versions from the
bucket.

The learner never talks to an engine directly. It publishes `policy-v{N}` to the bucket and asks
the fleet to load it; each replica pulls the verified folder (`deployments.adapter_sources`) and adds it
to its engine. Because the bucket is the durable record, a replica that starts or restarts (a spot
machine came back) loads the newest `max_staleness + 1` committed versions before it reports
healthy, and a request for a committed version it somehow missed (published while it was starting)
loads it on the spot: nobody has to remember to tell a new replica anything.

Generations arrive as `contracts.serving.GenerateRequest`s and admin calls as `contracts.control`
commands; failures leave as `ReplicaError`s, whose HTTP status the ingress answers with. Two classes, as
vLLM splits its `EngineCore` from the process that hosts it: `Replica` is the request path and the
control calls over its parts (the engine, `deployments.engine`; the LoRA slots,
`deployments.adapter_slots`), built from them and unit-tested with a stand-in engine; `VLLMReplica` is
what Serve hosts: it reads the fleet config, starts the parts and answers Serve's hooks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from app.config import FleetConfig
from contracts.adapters import adapter_name
from contracts.control import (
    CacheReset,
    Command,
    DescribeEngine,
    EngineReport,
    ListAdapters,
    LoadAdapter,
    Pause,
    PauseState,
    Ping,
    Pong,
    ReportEngine,
    ResetPrefixCache,
    Resume,
    UndoLoad,
    UnloadAdapter,
)
from contracts.serving import PAUSE_MODES, BadRequest, Generated, GenerateRequest, ReplicaError, ReplicaUnavailable
from deployments.adapter_slots import AdapterSlots
from deployments.adapter_sources import AdapterSources
from deployments.engine import Engine, sampling_params

log = logging.getLogger("ray.serve")


class Replica:
    """Replica `replica_id`'s generations and control calls, over its `engine` and the adapter `slots` in it.

    A `/pause` holds the engine for at most `pause_lease_s`."""

    def __init__(self, replica_id: str, engine: Engine, slots: AdapterSlots, pause_lease_s: float):
        self.replica_id, self.engine, self.slots, self.pause_lease_s = replica_id, engine, slots, pause_lease_s
        self._pause_lease: asyncio.Task | None = None

    async def generate(self, request: GenerateRequest) -> Generated:
        """Sample completions of a token-id prompt under `request.model`, the base model's name or an adapter's."""
        self._check_engine()
        params = sampling_params(request.sampling)  # first: a request vLLM refuses loads no adapter
        async with self.slots.use(request.model) as lora:
            choices = await self.engine.sample(request.prompt_ids, params, lora)
        if choices is None:  # aborted before any output, e.g. by /pause?mode=abort
            # 503 but not ReplicaUnavailable: the abort was asked for, so the ingress must not send it elsewhere.
            raise ReplicaError(f"replica {self.replica_id}: the request was aborted", 503)
        return Generated(self.replica_id, choices)

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
            case Pause(mode=mode):
                return await self.pause(mode)
            case Resume():
                return await self.resume()
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
        return EngineReport(
            replica=self.replica_id,
            pid=os.getpid(),  # the replica's process; its engines run in child processes
            paused=await self.engine.is_paused(),
            counters=self.engine.counters.snapshot(),
            adapters=self.slots.names,
            # vLLM's own count: equal to ours (adapters + draining) unless vLLM dropped one by itself.
            engine_adapters=len(await self.engine.lora_ids()),
            draining=self.slots.draining,
        )


class VLLMReplica(Replica):
    """A Ray Serve deployment class: wrap with `serve.deployment` (see `deployments.fleet`)."""

    async def __init__(
        self,
        model_path: str,
        base_model: str,
        config: dict,
        bucket_url: str,
        *,
        first_rank: int = 0,
        lineage: bool = True,
    ):
        """`base_model` is the `model` name that means "no adapter"; `config` a dumped `FleetConfig`. A teacher
        deployment's replicas (`deployments.teacher`) pin cores from `first_rank` on and serve no `lineage`."""
        from ray import serve

        self.cfg = cfg = FleetConfig.model_validate(config)
        fleet = cfg.fleet
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id
        started = time.monotonic()
        # Held at once, so that `__del__` shuts the engine down if what follows fails.
        self.engine = engine = Engine.start(cfg, model_path, replica_id, first_rank + context.rank.rank)
        sources = AdapterSources(
            bucket_url,
            cfg.bucket,
            window=cfg.window,
            listing_interval_s=fleet.version_listing_interval_s,
            trusted_dirs=fleet.extra_adapter_dirs,
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
        # The versions the fleet serves (`app.weight_sync` decides which), oldest first.
        loaded = [adapter_name(version) for version in await sources.to_serve()] if lineage else []
        for name in loaded:
            await slots.load(name, name)
        log.info(
            "VLLMReplica %s ready in %.1fs (block %d, max_loras %d, CPU bind %s), adapters %s",
            replica_id,
            time.monotonic() - started,
            engine.block_size,
            cfg.max_loras,
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-"),
            loaded,
        )

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

    async def check_health(self) -> None:
        if self.engine.errored:
            raise RuntimeError(f"vLLM engine of replica {self.replica_id} is dead: {self.engine.dead_error}")

    def __del__(self):
        engine = getattr(self, "engine", None)  # None when the engine failed to start
        if engine is not None:
            engine.shutdown()
