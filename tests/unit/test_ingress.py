"""The ingress's backend over a Serve handle (`deployments.ingress.ServeBackend`), with a stand-in handle:
what it retries, what it leaves out of a broadcast."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from app.retry import Backoff
from deployments.protocol import (
    GENERATE_METHOD,
    BadRequest,
    Generated,
    GenerateRequest,
    ModelNotFound,
    ReplicaUnavailable,
    Sampling,
)


class _GenerateHandle:
    """Answers generation calls with the given outcomes in turn (an exception is raised, anything else returned)."""

    def __init__(self, *outcomes):
        self.outcomes, self.sent = list(outcomes), []

    def options(self, method_name):
        assert method_name == GENERATE_METHOD
        return self

    def remote(self, request):
        self.sent.append(request)
        outcome = self.outcomes.pop(0)

        async def reply():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return reply()


@pytest.fixture
def no_pauses(monkeypatch):
    import deployments.ingress as ingress

    monkeypatch.setattr(ingress, "GENERATE_BACKOFF", Backoff(attempts=3, first_s=0.0, jitter=False))


def test_a_generation_whose_replica_died_is_sent_again_unchanged(no_pauses):
    from deployments.ingress import ServeBackend

    answer = Generated("b", [])
    handle = _GenerateHandle(ActorDiedError(), ReplicaUnavailable("engine died"), answer)
    request = GenerateRequest([1, 2, 3], "policy-v1", Sampling(n=2))
    assert asyncio.run(ServeBackend(handle).generate(request)) is answer
    assert handle.sent == [request] * 3  # the router picks a live replica for the same request


def test_a_generation_the_replica_refused_is_not_sent_again(no_pauses):
    from deployments.ingress import ServeBackend

    for refusal in (BadRequest("prompt too long"), ModelNotFound("policy-v9")):
        handle = _GenerateHandle(refusal, Generated("b", []))
        with pytest.raises(type(refusal)):
            asyncio.run(ServeBackend(handle).generate(GenerateRequest([1], "policy-v9", Sampling())))
        assert len(handle.sent) == 1
    dead = [ActorDiedError() for _ in range(3)]
    handle = _GenerateHandle(*dead)
    with pytest.raises(ActorDiedError):  # every attempt landed on a dying replica: the last error goes up
        asyncio.run(ServeBackend(handle).generate(GenerateRequest([1], "policy-v1", Sampling())))
    assert len(handle.sent) == 3


def test_a_replica_that_died_is_left_out_of_a_broadcast_not_counted_as_failing():
    from deployments.ingress import ServeBackend

    class Results:
        async def results_async(self, return_exceptions):
            return [{"replica": "a", "loaded": True}, ActorDiedError(), ModelNotFound("policy-v9")]

    class Handle:
        def broadcast(self, method, *args):
            return Results()

    results = asyncio.run(ServeBackend(Handle()).broadcast("load_adapter", "policy-v1", "ref", "id"))
    assert results[0] == {"replica": "a", "loaded": True}
    assert len(results) == 2 and isinstance(results[1], ModelNotFound)  # a real failure still counts
