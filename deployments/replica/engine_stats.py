"""What a replica's engine counts as it runs: vLLM's metrics to Ray, and the same numbers in-process.

vLLM's engine metrics reach Ray's metrics export through vLLM's own `RayPrometheusStatLogger` (tagged with the
Serve replica id), but for one gauge (`ray_stat_logger`); `EngineCounters` keeps the same numbers in-process for
`GET /engine/stats` and the benchmarks. vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineCounters:
    """Cumulative engine numbers from vLLM's stat records (vLLM's own counting, kept in-process).

    Fed by the stat logger `stat_logger` makes: after every step the engine reports the
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


def ray_stat_logger():
    """vLLM's `RayPrometheusStatLogger` without its `vllm:lora_requests_info` gauge, whose labels are the names of the
    adapters running and waiting at each step: a new series for every set of names ever seen together, kept by the
    replica's metrics for good, so on a fleet whose runs (and their versions) come and go for weeks its memory, and
    Prometheus's, would grow without end. `/engine/stats` and `/v1/models` name the adapters instead."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    class RayStatLoggerOfBoundedSeries(RayPrometheusStatLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gauge_lora_info = None  # vLLM sets it only when not None

    return RayStatLoggerOfBoundedSeries


def stat_logger(counters: EngineCounters):
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
