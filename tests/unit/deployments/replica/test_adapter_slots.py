"""A replica's LoRA slots (`deployments.replica.adapter_slots`): names loaded again, at most `max_loras` adapters whoever
named them, eviction by family and last use, and never an adapter with requests in flight."""

import asyncio

import pytest

from contracts.serving import ReplicaError
from deployments.replica.adapter_slots import Held, eviction_order, pinned
from tests.support.replica_parts import SECRET, StandInLLM, adapter_folder, adapter_slots, lineage_store


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
    from core.config import slots_needed

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


# ---- what a replica keeps, on a fleet up for weeks ----------------------------------------------------


def _cached(tmp_path) -> list[str]:
    """The folders of the replica's disk cache, as `<version>` per bucket prefix (the commit dropped)."""
    cache = tmp_path / "cache"
    return sorted(
        f"{p.parent.parent.name.rsplit('-', 1)[0]}:{p.name.split('.')[0]}"
        for p in cache.glob("*/adapters/policy-v*")
        if not p.name.startswith(".")
    )


def test_the_disk_cache_keeps_the_versions_in_use_and_the_newest_few_others(tmp_path):
    """18-37 MB a version for a 1.5B model: a lineage that publishes for weeks must not fill the replica's disk."""

    slots = adapter_slots(tmp_path, window=2, max_loras=3, cache_keep=1)
    own = lineage_store(f"file://{tmp_path}/bucket", cache_dir=tmp_path / "cache")
    for v in range(1, 9):
        own.publish(adapter_folder(tmp_path / f"v{v}", f"weights {v}".encode()), v)

    async def scenario():
        await slots.load("policy-v1", "policy-v1")
        finish = asyncio.Event()
        request = asyncio.create_task(_in_flight(slots, "policy-v1", finish))  # v1 in use all along
        await asyncio.sleep(0)
        for v in range(2, 9):
            await slots.load(f"policy-v{v}", f"policy-v{v}")
        await slots.sources.tidy()
        assert slots.names == ("policy-v1", "policy-v7", "policy-v8")
        # Held by the engine: v1 (a request in flight), v7, v8; of the others the newest one: v6.
        assert [c.split(":")[1] for c in _cached(tmp_path)] == ["policy-v1", "policy-v6", "policy-v7", "policy-v8"]
        finish.set()
        await request
        await slots.unload("policy-v1")  # no longer in use: it goes, v6 stays the one spare
        await slots.sources.tidy()
        assert [c.split(":")[1] for c in _cached(tmp_path)] == ["policy-v6", "policy-v7", "policy-v8"]
        async with slots.use("policy-v6"):  # evicted or not, a cached version serves at once
            pass

    asyncio.run(scenario())


def test_a_run_that_leaves_takes_its_names_prefix_and_cached_folders_along_once_its_last_request_is_done(tmp_path):
    """Runs come and go one after another (as in the soak test, without an engine): the replica's tables and disk cache
    end where they began. A run removed with a request in flight keeps that adapter's folder until it is done."""

    slots = adapter_slots(tmp_path, window=2, max_loras=4, cache_keep=1)  # the fleet's own 1, a run's 2, 1 to load
    url = f"file://{tmp_path}/bucket"
    lineage_store(url).publish(adapter_folder(tmp_path / "own", b"the fleet's own"), 1)

    async def one_run(run: str, leave_with_a_request: bool) -> None:
        store = lineage_store(url, run)
        for v in range(1, 6):
            store.publish(adapter_folder(tmp_path / run / f"v{v}", f"{run} {v}".encode()), v)
            await asyncio.gather(*(slots.load(f"{run}/policy-v{v}", f"policy-v{v}") for _ in range(2)))
            async with slots.use(f"{run}/policy-v{v}"):
                pass
        await slots.unload(f"{run}/policy-v4")
        async with slots.use(f"{run}/policy-v1"):  # evicted since: back from the bucket
            pass
        finish = asyncio.Event()
        request = asyncio.create_task(_in_flight(slots, f"{run}/policy-v5", finish))
        await asyncio.sleep(0)
        if not leave_with_a_request:
            finish.set()
            await request
        held = {name for name in slots.names if name.startswith(f"{run}/")}
        forgotten = await slots.forget_run(run)
        assert set(forgotten.unloaded) == held and f"{run}/policy-v5" in held
        assert slots.names == ("policy-v1",)
        assert forgotten.draining == int(leave_with_a_request)
        if leave_with_a_request:
            assert slots.sizes()["leaving_runs"] == 1
            assert [c.split(":")[1] for c in _cached(tmp_path) if f"-runs-{run}:" in c] == ["policy-v5"]  # in use
            finish.set()
            await request
            await slots.sources.tidy()

    async def scenario():
        await slots.load("policy-v1", "policy-v1")
        await slots.sources.tidy()
        before, cached, prefixes = slots.sizes(), _cached(tmp_path), sorted((tmp_path / "cache").iterdir())
        for i in range(12):
            await one_run(f"run{i}", leave_with_a_request=i % 3 == 0)
        assert slots.sizes() == before, (slots.sizes(), before)
        assert _cached(tmp_path) == cached and sorted((tmp_path / "cache").iterdir()) == prefixes
        return before

    before = asyncio.run(scenario())
    assert before == {
        "name_locks": 0,
        "unloaded": 0,
        "evicted": 0,
        "run_prefixes": 1,
        "known_versions": 1,
        "leaving_runs": 0,
    }


