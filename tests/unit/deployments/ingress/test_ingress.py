"""The ingress's backend over a Serve handle (`deployments.ingress.shell.ServeBackend`), with a stand-in handle:
what it retries, what it leaves out of a broadcast, and how it stops a request that kills engines."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from contracts.retry import Backoff
from contracts.serving import (
    BadRequest,
    EngineDied,
    GenerateBundle,
    Generated,
    GenerateRequest,
    ModelNotFound,
    ReplicaError,
    ReplicaUnavailable,
    Sampling,
)
from tests.support.serve_handles import GenerateHandle


@pytest.fixture
def no_pauses(monkeypatch):
    import deployments.ingress.shell as ingress

    monkeypatch.setattr(ingress, "GENERATE_BACKOFF", Backoff(attempts=3, first_s=0.0, jitter=False))


def test_a_generation_whose_replica_died_is_sent_again_unchanged(no_pauses):
    from deployments.ingress.shell import ServeBackend

    answer = Generated("b", [])
    handle = GenerateHandle(ActorDiedError(), ReplicaUnavailable("engine died"), answer)
    request = GenerateRequest([1, 2, 3], "policy-v1", Sampling(n=2))
    assert asyncio.run(ServeBackend(handle).generate(request)) is answer
    assert handle.sent == [request] * 3  # the router picks a live replica for the same request


def test_a_generation_the_replica_refused_is_not_sent_again(no_pauses):
    from deployments.ingress.shell import ServeBackend

    for refusal in (BadRequest("prompt too long"), ModelNotFound("policy-v9")):
        handle = GenerateHandle(refusal, Generated("b", []))
        with pytest.raises(type(refusal)):
            asyncio.run(ServeBackend(handle).generate(GenerateRequest([1], "policy-v9", Sampling())))
        assert len(handle.sent) == 1
    dead = [ActorDiedError() for _ in range(3)]
    handle = GenerateHandle(*dead)
    with pytest.raises(ActorDiedError):  # every attempt landed on a dying replica: the last error goes up
        asyncio.run(ServeBackend(handle).generate(GenerateRequest([1], "policy-v1", Sampling())))
    assert len(handle.sent) == 3


def test_a_replica_that_died_is_left_out_of_a_broadcast_not_counted_as_failing():
    from contracts.control import LoadAdapter, Loaded
    from deployments.ingress.shell import ServeBackend

    class Results:
        async def results_async(self, return_exceptions):
            return [Loaded("a", loaded=True), ActorDiedError(), ModelNotFound("policy-v9")]

    class Handle:
        def broadcast(self, method, *args):
            assert (method, args) == ("control", (LoadAdapter("policy-v1", "ref", "id"),))
            return Results()

    results = asyncio.run(ServeBackend(Handle()).broadcast(LoadAdapter("policy-v1", "ref", "id")))
    assert results[0] == Loaded("a", loaded=True)
    assert len(results) == 2 and isinstance(results[1], ModelNotFound)  # a real failure still counts


def _backend(handle, clock=None, **table):
    from deployments.ingress.poison import PoisonTable
    from deployments.ingress.shell import ServeBackend

    return ServeBackend(handle, PoisonTable(clock=clock or (lambda: 0.0), **table))


def test_a_request_during_which_an_engine_died_is_sent_once_more(no_pauses):
    answer = Generated("b", [])
    handle = GenerateHandle(EngineDied("engine died"), answer)
    request = GenerateRequest([1, 2, 3], "policy-v1", Sampling(seed=7))
    assert asyncio.run(_backend(handle).generate(request)) is answer  # a bystander of another request's crash
    assert handle.sent == [request] * 2


def test_a_request_that_kills_two_engines_gets_a_500_and_is_refused_for_a_while(no_pauses):
    from deployments.control.errors import as_api_error
    from deployments.ingress.poison import PoisonRequest

    now = [0.0]
    poison = GenerateRequest([1, 2, 3], "policy-v1", Sampling(seed=2**63))  # fatal in vLLM's GPU model runner
    handle = GenerateHandle(EngineDied("a"), EngineDied("b"), Generated("c", []), Generated("d", []))
    backend = _backend(handle, clock=lambda: now[0], ttl_s=60.0)
    with pytest.raises(PoisonRequest) as killed:
        asyncio.run(backend.generate(poison))
    assert len(handle.sent) == 2  # two replicas lost, not the fleet
    assert as_api_error(killed.value, "generation failed").status == 500  # never a 503 that clients send again
    now[0] = 20.0
    with pytest.raises(PoisonRequest, match="refused for another 40 s"):
        asyncio.run(backend.generate(poison))
    assert len(handle.sent) == 2  # refused by its fingerprint, never sent to a third replica
    other = GenerateRequest([1, 2, 3], "policy-v1", Sampling(seed=7))
    assert asyncio.run(backend.generate(other)).replica == "c"  # another seed is another request
    now[0] = 61.0
    assert asyncio.run(backend.generate(poison)).replica == "d"  # the refusal has expired


def test_engine_deaths_count_apart_from_replica_deaths(monkeypatch):
    """A preempted node is retried as before (6 attempts in all); engine deaths among them are capped at two."""
    import deployments.ingress.shell as ingress
    from deployments.ingress.poison import PoisonRequest

    monkeypatch.setattr(ingress, "GENERATE_BACKOFF", Backoff(attempts=6, first_s=0.0, jitter=False))
    answer = Generated("b", [])
    handle = GenerateHandle(*[ActorDiedError() for _ in range(5)], answer)
    assert asyncio.run(_backend(handle).generate(GenerateRequest([1], "policy-v1", Sampling()))) is answer
    assert len(handle.sent) == 6
    handle = GenerateHandle(ActorDiedError(), EngineDied("a"), ReplicaUnavailable("gone"), EngineDied("b"), answer)
    with pytest.raises(PoisonRequest):
        asyncio.run(_backend(handle).generate(GenerateRequest([2], "policy-v1", Sampling())))
    assert len(handle.sent) == 4
    # Out of attempts after one engine death: a 500 (no client resends it), but not refused later.
    handle = GenerateHandle(*[ActorDiedError() for _ in range(5)], EngineDied("a"), answer)
    backend = _backend(handle)
    request = GenerateRequest([3], "policy-v1", Sampling())
    with pytest.raises(ReplicaError) as failed:
        asyncio.run(backend.generate(request))
    assert failed.value.status == 500 and not isinstance(failed.value, PoisonRequest | EngineDied)
    assert asyncio.run(backend.generate(request)) is answer


def test_an_engine_death_is_recognised_through_rays_wrapper():
    from ray.exceptions import RayTaskError

    from deployments.ingress.shell import engine_died, replica_failed

    wrapped = RayTaskError("generate", "traceback", EngineDied("died")).as_instanceof_cause()
    assert engine_died(wrapped) and not replica_failed(wrapped)
    assert replica_failed(ActorDiedError()) and not engine_died(ActorDiedError())
    assert not engine_died(ReplicaUnavailable("engine was already dead"))


def test_the_poison_table_forgets_after_its_ttl_and_stays_bounded():
    from deployments.ingress.poison import PoisonRequest, PoisonTable, fingerprint

    now = [0.0]
    table = PoisonTable(ttl_s=10.0, max_entries=3, clock=lambda: now[0])
    keys = [fingerprint(GenerateRequest([i], "policy-v1", Sampling())) for i in range(5)]
    assert len(set(keys)) == 5
    assert fingerprint(GenerateRequest([0], "policy-v1", Sampling())) == keys[0]  # the same request, the same print
    assert fingerprint(GenerateRequest([0], "policy-v1", Sampling(top_p=0.5))) != keys[0]
    for i, key in enumerate(keys):
        now[0] = float(i)
        table.add(key)
    assert len(table) == 3  # the two oldest were evicted
    table.check(keys[0])
    with pytest.raises(PoisonRequest):
        table.check(keys[4])
    now[0] = 13.5  # keys[2] (added at 2) and keys[3] (at 3) have expired
    table.check(keys[3])
    with pytest.raises(PoisonRequest):
        table.check(keys[4])
    assert len(table) == 1


def _scored(*tail: int, seed=None) -> GenerateRequest:
    """A scored sequence of a group: the group's prompt and one completion."""
    return GenerateRequest([1, 2, 3, *tail], "policy-v1", Sampling(max_tokens=1, prompt_logprobs=0, seed=seed))


