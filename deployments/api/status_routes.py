"""What the fleet says of itself, read-only: `/health`, `/server_info`, `/router/stats`, `/engine/stats`.

Reading changes nothing: no handler here stores what it found or counts as a run's sign of life (the slots
gauges are refreshed by `deployments.control.upkeep`). A run's token sees its own adapters and counters only.
`/server_info` also counts what the ingress keeps per run and per request (`spotrl.ingress`), `/engine/stats` what
each replica keeps (`tables`): on a fleet up for weeks, neither grows with the runs that came and went.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from fastapi import Request

from contracts.control import ReportEngine
from deployments.api.callers import Callers
from deployments.api.routing import Routes, route
from deployments.api.settings import ApiSettings
from deployments.control.backend import Backend
from deployments.control.broadcast import everywhere, slots_held
from deployments.control.errors import ApiError
from deployments.control.fair_share import FairShare
from deployments.control.membership import Membership
from deployments.control.runs import Runs
from deployments.control.tables import ingress_tables


class StatusRoutes(Routes):
    def __init__(
        self,
        settings: ApiSettings,
        callers: Callers,
        backend: Backend,
        membership: Membership,
        gate: FairShare,
        runs: Runs,
    ):
        self.settings, self.callers, self.backend = settings, callers, backend
        self.membership, self.gate, self.runs = membership, gate, runs

    @route("GET", "/health")
    async def health(self) -> dict[str, Any]:
        # Never behind the token: load balancers and `wait_healthy` probe it.
        return {"status": "ok", "replicas": await self.membership.live()}

    @route("GET", "/server_info")
    async def server_info(self, request: Request, config_format: str = "text") -> dict[str, Any]:
        self.callers.authorize(request)
        if config_format not in ("text", "json"):
            raise ApiError(400, "config_format: expected text or json")
        info = await self.backend.server_info()
        return {
            "vllm_config": info if config_format == "json" else json.dumps(info),
            "spotrl": {
                "num_replicas": await self.membership.live(),
                "autoscaling": self.membership.autoscaling(),
                "base_model": self.settings.base_model,
                "base_fingerprint": self.settings.base_fingerprint,
                "bucket_url": self.settings.bucket_url,
                # What the ingress keeps per run and per request, counted (`deployments.control.tables`).
                "ingress": asdict(ingress_tables(self.runs, self.gate, self.backend)),
            },
        }

    @route("GET", "/router/stats")
    async def router_stats(self, request: Request) -> dict[str, Any]:
        """The router's counters, and under `runs` the fair share's per run (a run's token sees its own only)."""
        caller = self.callers.authorize(request)
        # The router's counters are worth answering even when a replica cannot list its adapters right now.
        fair = self.gate.stats(await slots_held(self.backend))
        if not caller.admin:
            fair["runs"] = {name: s for name, s in fair["runs"].items() if name == caller.tenant}
        return {**self.backend.router_stats(), "runs": fair}

    @route("GET", "/engine/stats")
    async def engine_stats(self, request: Request) -> dict[str, Any]:
        caller = self.callers.authorize(request)
        reports = await everywhere(self.backend, ReportEngine())
        base = self.settings.base_model
        replicas = [report.as_json() for report in reports]
        for stats in replicas:  # other runs' adapter names are theirs
            stats["adapters"] = [a for a in stats["adapters"] if caller.may_use(a, base)]
        return {"replicas": replicas}
