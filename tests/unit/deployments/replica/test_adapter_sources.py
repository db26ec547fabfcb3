"""Where a replica's adapters come from: which committed versions it serves, how rarely it lists the bucket to
find out, and a run's adapters from the run's own prefix of the bucket alone."""

import asyncio
import threading
import time

import pytest

from contracts.serving import BadRequest, ModelNotFound
from core.bucket.store import AdapterStore
from deployments.replica.adapter_sources import CommittedVersions
from tests.support.replica_parts import SECRET, adapter_folder, adapter_slots, lineage_store, local_config, publish


class _Bucket:
    """Committed versions, newest first, counting the listings; each listing takes `delay_s`."""

    def __init__(self, *committed: int, delay_s: float = 0.0):
        self.committed, self.delay_s, self.listings = list(committed), delay_s, 0
        self._count = threading.Lock()  # listings run on threads

    def versions(self) -> list[int]:
        with self._count:
            self.listings += 1
        time.sleep(self.delay_s)
        return list(self.committed)


def test_a_replica_serves_the_newest_committed_versions_oldest_first(tmp_path):
    store = AdapterStore.from_config(local_config(tmp_path))

    def versions_to_serve():
        return asyncio.run(CommittedVersions(store, window=3).to_serve())

    def is_committed(version):
        return asyncio.run(CommittedVersions(store, window=3).is_committed(version))

    assert versions_to_serve() == []
    publish(store, tmp_path, 0, 1, 2, 3, 4)
    assert versions_to_serve() == [2, 3, 4]
    assert is_committed(4) and is_committed(2)
    assert is_committed(1)  # too old for a sample, but committed: served on demand (an evaluation, say)
    assert not is_committed(5)


async def _ask(versions: CommittedVersions, *asked: int) -> list[bool]:
    """The answers to requests for `asked`, all at once (a replica's one event loop)."""
    return await asyncio.gather(*(versions.is_committed(v) for v in asked))


def test_a_burst_of_requests_for_unknown_versions_lists_the_bucket_once_per_interval():
    now = [0.0]
    bucket = _Bucket(3, 2, 1, 0, delay_s=0.05)
    versions = CommittedVersions(bucket, window=3, min_interval_s=5.0, clock=lambda: now[0])

    async def scenario():
        assert await versions.to_serve() == [1, 2, 3] and bucket.listings == 1  # start-up
        assert await _ask(versions, 3, 2, 1, 0) == [True, True, True, True]  # known: no listing
        assert bucket.listings == 1
        # Published as the replica joined (its load broadcast missed it): the first request for it lists at once.
        bucket.committed.insert(0, 4)
        assert await _ask(versions, 4, 4) == [True, True] and bucket.listings == 2
        now[0] = 1.0
        assert not any(await _ask(versions, *range(5, 1005)))  # 1000 versions nobody published
        assert bucket.listings == 2  # listed less than the interval ago
        now[0] = 6.0
        assert not any(await _ask(versions, *range(5, 1005)))
        assert bucket.listings == 3  # one listing, shared by the burst
        bucket.committed.insert(0, 5)
        assert await _ask(versions, 5) == [False]  # published within the interval: found by the next listing
        now[0] = 11.0
        assert await _ask(versions, 5, 5, 5) == [True, True, True]
        assert await _ask(versions, 1) == [True]  # out of the window since v5, still committed
        assert bucket.listings == 4

    asyncio.run(scenario())


def test_an_older_unknown_version_is_refused_without_listing():
    bucket = _Bucket(9, 7, 6)  # v8 was never committed (or was removed)
    versions = CommittedVersions(bucket, window=3, min_interval_s=0.0)

    async def scenario():
        await versions.to_serve()
        assert await _ask(versions, 8, 5, 0, 8) == [False] * 4
        assert bucket.listings == 1  # however often: nothing older than v9 is going to appear

    asyncio.run(scenario())


def test_requests_waiting_for_a_listing_share_it():
    bucket = _Bucket(2, 1, delay_s=0.2)
    versions = CommittedVersions(bucket, window=2, min_interval_s=0.0)  # no interval: sharing alone

    async def scenario():
        await versions.to_serve()
        bucket.committed.insert(0, 3)  # published, its broadcast missed
        assert all(await _ask(versions, *[3] * 200))
        assert bucket.listings == 2

    asyncio.run(scenario())


def test_versions_fetched_by_broadcast_count_as_known():
    bucket = _Bucket(5, 4, 3)
    versions = CommittedVersions(bucket, window=3, min_interval_s=0.0)

    async def scenario():
        await versions.to_serve()
        bucket.committed[:0] = [8, 7, 6]
        versions.remember(6)  # came by broadcast since the listing (and was evicted since, say)
        versions.remember(7)
        assert await _ask(versions, 6, 7, 4) == [True, True, True] and bucket.listings == 1
        # Newer than the listing and never fetched here (its broadcast was missed): listed for.
        assert await _ask(versions, 8) == [True] and bucket.listings == 2

    asyncio.run(scenario())


