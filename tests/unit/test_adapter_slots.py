"""A replica's LoRA slots (`deployments.adapter_slots`): names loaded again, at most `max_loras` adapters whoever
named them, eviction by family and last use, and never an adapter with requests in flight."""

import asyncio

import pytest

from contracts.serving import ReplicaError
from deployments.adapter_slots import Held, eviction_order, pinned
from tests.unit.replica_parts import StandInLLM, adapter_folder, adapter_slots


async def _in_flight(slots, name: str, until: asyncio.Event) -> None:
    """A request on adapter `name` that lasts until `until` is set."""
    async with slots.use(name):
        await until.wait()


def test_a_name_loaded_again_with_other_files_is_reloaded_never_kept_on_the_old_weights(tmp_path):
    """TRL's second run in the same output folder loads `trl-policy-v2` from the same path with new contents."""
    llm = StandInLLM()
    slots = adapter_slots(tmp_path, llm)
    folder = adapter_folder(tmp_path / "trl" / "trl-policy-v2", b"first run's weights")

    async def scenario():  # one event loop, as a replica has
        load = await slots.load("trl-policy-v2", str(folder))
        assert load.loaded and not (await slots.load("trl-policy-v2", str(folder))).loaded
        (first,) = slots.listing().adapters
        finish = asyncio.Event()
        request = asyncio.create_task(_in_flight(slots, "trl-policy-v2", finish))  # still on the first weights
        await asyncio.sleep(0)

        adapter_folder(folder, b"second run's weights")
        reload = await slots.load("trl-policy-v2", str(folder))
        assert reload.loaded and reload.replaced
        (second,) = slots.listing().adapters
        assert second.sha256 != first.sha256
        old_request, new_request = llm.added
        assert old_request.lora_int_id != new_request.lora_int_id
        # A fresh engine name per content: vLLM keys its prefix cache by LoRA name and path, both else unchanged.
        assert old_request.lora_path == new_request.lora_path and old_request.lora_name != new_request.lora_name
        # The request in flight finishes on what it started on.
        assert llm.removed == [] and slots.draining == 1
        finish.set()
        await request
        assert llm.removed == [old_request.lora_int_id] and slots.draining == 0
        # The same files under another folder are the same adapter: nothing to do.
        copy = adapter_folder(tmp_path / "trl" / "elsewhere", b"second run's weights")
        assert not (await slots.load("trl-policy-v2", str(copy))).loaded

    asyncio.run(scenario())


def test_every_clients_versioned_names_are_pinned_by_family():
    """TRL's `trl-policy-vN` count against the same slots as `policy-vN`: each lineage pins its newest window."""
    from contracts.adapters import family_of

    assert family_of("trl-policy-v12") == ("trl-policy", 12) and family_of("policy-v0") == ("policy", 0)
    assert family_of("my-lora") == ("my-lora", None) and family_of("x-v01") == ("x-v01", None)
    names = [f"trl-policy-v{v}" for v in range(1, 7)] + ["policy-v4", "policy-v5", "policy-v1", "my-lora"]
    assert pinned(names, window=3) == {"trl-policy-v4", "trl-policy-v5", "trl-policy-v6", "policy-v4", "policy-v5"}


def test_a_replica_never_holds_more_adapters_than_max_loras_whoever_named_them(tmp_path):
    llm = StandInLLM()
    slots = adapter_slots(tmp_path, llm, window=3, max_loras=4)
    for version in range(1, 7):
        folder = adapter_folder(tmp_path / "trl" / f"trl-policy-v{version}", f"v{version}".encode())
        asyncio.run(slots.load(f"trl-policy-v{version}", str(folder)))
    assert list(slots.names) == [f"trl-policy-v{v}" for v in (3, 4, 5, 6)]  # the oldest two evicted
    assert len(llm.added) - len(llm.removed) == 4


def test_eviction_takes_the_least_recently_used_idle_adapter_unpinned_first():
    from app.config import slots_needed

    held = [
        Held("policy-v7", last_used=1.0, inflight=0),  # pinned (newest two of policy), least recently used
        Held("policy-v8", last_used=9.0, inflight=0),
        Held("policy-v3", last_used=5.0, inflight=0),  # an old version an evaluation asked for
        Held("policy-v2", last_used=2.0, inflight=3),  # requests in flight: never
        Held("my-lora", last_used=4.0, inflight=0),
    ]
    assert eviction_order(held, window=2) == ["my-lora", "policy-v3", "policy-v7", "policy-v8"]
    assert slots_needed([2, 2, 2]) == 7


def test_a_load_never_evicts_an_adapter_in_flight_it_waits_for_one_to_finish_or_says_503(tmp_path):
    llm = StandInLLM()
    slots = adapter_slots(tmp_path, llm, window=2, max_loras=3, slot_wait_s=2)
    folders = [adapter_folder(tmp_path / "trl" / f"lora-{i}", f"w{i}".encode()) for i in range(5)]
    finished = {i: asyncio.Event() for i in range(4)}

    async def finish_one_later():
        await asyncio.sleep(0.2)
        finished[1].set()  # its request ends

    async def scenario():  # one event loop, as a replica has
        requests = []
        for i in range(3):
            await slots.load(f"lora-{i}", str(folders[i]))
            requests.append(asyncio.create_task(_in_flight(slots, f"lora-{i}", finished[i])))
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        _, loaded = await asyncio.gather(finish_one_later(), slots.load("lora-3", str(folders[3])))
        waited = asyncio.get_running_loop().time() - started
        assert loaded.loaded and 0.2 <= waited < 2
        assert list(slots.names) == ["lora-0", "lora-2", "lora-3"]  # the one that finished made room
        requests.append(asyncio.create_task(_in_flight(slots, "lora-3", finished[3])))
        await asyncio.sleep(0)
        slots.slot_wait_s = 0.1
        with pytest.raises(ReplicaError) as full:
            await slots.load("lora-4", str(folders[4]))
        assert full.value.status == 503 and "in flight" in full.value.message
        for event in finished.values():
            event.set()
        await asyncio.gather(*requests)

    asyncio.run(scenario())
    assert len(llm.added) - len(llm.removed) == 3
