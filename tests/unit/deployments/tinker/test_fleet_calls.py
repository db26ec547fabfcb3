"""The Tinker service's calls of the fleet, over real HTTP against the fleet's own API on a fake backend: who a key is
now, the heartbeat of a run, and each key's own lane for its samples."""

import asyncio
import time

import pytest

from deployments.tinker.fleet_calls import FleetCalls, FleetRefused
from tests.support.fake_fleet import BASE

LANE = 8
BODY = {"model": BASE, "prompt": [1, 2], "max_tokens": 1, "n": 1}


def test_a_key_is_its_run_until_the_admin_removes_it_and_then_its_heartbeat_is_refused(fleet, tmp_path):
    alice = fleet.register("alice")

    async def calls():
        calls = FleetCalls(fleet.url, str(tmp_path))
        try:
            tenant = await calls.tenant(alice)
            assert tenant is not None and tenant.run == "alice"
            assert await calls.heartbeat(tenant) == 2.0  # the fleet's idle timeout
            assert await calls.tenant("tml-not-a-token") is None
            fleet.remove("alice")
            assert await calls.tenant(alice) is None  # asked again, not remembered
            with pytest.raises(FleetRefused) as refused:
                await calls.heartbeat(tenant)
            assert refused.value.status == 401
        finally:
            await calls.close()

    asyncio.run(calls())


def test_one_keys_flood_of_samples_does_not_delay_another_keys_sample(slow_fleet, tmp_path):
    """Alice has 300 samples in flight (an RL step's futures), each taking 0.5 s on the fleet: bob's one sample
    takes its own 0.5 s, not a place behind hers, and the fleet sees at most alice's lane of hers at once. Before
    lanes, all keys shared one pool of 100 connections: the fleet saw 100 of alice's at once, and bob's sample waited
    for one of them to finish (0.8 to 2.5 s in all)."""
    alice, bob = slow_fleet.register("alice"), slow_fleet.register("bob")

    async def flood() -> float:
        calls = FleetCalls(slow_fleet.url, str(tmp_path), lane=LANE)
        try:
            a, b = await calls.tenant(alice), await calls.tenant(bob)
            floods = [asyncio.ensure_future(calls.completions(a, BODY)) for _ in range(300)]
            await asyncio.sleep(0.2)  # alice's requests are in flight, or waiting where they wait
            start = time.monotonic()
            answer = await calls.completions(b, BODY)
            took = time.monotonic() - start
            assert len(answer["choices"]) == 1
            for request in floods:
                request.cancel()
            await asyncio.gather(*floods, return_exceptions=True)
            return took
        finally:
            await calls.close()

    took = asyncio.run(flood())
    assert took < 0.85, f"bob's sample took {took:.2f} s behind alice's flood (0.5 s alone)"
    assert slow_fleet.backend.most_in_flight <= LANE + 1  # alice's lane, and bob's one
