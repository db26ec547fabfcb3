"""vLLM's admin calls, applied to every live replica or to none: `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/pause`, `/resume`, `/reset_prefix_cache`; and `/v1/cut`, which cuts the
generations in flight under some adapters on every replica (`deployments.control.cut`).

Always behind a set token, and never from a browser (`deployments.api.callers.require_json`). A run's token
may load, unload and cut its own adapters; pausing, resuming and resetting the prefix cache stop or change every
run's work, so they need the admin's.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from contracts.control import ResetPrefixCache, Resume, UnloadAdapter
from contracts.serving import PAUSE_MODES
from deployments.api.bodies import CutBody, LoadAdapterBody, RequestLimits, UnloadAdapterBody
from deployments.api.callers import Callers
from deployments.api.intake import read_json
from deployments.api.routing import Routes, route
from deployments.control.backend import Backend
from deployments.control.broadcast import everywhere, load_everywhere, pause_everywhere
from deployments.control.cut import cut_everywhere
from deployments.control.errors import ApiError


class AdminRoutes(Routes):
    def __init__(self, callers: Callers, backend: Backend, limits: RequestLimits):
        self.callers, self.backend, self.limits = callers, backend, limits

    @route("POST", "/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> dict[str, Any]:
        caller = self.callers.authorize(request, admin_call=True)
        body = await read_json(request, LoadAdapterBody, self.limits)
        caller.check_owns(body.lora_name)
        if body.load_inplace:
            raise ApiError(400, "load_inplace: not supported; publish a new version under a new name")
        return await load_everywhere(self.backend, body.lora_name, body.lora_path)

    @route("POST", "/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> dict[str, Any]:
        caller = self.callers.authorize(request, admin_call=True)
        body = await read_json(request, UnloadAdapterBody, self.limits)
        caller.check_owns(body.lora_name)
        results = await everywhere(self.backend, UnloadAdapter(body.lora_name))
        return {
            "status": "ok",
            "lora_name": body.lora_name,
            "replicas": len(results),
            "unloaded": sum(r.unloaded for r in results),
        }

    @route("POST", "/v1/cut")
    async def cut(self, request: Request) -> dict[str, Any]:
        """`{"models": [...]}`: cut the generations in flight under these adapters; each answers its caller at once
        with finish reason `abort` and the tokens it had."""
        caller = self.callers.authorize(request, admin_call=True)
        models = (await read_json(request, CutBody, self.limits)).checked_models()
        for model in models:
            caller.check_owns(model)
        return await cut_everywhere(self.backend, models)

    @route("POST", "/pause")
    async def pause(self, request: Request, mode: str = "keep") -> dict[str, Any]:
        self.callers.authorize(request, admin_call=True).check_admin("pausing the fleet")
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"mode: expected one of {', '.join(PAUSE_MODES)}")
        results = await pause_everywhere(self.backend, mode)
        # Each replica resumes by itself after its lease (`VLLMReplica.pause`) unless /resume comes first.
        lease_s = min((r.lease_s for r in results if r.lease_s is not None), default=None)
        return {"status": "paused", "mode": mode, "replicas": len(results), "lease_s": lease_s}

    @route("POST", "/resume")
    async def resume(self, request: Request) -> dict[str, Any]:
        self.callers.authorize(request, admin_call=True).check_admin("resuming the fleet")
        return {"status": "resumed", "replicas": len(await everywhere(self.backend, Resume()))}

    @route("POST", "/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> dict[str, Any]:
        self.callers.authorize(request, admin_call=True).check_admin("resetting the prefix cache")
        results = await everywhere(self.backend, ResetPrefixCache())
        return {"success": all(r.success for r in results), "replicas": len(results)}
