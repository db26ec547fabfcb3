"""The fair share's per-run counts as Ray metrics (Prometheus via Ray's metrics export), tagged by run.

The gate (`deployments.control.fair_share`) tells them as they change: requests, tokens, queue waits,
places in flight and waiting; the LoRA slots a run holds come from the ingress's upkeep
(`deployments.control.upkeep`), which lists the replicas' adapters every few seconds. Places are counted in
sequences (a generation of `n` completions holds `n`).

Nothing is kept here per run: the tags are made on each call. Ray's metrics agent keeps a series per run tag
value, and Ray has no call to drop one: a run that leaves has its gauges set to 0 (`forget`), so that no chart
shows places or slots of a run long gone.
"""

from __future__ import annotations

# Queue waits, seconds: from "admitted at once" to "waited behind a long burst".
WAIT_BOUNDARIES_S = [0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]


class RunMetrics:
    """One Ray metric per count, tagged by application and run."""

    def __init__(self, application: str):
        from ray.util import metrics

        tags = ("application", "run")
        self._application = application
        self._requests = metrics.Counter(
            "spotrl_fleet_run_requests", description="Generations admitted for the run.", tag_keys=tags
        )
        self._prompt_tokens = metrics.Counter(
            "spotrl_fleet_run_prompt_tokens", description="Prompt tokens of the run's generations.", tag_keys=tags
        )
        self._completion_tokens = metrics.Counter(
            "spotrl_fleet_run_completion_tokens", description="Tokens generated for the run.", tag_keys=tags
        )
        self._wait = metrics.Histogram(
            "spotrl_fleet_run_queue_wait_s",
            description="Seconds a generation of the run waited for a place in the fleet.",
            boundaries=WAIT_BOUNDARIES_S,
            tag_keys=tags,
        )
        self._in_flight = metrics.Gauge(
            "spotrl_fleet_run_in_flight", description="The run's sequences in flight.", tag_keys=tags
        )
        self._queued = metrics.Gauge(
            "spotrl_fleet_run_queued", description="The run's sequences waiting for places.", tag_keys=tags
        )
        self._slots = metrics.Gauge(
            "spotrl_fleet_run_slots_held",
            description="LoRA slots the run's adapters hold on the fullest engine.",
            tag_keys=tags,
        )

    def _tags(self, run: str) -> dict[str, str]:
        return {"application": self._application, "run": run}

    def waited(self, run: str, wait_s: float, requests: int = 1) -> None:
        self._requests.inc(requests, self._tags(run))
        self._wait.observe(wait_s, self._tags(run))

    def used(self, run: str, prompt_tokens: int, completion_tokens: int) -> None:
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens, self._tags(run))
        if completion_tokens:
            self._completion_tokens.inc(completion_tokens, self._tags(run))

    def places(self, run: str, in_flight: int, queued: int) -> None:
        tags = self._tags(run)
        self._in_flight.set(in_flight, tags)
        self._queued.set(queued, tags)

    def slots(self, run: str, held: int) -> None:
        self._slots.set(held, self._tags(run))

    def forget(self, run: str) -> None:
        """Run `run` left the fleet: its gauges go to 0 (Ray keeps the series, with that last value)."""
        self.places(run, 0, 0)
        self.slots(run, 0)
