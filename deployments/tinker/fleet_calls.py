"""What the Tinker API asks of the fleet beside it, over the fleet's own HTTP API, with the tenant's run token.

Going through the fleet's front door (not around it) keeps every rule of a shared fleet in force for Tinker tenants:
the token decides which run a request is (`deployments.api.callers`), a run samples only the base model and its own
lineage, its generations count against its fair share, and the prefix router places them. An API key is `tml-` and a
run token (`contracts.tinker.API_KEY_PREFIX`): the run is learnt from the fleet (`GET /v1/runs` answers a run's token
with its own name); `deployments.tinker.tenants` remembers it, for a bounded time. Each tenant's samples go in its own
lane (`deployments.tinker.lanes`), so one tenant's flood never queues another's before the fleet's fair share.

The calls go out through aiohttp, not httpx: a cookbook RL step's 128 single-sample requests in flight at once cost
httpx's connection pool seconds of this process's CPU (4.6 s against 0.3 s for the same 128 through aiohttp, on
`make serve`'s fleet, issue 46), and this one event loop also answers every tenant's requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from contracts.tinker import API_KEY_PREFIX, Lineage
from deployments.control.coalesce import Coalescer, Merged
from deployments.tinker.lanes import Lanes
from deployments.tinker.merging import Body, CompletionBodies


class FleetRefused(Exception):
    """The fleet answered a 4xx/5xx: its status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Tenant:
    """A caller of the Tinker API: its run of the fleet and the run's token."""

    run: str
    token: str


class FleetCalls:
    def __init__(
        self,
        fleet_url: str,
        cache_dir: str,
        timeout_s: float = 300.0,
        lane: int = 64,
        merge_window_s: float = 0.0,
        max_samples: int = 256,
    ):
        """`lane`: sample requests each tenant has in flight to the fleet at once (`Lanes`); the connection pool is
        unbounded, so it is never the queue that tenants share. Like sample requests of a tenant within
        `merge_window_s` are one call of at most `max_samples` (`deployments.tinker.merging`)."""
        self.merging: Coalescer[Body, Body] = Coalescer(merge_window_s, max_samples, kind=CompletionBodies())
        self._fleet_url = fleet_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None  # made on the event loop that uses it, at its first call
        self.cache_dir = cache_dir
        self.lanes = Lanes(lane)
        self._lineages: dict[str, Lineage] = {}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0)  # unbounded: the lanes are the bound
            # No cookie jar: the one session carries every tenant's calls.
            jar = aiohttp.DummyCookieJar()
            self._http = aiohttp.ClientSession(
                timeout=self._timeout, connector=connector, cookie_jar=jar, trust_env=False
            )
        return self._http

    async def _call(self, method: str, path: str, token: str, json_body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {token}"}
        # A call without a body declares no Content-Type (aiohttp's default is octet-stream), as the fleet's admin
        # calls ask (`deployments.api.callers.require_json`).
        bare = () if json_body is not None else ("Content-Type",)
        url = self._fleet_url + path
        try:
            async with self._session().request(
                method, url, headers=headers, json=json_body, skip_auto_headers=bare
            ) as response:
                status, body = response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise FleetRefused(503, f"the fleet did not answer {path}: {type(exc).__name__}") from None
        if status >= 400:
            try:
                message = json.loads(body)["error"]["message"]
            except Exception:  # noqa: BLE001 - whatever the body, its text says it
                message = body[:500].decode(errors="replace")
            raise FleetRefused(status, message)
        return json.loads(body)

    async def tenant(self, api_key: str | None) -> Tenant | None:
        """The tenant an API key belongs to as the fleet says now, or None (no key, not `tml-`, not a run's token)."""
        if not api_key or not api_key.startswith(API_KEY_PREFIX):
            return None
        token = api_key[len(API_KEY_PREFIX) :]
        try:
            runs = (await self._call("GET", "/v1/runs", token))["runs"]
        except FleetRefused as refused:
            if refused.status in (401, 403):
                return None
            raise
        if len(runs) != 1:  # the admin's token lists every run: it is no tenant
            return None
        return Tenant(runs[0], token)

    async def heartbeat(self, tenant: Tenant) -> float:
        """The tenant's run is alive (`POST /v1/runs/NAME/heartbeat`): the fleet's idle timeout, in seconds."""
        return float((await self._call("POST", f"/v1/runs/{tenant.run}/heartbeat", tenant.token))["idle_timeout_s"])

    async def registered(self, admin_token: str, run: str) -> bool:
        """Whether `run` is still one of the fleet's runs (its key not revoked), as the admin sees it now."""
        try:
            await self._call("GET", f"/v1/runs/{run}", admin_token)
        except FleetRefused as refused:
            if refused.status == 404:
                return False
            raise
        return True

    def forget(self, run: str) -> None:
        """Drop what is kept of `run` (its lineage): a run registered again under its name is asked afresh."""
        self._lineages.pop(run, None)

    async def register(self, admin_token: str, name: str, lora_rank: int | None) -> str:
        """A new tenant (a run of the fleet) by the admin; its API key."""
        body: dict[str, Any] = {"name": name}
        if lora_rank is not None:
            body["lora_rank"] = lora_rank
        answer = await self._call("POST", "/v1/runs", admin_token, json_body=body)
        return API_KEY_PREFIX + answer["token"]

    async def lineage(self, tenant: Tenant) -> Lineage:
        """Where the tenant's versions go and the key they are signed with, as the fleet says."""
        lineage = self._lineages.get(tenant.run)
        if lineage is None:
            info = await self._call("GET", f"/v1/runs/{tenant.run}", tenant.token)
            key = await self._call("GET", "/v1/signing_key", tenant.token)
            lineage = Lineage(info["bucket_url"], key["key"], tenant.run, self.cache_dir)
            self._lineages[tenant.run] = lineage
        return lineage

    async def load_adapter(self, tenant: Tenant, name: str, path: str) -> None:
        await self._call(
            "POST", "/v1/load_lora_adapter", tenant.token, json_body={"lora_name": name, "lora_path": path}
        )

    async def completions(self, tenant: Tenant, body: Body) -> Body:
        """A generation, merged with like ones of the tenant (`deployments.tinker.merging`), in the tenant's own lane:
        behind its own samples only, never another tenant's."""

        async def send(call: list[Merged[Body]]) -> list[Body | Exception]:
            async with self.lanes.of(tenant.run):
                return [await self._call("POST", "/v1/completions", tenant.token, json_body=call[0].request)]

        return await self.merging.generate(tenant.run, body, send)

    async def models(self, token: str) -> list[str]:
        return [m["id"] for m in (await self._call("GET", "/v1/models", token))["data"]]
