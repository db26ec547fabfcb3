"""The runs of a shared fleet over HTTP: `/v1/runs` (register, list), `/v1/runs/NAME` (what a joining run needs
to know, remove), `/v1/runs/NAME/heartbeat`, `/v1/signing_key` (the key a lineage signs its versions with).

The admin registers and removes runs; a run's token sees and keeps alive only its own. Like the admin calls,
they need a token whenever one is set, and are never for browsers (`require_json`). What registering and
removing do to the bucket and the replicas is `deployments.control.tenancy`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from contracts.auth import Secret, lineage_key
from deployments.api.bodies import RequestLimits, RunBody
from deployments.api.callers import Callers
from deployments.api.intake import read_json
from deployments.api.routing import Routes, route
from deployments.control.errors import ApiError
from deployments.control.tenancy import Tenancy


class RunRoutes(Routes):
    def __init__(self, callers: Callers, tenancy: Tenancy, limits: RequestLimits, signing: Secret):
        self.callers, self.tenancy, self.limits, self.signing = callers, tenancy, limits, signing
        self.runs = tenancy.runs

    @route("POST", "/v1/runs")
    async def register_run(self, request: Request) -> dict[str, Any]:
        self.callers.authorize(request, admin_call=True).check_admin("registering a run")
        body = await read_json(request, RunBody, self.limits)
        token = await self.tenancy.register(body.name, body.weight, body.max_staleness, body.lora_rank, body.lineages)
        return {"name": body.name, "token": token, **self.run_terms(body.name)}

    @route("GET", "/v1/runs")
    async def list_runs(self, request: Request) -> dict[str, Any]:
        """Every run for the admin; a run's token sees only its own (which is how a driver learns whose it is)."""
        caller = self.callers.authorize(request, admin_call=True)
        if caller.admin:
            return {"runs": self.runs.names()}
        return {"runs": [caller.run] if caller.run else []}

    @route("GET", "/v1/runs/{name}")
    async def run_info(self, request: Request, name: str) -> dict[str, Any]:
        """What a run joining the fleet needs to know: where to publish (its prefix of the fleet's bucket, the
        only place the fleet loads its adapters from) and how long it may stay silent."""
        self.callers.authorize(request, admin_call=True).check_run(name, "may see only its own run")
        if name not in self.runs.names():
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        return {
            "name": name,
            "bucket_url": self.tenancy.bucket_url(name),
            "idle_timeout_s": self.runs.idle_timeout_s,
            **self.run_terms(name),
        }

    def run_terms(self, name: str) -> dict[str, Any]:
        """What run `name` registered with, as the fleet applies it: weight, staleness window, LoRA rank, and the
        lineages whose windows it pins."""
        return {
            "weight": self.runs.weight(name),
            "max_staleness": self.runs.window(name) - 1,
            "lora_rank": self.runs.registration(name).lora_rank,
            "lineages": self.runs.lineages(name),
        }

    @route("DELETE", "/v1/runs/{name}")
    async def remove_run(self, request: Request, name: str) -> dict[str, Any]:
        """Forget the run (its token stops working at once) and unload its adapters everywhere."""
        self.callers.authorize(request, admin_call=True).check_admin("removing a run")
        return {"status": "removed", "name": name, "unloaded": await self.tenancy.remove(name)}

    @route("GET", "/v1/signing_key")
    async def signing_key(self, request: Request) -> dict[str, Any]:
        """The key the caller's lineage signs its versions with (`contracts.auth.lineage_key`): a run's token gets its
        run's, the admin the fleet's own lineage's (or, `?run=NAME`, that run's). Replicas load only versions that
        verify under the key of the lineage they claim."""
        caller = self.callers.authorize(request, admin_call=True)
        run = request.query_params.get("run") or caller.run
        if run is not None:
            caller.check_run(run, "may have only its own run's key")
            if run not in self.runs.names():
                raise ApiError(404, f"run {run[:64]!r} is not registered")
        return {"run": run, "key": lineage_key(self.signing, run).value}

    @route("POST", "/v1/runs/{name}/heartbeat")
    async def run_heartbeat(self, request: Request, name: str) -> dict[str, Any]:
        """A run that is alive but sends nothing else for a while (a long learner step) says so here."""
        self.callers.authorize(request, admin_call=True).check_run(name, "keeps only its own run alive")
        self.runs.heartbeat(name)
        return {"name": name, "idle_timeout_s": self.runs.idle_timeout_s}
