"""Sessions, training clients and samplers: tenancy checks, capacity, seq_id order and the release of silent
sessions."""

import asyncio

import pytest

from deployments.tinker.sessions import NotFound, OverCapacity, Sessions
from deployments.tinker.turns import TurnRefused


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_tenant_sees_only_its_own_sessions_models_and_samplers():
    sessions = Sessions(4, 2, 60.0)
    mine = sessions.open("alice")
    model = sessions.reserve_model(mine, "alice", 0, "base", 8)
    assert model.model_id == f"{mine}:train:0"  # the id the SDK computes itself for create-via-load
    sampler = sessions.add_sampler("alice", mine, "alice/policy-v1", "base", None)
    for call in (
        lambda: sessions.session(mine, "bob"),
        lambda: sessions.model(model.model_id, "bob"),
        lambda: sessions.sampler(sampler.sampler_id, "bob"),
        lambda: sessions.reserve_model(mine, "bob", 1, "base", 8),
    ):
        with pytest.raises(NotFound):
            call()
    assert sessions.model(model.model_id, "alice") is model


def test_capacity_is_bounded_per_service_and_per_tenant():
    sessions = Sessions(3, 2, 60.0)
    a, b = sessions.open("alice"), sessions.open("bob")
    sessions.reserve_model(a, "alice", 0, "base", 8)
    sessions.reserve_model(a, "alice", 1, "base", 8)
    with pytest.raises(OverCapacity, match="this API key"):
        sessions.reserve_model(a, "alice", 2, "base", 8)
    sessions.reserve_model(b, "bob", 0, "base", 8)
    with pytest.raises(OverCapacity, match="hold 3 training clients each"):
        sessions.reserve_model(b, "bob", 1, "base", 8)


def test_training_clients_go_to_the_learner_holding_fewest_and_each_learner_has_its_capacity():
    sessions = Sessions(2, 4, 60.0, learners=2)
    a, b = sessions.open("alice"), sessions.open("bob")
    placed = [sessions.reserve_model(a, "alice", i, "base", 8).learner for i in range(3)]
    assert placed == [0, 1, 0]
    sessions.forget_model(f"{a}:train:1")  # learner 1 is free again
    assert sessions.reserve_model(b, "bob", 0, "base", 8).learner == 1
    assert sessions.reserve_model(b, "bob", 1, "base", 8).learner == 1
    with pytest.raises(OverCapacity, match="2 learner"):
        sessions.reserve_model(b, "bob", 2, "base", 8)


def test_silent_sessions_are_released_with_their_models():
    clock = Clock()
    sessions = Sessions(4, 2, 30.0, clock=clock)
    quiet, alive = sessions.open("alice"), sessions.open("bob")
    dropped = sessions.reserve_model(quiet, "alice", 0, "base", 8).model_id
    sessions.reserve_model(alive, "bob", 0, "base", 8)
    clock.now = 20.0
    sessions.heartbeat(alive, "bob")
    clock.now = 40.0
    assert sessions.take_idle() == [dropped]
    assert quiet not in sessions.sessions and alive in sessions.sessions
    assert len(sessions.models) == 1


def test_requests_of_a_model_run_in_seq_id_order_whatever_order_they_arrive_in():
    async def scenario():
        sessions = Sessions(4, 2, 60.0)
        model = sessions.reserve_model(sessions.open("alice"), "alice", 0, "base", 8)
        ran = []

        async def request(seq_id):
            model.turns.claim(seq_id)  # when it arrives
            async with model.turn(seq_id):
                ran.append(seq_id)
                await asyncio.sleep(0)

        await asyncio.gather(request(3), request(1), request(2))
        assert ran == [1, 2, 3]
        with pytest.raises(TurnRefused, match="already used"):
            await request(2)

    asyncio.run(scenario())


def test_samplers_are_released_with_their_session_and_bounded_per_tenant_least_recently_used_first():
    """The SDK never releases a sampling client (an RL loop makes one per step): they go with their session, and a
    tenant over its bound loses the one it used longest ago, never another tenant's."""
    clock = Clock()
    sessions = Sessions(4, 2, 60.0, clock=clock, max_samplers_per_tenant=3)
    mine, other = sessions.open("alice"), sessions.open("bob")
    bobs = sessions.add_sampler("bob", other, "base", "base", None)
    made = []
    for step in range(3):
        clock.now = step
        made.append(sessions.add_sampler("alice", mine, f"alice/policy-v{step}", "base", None).sampler_id)
    clock.now = 10
    sessions.sampler(made[0], "alice")  # used again: the second is now the least recently used
    newest = sessions.add_sampler("alice", mine, "alice/policy-v3", "base", None).sampler_id
    assert sorted(s for s, v in sessions.samplers.items() if v.tenant == "alice") == sorted([made[0], made[2], newest])
    with pytest.raises(NotFound):
        sessions.sampler(made[1], "alice")
    sessions.close(mine, "alice")
    assert list(sessions.samplers) == [bobs.sampler_id]
    clock.now = 100  # bob's session went silent: its sampler goes with it
    sessions.take_idle()
    assert not sessions.samplers


def test_a_revoked_tenant_loses_its_sessions_models_samplers_and_paths_and_no_one_else_does():
    sessions = Sessions(4, 2, 60.0)
    mine, other = sessions.open("alice"), sessions.open("bob")
    model = sessions.reserve_model(mine, "alice", 0, "base", 8)
    bobs = sessions.reserve_model(other, "bob", 0, "base", 8)
    sessions.add_sampler("alice", mine, "alice/policy-v1", "base", None)
    sessions.state_paths["tinker://a/weights/x"] = ("alice", 1)
    sessions.state_paths["tinker://b/weights/x"] = ("bob", 1)
    assert sessions.close_tenant("alice") == [model.model_id]
    assert list(sessions.sessions) == [other] and list(sessions.models) == [bobs.model_id]
    assert not sessions.samplers and list(sessions.state_paths) == ["tinker://b/weights/x"]
