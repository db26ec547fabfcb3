"""Which tenant a key is (`deployments.tinker.tenants`): against the fleet's own API (its runs, tokens, idle timeout
and heartbeats), a key lives and dies with its run; against a fake check, the cache's bound and its single check."""

import asyncio
import time

import pytest

from deployments.tinker.fleet_calls import FleetCalls, FleetRefused, Tenant
from deployments.tinker.tenants import Tenants


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_run_holding_a_session_is_kept_alive_while_it_only_trains_and_one_holding_none_is_released(fleet, tmp_path):
    """The fleet releases a run silent for its idle timeout (2 s here); the service's requests that only train say
    nothing to the fleet, so the heartbeat keeps alive each run that holds a session, and only those."""
    alice, bob = fleet.register("alice"), fleet.register("bob")
    revoked: list[str] = []

    async def upkeep_for_3_s():
        calls = FleetCalls(fleet.url, str(tmp_path))

        async def on_revoked(run):
            revoked.append(run)

        tenants = Tenants(calls.tenant, on_revoked, max_age_s=0.1)
        try:
            assert (await tenants.resolve(alice)).run == "alice" and (await tenants.resolve(bob)).run == "bob"
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # what the service's upkeep does, more often
                await tenants.keep_alive({"alice"}, calls.heartbeat)
                await asyncio.sleep(0.1)
            assert fleet.runs() == ["alice"]
            await asyncio.sleep(0.2)
            assert await tenants.resolve(bob) is None and revoked == ["bob"]
            assert (await tenants.resolve(alice)).run == "alice"
        finally:
            await calls.close()

    asyncio.run(upkeep_for_3_s())


def test_a_key_the_admin_removes_is_refused_once_its_bound_passes_and_its_run_is_dropped_once(fleet, tmp_path):
    alice = fleet.register("alice")
    clock, revoked = Clock(), []

    async def removed():
        calls = FleetCalls(fleet.url, str(tmp_path))

        async def on_revoked(run):
            revoked.append(run)

        tenants = Tenants(calls.tenant, on_revoked, max_age_s=1.0, clock=clock)
        try:
            assert (await tenants.resolve(alice)).run == "alice"
            fleet.remove("alice")
            clock.now = 0.5
            assert (await tenants.resolve(alice)).run == "alice"  # within the bound: not asked
            clock.now = 1.6
            assert await tenants.resolve(alice) is None and revoked == ["alice"]
            assert await tenants.resolve(alice) is None and revoked == ["alice"]  # dropped once
            assert len(tenants) == 0
        finally:
            await calls.close()

    asyncio.run(removed())


def test_a_run_whose_heartbeat_is_refused_is_revoked_at_once(fleet, tmp_path):
    alice, bob = fleet.register("alice"), fleet.register("bob")
    revoked = []

    async def removed():
        calls = FleetCalls(fleet.url, str(tmp_path))

        async def on_revoked(run):
            revoked.append(run)

        tenants = Tenants(calls.tenant, on_revoked, max_age_s=600.0)
        try:
            await tenants.resolve(alice)
            await tenants.resolve(bob)
            fleet.remove("alice")
            await tenants.keep_alive({"alice", "bob"}, calls.heartbeat)
            assert revoked == ["alice"] and tenants.of("alice") is None and tenants.of("bob").run == "bob"
            assert await tenants.resolve(alice) is None  # asked again: not a run
        finally:
            await calls.close()

    asyncio.run(removed())


def test_while_the_fleet_cannot_answer_a_known_key_stands_and_an_unknown_one_is_its_error():
    clock, answers, asked = Clock(), {"tml-a": Tenant("alice", "a")}, []
    down = False

    async def check(api_key):
        asked.append(api_key)
        await asyncio.sleep(0.01)
        if down:
            raise FleetRefused(503, "the fleet did not answer")
        return answers.get(api_key)

    async def nothing(run):
        raise AssertionError(f"{run} was revoked")

    async def scenario():
        nonlocal down
        tenants = Tenants(check, nothing, max_age_s=1.0, clock=clock)
        assert (await tenants.resolve("tml-a")).run == "alice"
        clock.now, down = 5.0, True
        assert (await tenants.resolve("tml-a")).run == "alice"
        with pytest.raises(FleetRefused):
            await tenants.resolve("tml-b")
        down, clock.now = False, 10.0
        many = await asyncio.gather(*(tenants.resolve("tml-a") for _ in range(20)))
        assert {t.run for t in many} == {"alice"}
        assert asked.count("tml-a") == 3  # once at first, once while down, once for the 20 requests together
        assert await tenants.resolve(None) is None and await tenants.resolve("sk-other") is None

    asyncio.run(scenario())