def test_a_bundle_is_one_call_answered_apart_and_sent_again_whole_when_its_replica_died(no_pauses):
    requests = [_scored(4), _scored(5), _scored(6)]
    answers = [Generated("a", []), BadRequest("too long"), Generated("a", [])]
    handle = GenerateHandle(ActorDiedError(), answers)
    assert asyncio.run(_backend(handle).generate_many(requests)) == answers  # each its own answer, in order
    assert handle.sent == [GenerateBundle(tuple(requests))] * 2


def test_an_engine_death_under_a_bundle_sends_each_request_again_alone_so_poison_is_found_alone(no_pauses):
    from deployments.ingress.poison import PoisonRequest

    poison, bystander = _scored(4, seed=2**63), _scored(5)
    # The bundle kills an engine; alone, the poison kills one (sent once more), the bystander is served, the poison
    # kills a second: refused.
    handle = GenerateHandle(EngineDied("a"), EngineDied("b"), Generated("c", []), EngineDied("d"))
    backend = _backend(handle, ttl_s=60.0)
    first, second = asyncio.run(backend.generate_many([poison, bystander]))
    assert isinstance(first, PoisonRequest) and second == Generated("c", [])
    assert handle.sent == [GenerateBundle((poison, bystander)), poison, bystander, poison]
    # Refused by its fingerprint from now on, alone: the others of its next bundle are served.
    handle.outcomes = [[Generated("e", [])]]
    first, second = asyncio.run(backend.generate_many([poison, _scored(6)]))
    assert isinstance(first, PoisonRequest) and second == Generated("e", [])
    assert handle.sent[-1] == GenerateBundle((_scored(6),))


def test_a_bundled_request_its_replica_handed_back_is_continued_elsewhere(no_pauses):
    from contracts.serving import SampledChoice

    long = GenerateRequest([1, 2, 3, 4], "policy-v1", Sampling(max_tokens=1, prompt_logprobs=0))
    cut = Generated("a", [], handed_back=True)  # handed back before it started: sent again whole
    whole = Generated("b", [SampledChoice(0, [9], None, None, "length", None)])
    handle = GenerateHandle([Generated("a", []), cut], whole)
    backend = _backend(handle)
    answers = asyncio.run(backend.generate_many([_scored(5), long]))
    assert answers[1] is whole and handle.sent[1] == long and backend.spot["handed_back"] == 1
