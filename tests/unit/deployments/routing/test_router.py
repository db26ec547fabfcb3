"""PrefixHashRouter (`deployments.routing.router`) with stand-ins for Serve's replica wrappers: groups kept together,
decisions reused on retry, dead replicas forgotten, settings from the replicas' metadata."""

import asyncio
from types import SimpleNamespace

import pytest

from contracts.serving import GENERATE_METHOD, GenerateRequest, Sampling


class _FakeReplica:
    def __init__(self, name, metadata=None):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="VLLMReplica", app_name="t"))
        self.replica_metadata = metadata or {}
        self.max_ongoing_requests = 100

    async def get_queue_len(self, *, deadline_s):
        return 0


def _router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from deployments.routing.router import PrefixHashRouter

    router = PrefixHashRouter(
        deployment_id=DeploymentID(name="VLLMReplica", app_name="t"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        create_replica_wrapper_func=lambda info: info,
    )
    router.initialize_state(seed=0, **kwargs)
    return router


def _pending(prompt, model="policy-v1", method=GENERATE_METHOD, by_keyword=False, turn=None, session=None):
    """What Serve hands the router for `handle.options(method_name=method).remote(GenerateRequest(...))`."""
    from ray.serve._private.request_router.common import RequestRoutingContext

    request = GenerateRequest(prompt, model, Sampling(n=1, max_tokens=4), turn, session)
    return SimpleNamespace(
        args=[] if by_keyword else [request],
        kwargs={"request": request} if by_keyword else {},
        metadata=SimpleNamespace(call_method=method),
        routing_context=RequestRoutingContext(),
    )


@pytest.fixture
def patched_replicas(monkeypatch):
    """RunningReplica isinstance checks accept the stand-ins."""
    import deployments.routing.router as router_module

    monkeypatch.setattr(router_module, "RunningReplica", _FakeReplica)


def test_router_keeps_a_group_together_and_counts(patched_replicas):
    asyncio.run(_group_together_and_counts())


async def _group_together_and_counts():
    from deployments.routing.router import router_stats

    router = _router()
    a, b = _FakeReplica("a", {"router": {"block_size": 16}}), _FakeReplica("b", {"router": {"block_size": 16}})
    router.update_replicas([a, b])
    prompt = list(range(64))
    chosen = []
    for _ in range(8):
        ranks = await router.choose_replicas([a, b], _pending(prompt))
        first = ranks[0][0]
        chosen.append(first.replica_id.unique_id)
        assert [r.replica_id.unique_id for r in ranks[1]] != [first.replica_id.unique_id]  # fallback = the other
        router.on_send_request(first.replica_id)
    assert len(set(chosen)) == 1
    stats = router_stats()
    mine = stats["replicas"][chosen[0]]
    assert (mine["routed"], mine["affinity"], mine["unmatched"], mine["inflight"]) == (8, 7, 1, 8)
    # Non-generation calls go least loaded first, without touching the counters.
    ranks = await router.choose_replicas([a, b], _pending(prompt, method="server_info"))
    assert ranks[0][0].replica_id.unique_id != chosen[0]
    assert router.stats()["replicas"][chosen[0]]["routed"] == 8
    for _ in range(8):
        router.on_request_completed(_FakeReplica(chosen[0]).replica_id, "x")
    assert router.stats()["replicas"][chosen[0]]["inflight"] == 0


def test_router_reuses_its_decision_on_retry_and_forgets_dead_replicas(patched_replicas):
    asyncio.run(_reuses_decision_and_forgets_dead())


async def _reuses_decision_and_forgets_dead():
    router = _router(spill_threshold=100)
    a, b = _FakeReplica("a"), _FakeReplica("b")
    router.update_replicas([a, b])
    pending = _pending(list(range(48)))
    first = (await router.choose_replicas([a, b], pending))[0][0]
    again = (await router.choose_replicas([a, b], pending))[0][0]  # Serve asks again when a rank was full
    assert again is first
    assert router.stats()["replicas"][first.replica_id.unique_id]["routed"] == 1
    survivor = b if first is a else a
    router.on_replica_actor_died(first.replica_id)
    assert len(router._table) == 0
    stats = router.stats()  # its row goes (spot churn must not grow the stats), its counts stay in the totals
    assert first.replica_id.unique_id not in stats["replicas"] and stats["retired"]["routed"] == 1
    moved = (await router.choose_replicas([survivor], pending))[0][0]
    assert moved is survivor


def test_router_takes_block_size_from_replica_metadata_unless_explicit(patched_replicas):
    asyncio.run(_settings_from_metadata())


async def _settings_from_metadata():
    router = _router()
    router.update_replicas([_FakeReplica("a", {"router": {"block_size": 32, "spill_threshold": 3}})])
    assert router.stats()["settings"]["block_size"] == 32 and router.stats()["settings"]["spill_threshold"] == 3
    explicit = _router(block_size=16)
    explicit.update_replicas([_FakeReplica("a", {"router": {"block_size": 32}})])
    assert explicit.stats()["settings"]["block_size"] == 16


def test_a_bundle_goes_where_its_first_request_goes_and_its_others_blocks_are_recorded_there(patched_replicas):
    asyncio.run(_routes_a_bundle())


async def _routes_a_bundle():
    from ray.serve._private.request_router.common import RequestRoutingContext

    from contracts.serving import BUNDLE_METHOD, GenerateBundle

    router = _router(spill_threshold=100)
    a, b = _FakeReplica("a", {"router": {"block_size": 16}}), _FakeReplica("b", {"router": {"block_size": 16}})
    router.update_replicas([a, b])
    prompt = list(range(32))
    sequences = [prompt + [100 + i] * 16 for i in range(3)]  # a group's scored sequences: one prompt, three tails
    bundle = GenerateBundle(tuple(GenerateRequest(s, "policy-v1", Sampling(max_tokens=1)) for s in sequences))
    pending = SimpleNamespace(
        args=[bundle],
        kwargs={},
        metadata=SimpleNamespace(call_method=BUNDLE_METHOD),
        routing_context=RequestRoutingContext(),
    )
    chosen = (await router.choose_replicas([a, b], pending))[0][0]
    for sequence in sequences[1:]:  # each tail's blocks are where the bundle went: a later request of one matches
        assert (await router.choose_replicas([a, b], _pending(sequence)))[0][0] is chosen
    counts = router.stats()["replicas"]
    assert sum(c["routed"] for c in counts.values()) == 3  # the bundle is one routing decision


def test_router_reads_the_generate_request_by_name_wherever_it_is_passed(patched_replicas):
    asyncio.run(_reads_the_request())


async def _reads_the_request():
    router = _router(spill_threshold=100)
    a, b = _FakeReplica("a", {"router": {"block_size": 16}}), _FakeReplica("b", {"router": {"block_size": 16}})
    router.update_replicas([a, b])
    prompt = list(range(48))
    first = (await router.choose_replicas([a, b], _pending(prompt)))[0][0]
    router.on_send_request(first.replica_id)
    # Passed by keyword, the same request follows its prefix; under another adapter it is a new namespace.
    assert (await router.choose_replicas([a, b], _pending(prompt, by_keyword=True)))[0][0] is first
    await router.choose_replicas([a, b], _pending(prompt, model="policy-v2"))
    counts = router.stats()["replicas"]
    assert sum(c["affinity"] for c in counts.values()) == 1 and sum(c["unmatched"] for c in counts.values()) == 2
    # A call of the generate method without a GenerateRequest is not routed by prefix (and not counted).
    odd = _pending(prompt)
    odd.args = [prompt, "policy-v1", {}]
    assert len(await router.choose_replicas([a, b], odd)) == 1
    assert sum(c["routed"] for c in router.stats()["replicas"].values()) == 3


def test_router_counts_outcomes_per_episode_turn_and_a_trajectory_stays_on_its_replica(patched_replicas):
    asyncio.run(_per_turn())


async def _per_turn():
    from deployments.routing.router import router_stats

    router = _router(spill_threshold=100)
    a, b = _FakeReplica("a", {"router": {"block_size": 16}}), _FakeReplica("b", {"router": {"block_size": 16}})
    router.update_replicas([a, b])
    trajectories = [[1000 * t + i for i in range(20)] for t in range(4)]  # one full block each, all distinct
    placed = {}
    for t, prompt in enumerate(trajectories):
        placed[t] = (await router.choose_replicas([a, b], _pending(prompt, turn=1)))[0][0]
    for turn in (2, 3):  # each turn extends the trajectory by a block of model tokens and an observation
        for t in range(4):
            trajectories[t] = trajectories[t] + [7000 + turn * 100 + t * 10 + i for i in range(16)]
            chosen = (await router.choose_replicas([a, b], _pending(trajectories[t], turn=turn)))[0][0]
            assert chosen is placed[t]
    await router.choose_replicas([a, b], _pending(list(range(40))))  # a request that says no turn
    turns = router.stats()["turns"]
    assert turns[1] == {"routed": 4, "affinity": 0, "spilled": 0, "unmatched": 4}
    assert turns[2] == turns[3] == {"routed": 4, "affinity": 4, "spilled": 0, "unmatched": 0}
    merged = router_stats()["turns"]
    assert merged["2"]["affinity_share"] == 1.0 and merged["1"]["affinity_share"] == 0.0
    assert sum(c["routed"] for c in router.stats()["replicas"].values()) == 13


def test_router_stats_stay_the_size_of_the_live_fleet_through_churn(patched_replicas):
    """Replicas come and go (spot nodes): `/router/stats` holds the live ones, and the totals lose nothing."""
    from deployments.routing.router import router_stats

    async def churn():
        router = _router(spill_threshold=100)
        live = [_FakeReplica("r0")]
        router.update_replicas(live)
        for i in range(1, 51):
            await router.choose_replicas(live, _pending([i] * 40))
            replacement = _FakeReplica(f"r{i}")
            router.update_replicas([replacement])  # the old one left: preempted, scaled down
            live = [replacement]
        return router

    router = asyncio.run(churn())
    stats = router.stats()
    assert list(stats["replicas"]) == ["r50"] and stats["retired"]["routed"] == 50
    merged = router_stats()
    assert merged["totals"]["routed"] >= 50 and "r0" not in merged["replicas"]


def test_a_draining_replica_is_routed_nothing_while_another_is_live(patched_replicas):
    asyncio.run(_draining_replica())


async def _draining_replica():
    from deployments.routing.router import mark_draining, router_stats

    router = _router()
    a, b, c = (_FakeReplica(n, {"router": {"block_size": 16}}) for n in "abc")
    router.update_replicas([a, b, c])
    prompt = list(range(64))
    first = (await router.choose_replicas([a, b, c], _pending(prompt)))[0][0]
    mark_draining(first.replica_id.unique_id)  # the ingress heard from the replica (or from its refusal)
    other = next(r for r in (a, b, c) if r is not first)
    other.routing_stats = {"draining": True}  # a replica's own routing stats say so too
    (staying,) = [r for r in (a, b, c) if r is not first and r is not other]
    for _ in range(4):  # the group's affinity would keep it on `first`
        ranks = await router.choose_replicas([a, b, c], _pending(prompt))
        assert [[r.replica_id for r in rank] for rank in ranks] == [[staying.replica_id]]
    stats = router.stats()["replicas"]
    assert stats[first.replica_id.unique_id]["draining"]
    alone = await router.choose_replicas([first], _pending(prompt))  # nothing else live: better it than nothing
    assert alone == [[first]]
    router.update_replicas([a, b, c])
    router.update_replicas([r for r in (a, b, c) if r is not first])  # it left: forgotten
    assert first.replica_id.unique_id not in router._draining
    # Its drain outlives its row (Serve stops a noticed replica within seconds): routed 1 before, 1 while draining.
    (drain,) = router.stats()["drains"]
    assert (drain["replica"], drain["routed_before"], drain["routed_while_draining"]) == (
        first.replica_id.unique_id,
        1,
        1,
    )
    merged = [d for d in router_stats()["drains"] if d["replica"] == first.replica_id.unique_id]
    assert len(merged) == 1 and merged[0]["routed_while_draining"] >= 1


def test_a_sessions_requests_stay_on_its_replica_whatever_their_prompts_and_are_counted(patched_replicas):
    asyncio.run(_sessions_stay())


async def _sessions_stay():
    from deployments.routing.router import router_stats

    router = _router(spill_threshold=2)
    a, b = _FakeReplica("a", {"router": {"block_size": 16}}), _FakeReplica("b", {"router": {"block_size": 16}})
    router.update_replicas([a, b])

    async def send(prompt, session):
        (first, *_), *_ = await router.choose_replicas([a, b], _pending(prompt, session=session))
        router.on_send_request(first.replica_id)
        return first.replica_id.unique_id

    # Two sessions whose turns share no block (a client that re-renders its prompt): each stays where it began.
    homes = {s: await send(list(range(100 * k, 100 * k + 20)), s) for k, s in enumerate(("s1", "s2"), start=1)}
    for turn in range(3):
        for k, s in enumerate(("s1", "s2"), start=1):
            assert await send(list(range(1000 * k + turn, 1000 * k + turn + 40)), s) == homes[s]
    # The session's replica far busier than the other: its next request spills, and the session follows it.
    busy = homes["s1"]
    other = "b" if busy == "a" else "a"
    for _ in range(5):
        router.on_send_request(_FakeReplica(busy).replica_id)
    assert await send([7] * 40, "s1") == other
    assert await send([8] * 40, None) in ("a", "b")  # a request without a session is counted as before only
    sessions = router.stats()["sessions"]
    assert {k: sessions[k] for k in ("routed", "kept", "spilled", "new", "table_entries")} == {
        "routed": 9,
        "kept": 6,
        "spilled": 1,
        "new": 2,
        "table_entries": 2,
    }
    merged = router_stats()["sessions"]
    assert merged["kept_share"] == pytest.approx(6 / 7)
    # A replica that leaves takes its sessions with it: their next request starts afresh.
    router.update_replicas([_FakeReplica(other, {"router": {"block_size": 16}})])
    assert router.stats()["sessions"]["table_entries"] == 1 + (homes["s2"] == other)  # s1 moved to `other`
