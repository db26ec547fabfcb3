"""Commands to every live replica, applied to all of them or to none: what an admin call does to the fleet.

A `contracts.control` command goes to every live replica through `Backend.broadcast`, which answers each
replica's typed reply or exception. A broadcast that failed anywhere is an error (`all_or_raise`), and the
calls that change the fleet undo what they did on the replicas where they succeeded: a load is rolled back
(`load_everywhere`), a pause resumed (`pause_everywhere`), so that no replica serves what others cannot
and nobody stays paused because of one replica.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from contracts.adapters import split_run
from contracts.control import Command, ForgetRun, ListAdapters, LoadAdapter, Pause, Resume, UndoLoad
from deployments.control.backend import Backend
from deployments.control.errors import ApiError, as_api_error
from deployments.control.fair_share import FLEET_TENANT


def all_or_raise(results: list[Any]) -> list[Any]:
    """The replies of a broadcast, raising the first failure (a broadcast that partly failed is an error)."""
    for r in results:
        if isinstance(r, BaseException):
            raise as_api_error(r, "a replica failed")
    return results


async def everywhere(backend: Backend, command: Command) -> list[Any]:
    """`command` on every live replica: their replies, or the first failure raised."""
    return all_or_raise(await backend.broadcast(command))


async def load_everywhere(backend: Backend, name: str, path: str) -> dict[str, Any]:
    """Load adapter `name` from `path` on every live replica or on none (`ApiError` then says why).

    `/v1/load_lora_adapter` and the ingress's in-cluster `load_adapter` (a Serve handle call) both
    come here. The broadcast and its rollback run shielded from the caller: a client that gives up
    (an HTTP disconnect, a handle call past its deadline) cancels its wait, never a half-done load.
    """
    return await asyncio.shield(_load_all_or_nothing(backend, name, path))


async def _load_all_or_nothing(backend: Backend, name: str, path: str) -> dict[str, Any]:
    load_id = uuid.uuid4().hex
    results = await backend.broadcast(LoadAdapter(name, path, load_id))
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures or not results:
        # All or nothing: undo the loads this broadcast made, so no replica serves what others cannot.
        await backend.broadcast(UndoLoad(name, load_id))
        # A client pauses, loads, resumes (TRL does): one whose load failed raises before its resume, and
        # the fleet, everyone's, would stay paused until its pause lease ran out.
        await backend.broadcast(Resume())
        if not results:
            raise ApiError(503, "no live replica")
        raise as_api_error(
            failures[0], f"load of {name!r} failed on {len(failures)} of {len(results)} replicas, rolled back"
        )
    return {
        "status": "ok",
        "lora_name": name,
        "replicas": len(results),
        "newly_loaded": sum(r.loaded for r in results),
    }


async def pause_everywhere(backend: Backend, mode: str) -> list[Any]:
    """Pause every live replica's engine (`contracts.serving.PAUSE_MODES`), or none: a pause that failed
    anywhere is resumed everywhere, so nobody stays paused when the pause as a whole failed."""
    results = await backend.broadcast(Pause(mode))
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await backend.broadcast(Resume())
        raise as_api_error(failures[0], f"pause failed on {len(failures)} of {len(results)} replicas, resumed")
    return results


async def forget_run(backend: Backend, run: str) -> list[str]:
    """Run `run` left: every live replica unloads its adapters (`<run>/...`) and forgets what it kept of it
    (`ForgetRun`); the names unloaded."""
    replies = await everywhere(backend, ForgetRun(run))
    return sorted({name for reply in replies for name in reply.unloaded})


async def slots_held(backend: Backend) -> dict[str, int]:
    """LoRA slots per run (un-namespaced adapters: `FLEET_TENANT`) on the fullest engine, as listed by the
    replicas that answer (a replica that cannot list its adapters right now is left out, not an error)."""
    listed = [r for r in await backend.broadcast(ListAdapters()) if not isinstance(r, BaseException)]
    held: dict[str, int] = {}
    for replica in listed:
        counts: dict[str, int] = {}
        for a in replica.adapters:
            owner = split_run(a.name)[0] or FLEET_TENANT
            counts[owner] = counts.get(owner, 0) + 1
        for owner, n in counts.items():
            held[owner] = max(held.get(owner, 0), n)
    return held
