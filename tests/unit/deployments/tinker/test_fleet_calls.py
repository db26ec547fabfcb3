"""The Tinker service's calls of the fleet, over real HTTP against the fleet's own API on a fake backend: who a key is
now, the heartbeat of a run, and each key's own lane for its samples."""

import asyncio
import time

import pytest

from deployments.tinker.fleet_calls import FleetCalls, FleetRefused
from tests.support.fake_fleet import BASE
from tests.unit.deployments.tinker.conftest import SlowBackend, served_fleet

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


class DistinctBackend(SlowBackend):
    """Each generation's choice i samples token 100 + i of its request, so that each caller's share is seen."""

    async def generate(self, request):
        answer = await super().generate(request)
        for choice in answer.choices:
            choice.token_ids[:] = [100 + choice.index]
        return answer


@pytest.fixture
def unmerged_fleet(tmp_path):
    """The fleet API with its own coalescing off: each HTTP request it gets is one generation of the backend."""
    with served_fleet(tmp_path, DistinctBackend(delay_s=0.05), coalesce_window_s=0.0) as served:
        yield served


def test_like_single_sample_requests_of_a_key_are_one_fleet_call_and_each_gets_its_own_samples(
    unmerged_fleet, tmp_path
):
    """A cookbook group: 8 requests of one sample, sent at once, are one generation of n=8 on the fleet, each
    request answered one of its choices, numbered 0; a seeded request and another key's go alone."""
    fleet = unmerged_fleet
    alice, bob = fleet.register("alice"), fleet.register("bob")

    async def main():
        calls = FleetCalls(fleet.url, str(tmp_path), merge_window_s=0.05, max_samples=16)
        try:
            a, b = await calls.tenant(alice), await calls.tenant(bob)
            body = {**BODY, "return_token_ids": True}  # as the service asks
            group = [calls.completions(a, body) for _ in range(8)]
            others = [calls.completions(a, {**body, "seed": 7}), calls.completions(b, body)]
            return await asyncio.gather(*group, *others)
        finally:
            await calls.close()

    answers = asyncio.run(main())
    generations = sorted(request.sampling.n for kind, request in fleet.backend.calls if kind == "generate")
    assert generations == [1, 1, 8]  # alice's group as one; her seeded request and bob's alone
    group = answers[:8]
    assert all(len(a["choices"]) == 1 and a["choices"][0]["index"] == 0 for a in group)
    assert sorted(a["choices"][0]["token_ids"][0] for a in group) == list(range(100, 108))  # a sample each
    assert [a["choices"][0]["token_ids"] for a in answers[8:]] == [[100], [100]]


def test_a_merged_call_never_exceeds_the_fleets_sequences_per_request(unmerged_fleet, tmp_path):
    alice = unmerged_fleet.register("alice")

    async def main():
        calls = FleetCalls(unmerged_fleet.url, str(tmp_path), merge_window_s=0.05, max_samples=4)
        try:
            tenant = await calls.tenant(alice)
            return await asyncio.gather(*(calls.completions(tenant, BODY) for _ in range(10)))
        finally:
            await calls.close()

    answers = asyncio.run(main())
    assert all(len(a["choices"]) == 1 for a in answers)
    assert sorted(r.sampling.n for kind, r in unmerged_fleet.backend.calls if kind == "generate") == [2, 4, 4]
