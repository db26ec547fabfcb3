"""The `RestClient`'s routes over a key's saved paths: listings of checkpoints and training runs, a path's weights info,
its TTL, publishing, deletion, and download links of exports. Each reads the key's `PathRegistry` in the bucket
(`TenantPaths`), never through a learner; another key's paths are not there (404), its published ones are read-only.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import FileResponse, Response
from tinker import types

from deployments.api.routing import route
from deployments.control.errors import ApiError
from deployments.tinker.exports import LINK_TTL_S, Link, LinkGone, LinkRefused
from deployments.tinker.fleet_calls import FleetRefused, Tenant
from deployments.tinker.http import as_json, page
from deployments.tinker.paths import expiry, parsed, require_kind, route_path
from deployments.tinker.routes import TinkerRoutes

CHECKPOINT = "/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}"


class TtlRequest(pydantic.BaseModel):
    """The body `RestClient.set_checkpoint_ttl_from_tinker_path` puts (a plain dict in the SDK)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    ttl_seconds: int | None = pydantic.Field(description="Seconds from now until the checkpoint expires; None: never.")


class WeightsInfoRequest(pydantic.BaseModel):
    """The body `RestClient.get_weights_info_by_tinker_path` posts (the SDK sends a plain dict, it has no type)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    tinker_path: str = pydantic.Field(description="The saved path to describe.")


class CheckpointRoutes(TinkerRoutes):
    async def _checkpoints(self, tenant: Tenant) -> list[tuple[dict, types.Checkpoint]]:
        """The key's saved paths, newest first: each as recorded and as the SDK lists it."""
        records = await self.paths.read(tenant, "checkpoints", lambda registry: registry.checkpoints())
        listed = []
        for record in records:
            checkpoint_type = parsed(record["path"]).checkpoint_type
            expires = record.get("expires")
            checkpoint = types.Checkpoint(
                checkpoint_id=parsed(record["path"]).checkpoint_id,
                checkpoint_type=checkpoint_type,
                time=datetime.fromtimestamp(record["time"], UTC),
                tinker_path=record["path"],
                size_bytes=record.get("size_bytes"),
                public=bool(record.get("public")),
                user_metadata=record.get("user_metadata"),
                expires_at=None if expires is None else datetime.fromtimestamp(expires, UTC),
            )
            listed.append((record, checkpoint))
        return listed

    @route("GET", "/v1/checkpoints")
    async def list_user_checkpoints(self, request: Request) -> dict:
        """`RestClient.list_user_checkpoints(limit, offset)`: the key's saved states and sampler weights, newest first."""
        tenant = await self.callers.tenant(request)
        limit, offset = page(request)
        checkpoints = [checkpoint for _, checkpoint in await self._checkpoints(tenant)]
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(checkpoints))
        return as_json(types.CheckpointsListResponse(checkpoints=checkpoints[offset : offset + limit], cursor=cursor))

    @route("GET", "/v1/training_runs/{training_run_id}/checkpoints")
    async def list_checkpoints(self, request: Request, training_run_id: str) -> dict:
        """`RestClient.list_checkpoints(training_run_id)`: those of one training client (a model id); one that is not
        the key's is a 404, as `get_training_run` answers it (another key's and none at all alike)."""
        tenant = await self.callers.tenant(request)
        if training_run_id not in {r.training_run_id for r in await self._training_runs(tenant)}:
            raise ApiError(404, f"training run {training_run_id[:120]!r} does not exist for this API key")
        prefix = f"tinker://{training_run_id}/"
        checkpoints = [c for _, c in await self._checkpoints(tenant) if c.tinker_path.startswith(prefix)]
        return as_json(types.CheckpointsListResponse(checkpoints=checkpoints))

    @route("GET", "/v1/training_runs")
    async def list_training_runs(self, request: Request) -> dict:
        """`RestClient.list_training_runs(limit, offset)`: the key's training clients, those of its open sessions and
        those its saved paths name (gone ones too), the most recently used first."""
        tenant = await self.callers.tenant(request)
        limit, offset = page(request)
        runs = await self._training_runs(tenant)
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
        return as_json(types.TrainingRunsResponse(training_runs=runs[offset : offset + limit], cursor=cursor))

    @route("GET", "/v1/training_runs/{training_run_id}")
    async def get_training_run(self, request: Request, training_run_id: str) -> dict:
        """`RestClient.get_training_run(id)`: one of them; another key's is not there (404)."""
        tenant = await self.callers.tenant(request)
        run = next((r for r in await self._training_runs(tenant) if r.training_run_id == training_run_id), None)
        if run is None:
            raise ApiError(404, f"training run {training_run_id[:120]!r} does not exist for this API key")
        return as_json(run)

    async def _training_runs(self, tenant: Tenant) -> list[types.TrainingRun]:
        runs: dict[str, dict[str, Any]] = {
            m.model_id: {"rank": m.rank, "time": m.touched}
            for m in self.sessions.models.values()
            if m.tenant == tenant.run
        }
        for record, checkpoint in reversed(await self._checkpoints(tenant)):  # oldest first: the newest wins
            run = runs.setdefault(parsed(checkpoint.tinker_path).training_run_id, {"time": 0.0})
            run.setdefault("rank", record.get("rank"))
            run["time"] = max(run["time"], record["time"])
            run["sampler" if checkpoint.checkpoint_type == "sampler" else "state"] = checkpoint
        listed = [
            types.TrainingRun(
                training_run_id=run_id,
                base_model=self.settings.base_model,
                model_owner=tenant.run,
                is_lora=True,
                corrupted=False,
                lora_rank=run.get("rank"),
                last_request_time=datetime.fromtimestamp(run["time"], UTC),
                last_checkpoint=run.get("state"),
                last_sampler_checkpoint=run.get("sampler"),
            )
            for run_id, run in runs.items()
        ]
        return sorted(listed, key=lambda r: r.last_request_time, reverse=True)

    @route("POST", "/v1/weights_info")
    async def weights_info(self, request: Request) -> dict:
        """`RestClient.get_weights_info_by_tinker_path(path)`: the base model and adapter a saved path holds."""
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, WeightsInfoRequest)
        parsed(body.tinker_path)
        record = await self.paths.record(tenant, body.tinker_path)
        if record is None:
            raise ApiError(404, f"{body.tinker_path}: no such checkpoint for this API key")
        info = types.WeightsInfoResponse(
            base_model=self.settings.base_model,
            is_lora=True,
            lora_rank=record.get("rank"),
            train_attn=record.get("train_attn"),
            train_mlp=record.get("train_mlp"),
            train_unembed=False,
        )
        return as_json(info)

    @route("PUT", f"{CHECKPOINT}/ttl")
    async def set_ttl(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.set_checkpoint_ttl_from_tinker_path(path, ttl_seconds)`: the path expires that long from now
        (None: never); an expired path is gone from listings and lookups, and its files from the bucket."""
        tenant = await self.callers.tenant(request)
        path = route_path(training_run_id, checkpoint_id)
        expires = expiry((await self.parse(request, TtlRequest)).ttl_seconds)
        if not await self.paths.read(tenant, f"path {path[:200]!r}", lambda registry: registry.expire(path, expires)):
            raise ApiError(404, f"{path}: no such checkpoint for this API key")
        self.paths.forget(path)  # looked up in the bucket from now on, where its expiry is
        return {}

    @route("POST", f"{CHECKPOINT}/publish")
    async def publish(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.publish_checkpoint_from_tinker_path(path)`: every key of the fleet may now start a training client
        from it, sample it (a copy under its own lineage) or download it; only this key deletes or unpublishes it."""
        return await self._share(request, training_run_id, checkpoint_id, True)

    @route("DELETE", f"{CHECKPOINT}/publish")
    async def unpublish(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.unpublish_checkpoint_from_tinker_path(path)`: other keys can no longer reach it (copies of sampler
        weights they already sample stay theirs)."""
        return await self._share(request, training_run_id, checkpoint_id, False)

    async def _share(self, request: Request, training_run_id: str, checkpoint_id: str, public: bool) -> dict:
        tenant = await self.callers.tenant(request)
        path = route_path(training_run_id, checkpoint_id)
        await self.body(request)
        if not await self.paths.read(tenant, f"path {path[:200]!r}", lambda registry: registry.share(path, public)):
            raise ApiError(404, f"{path}: no such checkpoint of this API key (only its owner publishes it)")
        return {}

    @route("DELETE", CHECKPOINT)
    async def delete_checkpoint(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.delete_checkpoint(training_run_id, checkpoint_id)`: the saved state or sampler weights leave the
        bucket, and the path can no longer be loaded or sampled. 404 for a path this key was never given; 400 for the
        key's newest sampler weights (`PathRegistry.forget` says why; the SDK retries a 409)."""
        tenant = await self.callers.tenant(request)
        path = route_path(training_run_id, checkpoint_id)
        try:
            deleted = await self.paths.read(tenant, path, lambda registry: registry.forget(path))
        except ValueError as refused:
            raise ApiError(400, f"{path}: {refused}") from None
        if not deleted:
            raise ApiError(404, f"{path}: no such checkpoint for this API key")
        self.paths.forget(path)
        return {}

    @route("GET", f"{CHECKPOINT}/external_weights_urls")
    async def external_weights_urls(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.get_external_weights_urls(path)`: a download link per file of one of the key's exports, each
        working without the key for `LINK_TTL_S` (`deployments.tinker.exports`)."""
        tenant = await self.callers.tenant(request)
        path = route_path(training_run_id, checkpoint_id)
        parsed(path)
        record = await self.paths.record(tenant, path)  # its kind from the record, once the key may see it at all
        if record is None:
            raise ApiError(404, f"{path}: no such checkpoint for this API key")
        require_kind(record, "external", path)
        prefix = (
            record.get("prefix") or (await self.callers.lineage_now(tenant)).bucket_url
        )  # a published one's owner's
        link = Link(prefix, path, int(record["number"]), owner=record.get("prefix") is None, holder=tenant.run)
        try:
            files = await asyncio.to_thread(self.links.files, link.store_url, link.number)
        except Exception as exc:  # noqa: BLE001 - deleted meanwhile, or the bucket unreachable
            raise ApiError(503, f"{path}: the export's files could not be listed: {exc}") from None
        expires = time.time() + LINK_TTL_S
        token = self.links.sign(link, expires)
        # Back to this service, at the address the caller used (the Serve route prefix included).
        base = str(request.url).split("/v1/training_runs/", 1)[0]
        urls = {rel: f"{base}/v1/exported/{token}/{rel}" for rel in sorted(files)}
        return as_json(types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, UTC)))

    @route("GET", "/v1/exported/{token}/{name:path}")
    async def exported_file(self, token: str, name: str) -> Response:
        """A file of an export, for a signed link (no API key: the SDK downloads with a plain GET)."""
        try:
            link = self.links.check(token)
        except LinkRefused as refused:
            raise ApiError(403, str(refused)) from None
        try:
            await asyncio.to_thread(self.links.still_there, link)  # the owner's record now, not the signature, decides
        except LinkGone as gone:
            raise ApiError(404, str(gone)) from None
        except Exception as exc:  # noqa: BLE001 - the bucket unreachable
            raise ApiError(503, f"the export's record could not be read: {exc}") from None
        await self._holder_still_a_tenant(link)
        try:
            local = await self.links.local_file(link.store_url, link.number, name)
        except Exception as exc:  # noqa: BLE001 - the export was deleted, or the bucket is unreachable
            raise ApiError(404, f"export {link.number}: its files could not be read: {exc}") from None
        if local is None:
            raise ApiError(404, f"export {link.number} has no file {name[:200]!r}")
        return FileResponse(local, media_type="application/octet-stream")

    async def _holder_still_a_tenant(self, link: Link) -> None:
        """404 once the admin has revoked the key the link was given to (its run removed from the fleet): a leaked
        key's links end with it. A fleet without an admin token has no keys to revoke."""
        if self.admin_token is None:
            return
        try:
            registered = await self.fleet.registered(self.admin_token.value, link.holder)
        except FleetRefused as refused:
            raise ApiError(
                503, f"the fleet could not say whether this link's API key is valid: {refused.message}"
            ) from None
        if not registered:
            raise ApiError(404, "the API key this download link was given to has been revoked")
