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
    sampler = sessions.add_sampler("alice", "alice/policy-v1", "base", None)
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