def test_a_runs_adapters_load_only_from_its_own_prefix_of_the_bucket(tmp_path):

    slots = adapter_slots(tmp_path, window=2, max_loras=3)
    fleet = slots.sources.store
    alice = lineage_store(fleet.url, "alice", cache_dir=tmp_path / "cache")
    bob = lineage_store(fleet.url, "bob", cache_dir=tmp_path / "cache")
    fleet.publish(adapter_folder(tmp_path / "own", b"the fleet's own v1"), 1)
    alice.publish(adapter_folder(tmp_path / "alice", b"alice's v1"), 1)
    bob.publish(adapter_folder(tmp_path / "bob", b"bob's v1"), 1)
    adapter_folder(tmp_path / "trl" / "x", b"a trusted folder")

    async def scenario():
        assert (await slots.load("alice/policy-v1", "adapters/policy-v1")).loaded
        assert (await slots.load("bob/policy-v1", bob.url_of(1))).loaded
        for name, ref in (
            ("alice/policy-v1", fleet.url_of(1)),  # the fleet's own version
            ("alice/policy-v1", bob.url_of(1)),  # another run's
            ("alice/policy-v1", f"{alice.url}/../bob/adapters/policy-v1"),
            ("alice/x", str(tmp_path / "trl" / "x")),  # a trusted folder is for the fleet's own names
            ("Alice/policy-v1", "adapters/policy-v1"),  # not a run name
        ):
            with pytest.raises(BadRequest):
                await slots.load(name, ref)
        await slots.unload("alice/policy-v1")
        slots._unloaded.discard("alice/policy-v1")  # as if evicted: asked for again, it comes back from alice's prefix
        async with slots.use("alice/policy-v1") as lora:
            assert lora.lora_name.startswith("alice/policy-v1@")
        with pytest.raises(ModelNotFound):  # committed at the root and in alice's prefix, not in carol's
            async with slots.use("carol/policy-v1"):
                pass

    asyncio.run(scenario())
    adapters = slots.listing().adapters
    assert {a.name: a.source for a in adapters}["alice/policy-v1"] == alice.url_of(1)
    assert len({a.sha256 for a in adapters}) == len(adapters)  # alice's and bob's v1 are different files


def test_a_lineage_that_trains_for_weeks_is_remembered_as_its_last_listing_and_the_newest_fetched_versions():
    """Every new version arrives by broadcast (fetched, never listed): the replica remembers the newest few; an older
    one asked for again is found by a listing at once, not refused until the next interval."""
    from deployments.replica.adapter_sources import FETCHED_REMEMBERED

    bucket = _Bucket(1, 0)
    versions = CommittedVersions(bucket, window=3, min_interval_s=3600.0)

    async def scenario():
        await versions.to_serve()
        for v in range(2, 2000):
            bucket.committed.insert(0, v)
            versions.remember(v)
        assert versions.known == 2 + FETCHED_REMEMBERED and bucket.listings == 1
        assert await _ask(versions, 1999, 1990) == [True, True] and bucket.listings == 1  # remembered
        assert await _ask(versions, 1000) == [True] and bucket.listings == 2  # forgotten: listed at once
        assert versions.known == 2000  # as listed: what the learner's gc keeps, in a real bucket

    asyncio.run(scenario())


def test_a_run_that_left_is_forgotten_and_comes_back_fresh_if_it_registers_again(tmp_path):
    from contracts.adapters import AdapterRef

    slots = adapter_slots(tmp_path)
    sources = slots.sources
    store = lineage_store(sources.url, "alice")
    publish(store, tmp_path, 1)

    async def scenario():
        assert await sources.is_committed(AdapterRef(1, "alice"))
        assert sources.sizes() == {"run_prefixes": 2, "known_versions": 1, "leaving_runs": 0}
        sources.forget("alice")
        await sources.tidy()
        assert sources.sizes() == {"run_prefixes": 1, "known_versions": 0, "leaving_runs": 0}
        assert await sources.is_committed(AdapterRef(1, "alice"))  # the same name again: asked afresh

    asyncio.run(scenario())


def test_a_teacher_is_loaded_from_another_lineage_only_where_the_fleet_trusts_it(tmp_path):
    """A finished run's committed version, loaded under a name of its own (a teacher's), verified like any."""
    from core.bucket.store import AdapterStore
    from core.config import BucketConfig
    from deployments.replica.adapter_sources import AdapterSources

    bucket = BucketConfig(cache_dir=str(tmp_path / "cache"))
    finished = f"file://{tmp_path}/finished"
    publish(AdapterStore.at(finished, bucket), tmp_path, 7)
    url = f"{finished}/adapters/policy-v7"
    trusting = AdapterSources(
        f"file://{tmp_path}/bucket", bucket, signing_secret=SECRET, window=3, other_lineages=[finished]
    )
    source, folder = asyncio.run(trusting.fetch("teacher-v0", url))
    assert source == url and (folder.path / "adapter_config.json").is_file()
    folder.release()
    with pytest.raises(ModelNotFound, match="policy-v8 is not committed"):
        asyncio.run(trusting.fetch("teacher-v0", f"{finished}/adapters/policy-v8"))
    with pytest.raises(BadRequest, match="outside the bucket"):  # the fleet's own lineage names stay its own
        asyncio.run(trusting.fetch("policy-v7", url))
    wary = AdapterSources(f"file://{tmp_path}/bucket", bucket, signing_secret=SECRET, window=3)
    with pytest.raises(BadRequest, match="outside the bucket"):
        asyncio.run(wary.fetch("teacher-v0", url))
    # A run that names this teacher brings a fleet that trusts its lineage (and a slot for it).
    cfg = local_config(tmp_path, f"objectives=[{{kind: distill, teacher: {{adapter: '{url}'}}}}]")
    own = cfg.own_fleet()
    assert own.fleet.extra_adapter_buckets == [finished] and own.max_loras == cfg.rollout.max_staleness + 3