def test_names_unloaded_or_evicted_are_remembered_for_the_newest_few_hundred_only():
    """TRL unloads each stale `trl-policy-vN` (never loaded on demand: not worth remembering); a bucket lineage's
    explicit unloads and every eviction are remembered, the newest `REMEMBERED_NAMES` of each."""
    from deployments.replica.adapter_slots import REMEMBERED_NAMES, RecentNames

    names = RecentNames(limit=3)
    for v in range(10):
        names.add(f"alice/policy-v{v}")
    names.add("bob/policy-v1")
    assert len(names) == 3 and "alice/policy-v9" in names and "alice/policy-v6" not in names
    names.drop_run("alice")
    assert len(names) == 1 and "bob/policy-v1" in names
    assert REMEMBERED_NAMES >= 256


def test_a_stale_trl_version_unloaded_is_not_remembered(tmp_path):
    slots = adapter_slots(tmp_path)

    async def scenario():
        for v in range(50):
            await slots.unload(f"trl-policy-v{v}")
        await slots.unload("policy-v3")

    asyncio.run(scenario())
    assert slots.sizes()["unloaded"] == 1


def test_a_run_gone_whose_folder_another_replica_of_the_node_holds_is_deleted_once_that_one_lets_go(
    tmp_path, monkeypatch
):
    """The replicas of a node share the cache: one forgets a run while another still serves a request from its folder.
    The folder goes once the other lets go, without waiting for this replica's next load."""
    import deployments.replica.adapter_sources as sources_module

    monkeypatch.setattr(sources_module, "LEAVING_RETRY_S", 0.05)
    slots = adapter_slots(tmp_path)
    store = lineage_store(f"file://{tmp_path}/bucket", "alice", cache_dir=tmp_path / "cache")
    store.publish(adapter_folder(tmp_path / "v1", b"alice's"), 1)

    async def scenario():
        await slots.load("alice/policy-v1", "policy-v1")
        other_replica = store.fetch_held(1)  # the same folder, held by another replica of the node
        await slots.forget_run("alice")
        assert slots.sizes()["leaving_runs"] == 1 and other_replica.path.is_dir()
        other_replica.release()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not slots.sizes()["leaving_runs"]:
                break
        assert slots.sizes()["leaving_runs"] == 0 and not other_replica.path.exists()

    asyncio.run(scenario())


def test_a_teacher_reloaded_from_newer_versions_of_another_lineage_keeps_its_disk_cache_bounded(tmp_path):
    """A teacher that follows another run (`teacher-v0` loaded again from each of its new versions) is pruned like the
    fleet's own lineages: the version in use and the newest `cache_keep` others stay, nothing more."""
    from core.bucket.store import AdapterStore
    from core.config import BucketConfig
    from deployments.replica.adapter_sources import AdapterSources

    finished = f"file://{tmp_path}/finished"
    bucket = BucketConfig(cache_dir=str(tmp_path / "cache"))
    other = AdapterStore.at(finished, bucket)
    for v in range(1, 6):
        other.publish(adapter_folder(tmp_path / f"t{v}", f"teacher {v}".encode()), v)
    slots = adapter_slots(tmp_path, window=2, max_loras=3, cache_keep=1)
    slots.sources = AdapterSources(
        f"file://{tmp_path}/bucket", bucket, signing_secret=SECRET, window=2, cache_keep=1, other_lineages=[finished]
    )

    async def scenario():
        for v in range(1, 6):
            await slots.load("teacher-v0", f"{finished}/adapters/policy-v{v}")
        await slots.sources.tidy()

    asyncio.run(scenario())
    cached = sorted(p.name.split(".")[0] for p in (tmp_path / "cache").glob("*finished*/adapters/*.*"))
    assert cached == ["policy-v4", "policy-v5"]  # v5 in use, v4 the one spare