def test_a_version_planted_in_a_runs_prefix_by_another_writer_of_the_bucket_is_refused(tmp_path):
    """Run alice may write the bucket, so she can commit a version under bob's prefix (or the fleet's own): signed
    with her key, or with none, it does not verify under bob's, and the replica refuses it (403) instead of serving
    her weights as bob's next version. Bob's own versions load."""
    from contracts.serving import ReplicaError

    sources = adapter_slots(tmp_path).sources
    bob = lineage_store(sources.url, "bob", cache_dir=tmp_path / "cache")
    publish(bob, tmp_path, 1)
    as_bob_by_alice = AdapterStore(
        bob.url, cache_dir=tmp_path / "cache", signing_key=lineage_store(sources.url, "alice").signing_key
    )
    publish(as_bob_by_alice, tmp_path, 2)
    publish(AdapterStore(bob.url, cache_dir=tmp_path / "cache"), tmp_path, 3)  # unsigned
    publish(AdapterStore(sources.url, cache_dir=tmp_path / "cache"), tmp_path, 4)  # the fleet's own, unsigned

    def fetch(name: str, ref: str):
        return asyncio.run(sources.fetch(name, ref))

    assert fetch("bob/policy-v1", "policy-v1")[0].endswith("runs/bob/adapters/policy-v1")
    for name, ref in (("bob/policy-v2", "policy-v2"), ("bob/policy-v3", "policy-v3"), ("policy-v4", "policy-v4")):
        with pytest.raises(ReplicaError, match="refused: .*not signed") as refused:
            fetch(name, ref)
        assert refused.value.status == 403
    assert bob.signed(1) and not bob.signed(2) and not bob.signed(3)


def test_a_runs_ema_lineage_loads_from_its_own_prefix_signed_with_its_key_and_leaves_with_it(tmp_path):
    """An ema self teacher's lineage (`alice/ema-vN`, the learner's average beside `alice/policy-vN`) is a second
    lineage of the run: loaded only from alice's prefix, only signed with alice's key, never under a policy name, loaded
    on demand when committed, and forgotten with the run."""
    from contracts.adapters import AdapterRef
    from contracts.auth import lineage_key
    from contracts.serving import ReplicaError
    from core.bucket.store import EmaAdapterStore
    from tests.support.replica_parts import SECRET

    slots = adapter_slots(tmp_path, window=2, max_loras=5)
    sources = slots.sources
    url = lineage_store(sources.url, "alice").url
    alice = lineage_store(sources.url, "alice", cache_dir=tmp_path / "cache")
    alice_ema = EmaAdapterStore(url, signing_key=lineage_key(SECRET, "alice"), cache_dir=tmp_path / "cache")
    alice.publish(adapter_folder(tmp_path / "policy", b"alice's policy v1"), 1)
    alice_ema.publish(adapter_folder(tmp_path / "ema", b"alice's average v1"), 1)
    # bob signs an ema-v2 into alice's prefix with his own key: never alice's
    EmaAdapterStore(url, signing_key=lineage_key(SECRET, "bob"), cache_dir=tmp_path / "cache").publish(
        adapter_folder(tmp_path / "planted", b"bob's"), 2
    )
    assert alice.versions() == [1] and alice_ema.versions() == [2, 1]  # each lineage lists its own stem

    async def scenario():
        assert (await slots.load("alice/ema-v1", "adapters/ema-v1")).loaded
        for name, ref in (
            ("alice/policy-v1", "adapters/ema-v1"),  # a policy name for the average's files
            ("alice/ema-v1", "adapters/policy-v1"),  # and the other way round
            ("bob/ema-v1", alice_ema.url_of(1)),  # from another run's prefix
        ):
            with pytest.raises(BadRequest):
                await slots.load(name, ref)
        with pytest.raises(ReplicaError) as planted:
            await slots.load("alice/ema-v2", "adapters/ema-v2")
        assert planted.value.status == 403
        async with slots.use("alice/policy-v1") as lora:  # committed: loaded on demand, the policy's own files
            assert lora.lora_name.startswith("alice/policy-v1@")
        assert await sources.is_committed(AdapterRef(1, "alice", "ema"))
        sources.forget("alice")
        await sources.tidy()
        assert not [run for run, _ in sources._prefixes if run == "alice"]  # both of alice's lineages went

    asyncio.run(scenario())
    held = {a.name: a.sha256 for a in slots.listing().adapters}
    assert held["alice/ema-v1"] != held["alice/policy-v1"]
