"""The in-cluster load (`Ingress.load_adapter`, what the learner calls through a Serve handle): the same
all-or-nothing broadcast as `POST /v1/load_lora_adapter`, which a caller that gives up cannot cut in half."""

import asyncio

import pytest

from contracts.control import LoadAdapter
from tests.support.fake_fleet import FakeBackend


def _ingress(backend):
    from deployments.ingress.shell import Ingress

    ingress = Ingress.__new__(Ingress)  # no tokenizer, no Serve: only the backend matters here
    ingress._backend = backend
    return ingress


def test_a_handle_load_reaches_every_replica():
    backend = FakeBackend()
    reply = asyncio.run(_ingress(backend).load_adapter("policy-v1", "policy-v1"))
    assert reply == {"status": "ok", "lora_name": "policy-v1", "replicas": 2, "newly_loaded": 2}
    assert backend.adapters == {0: {"policy-v1"}, 1: {"policy-v1"}}


def test_a_handle_load_that_fails_anywhere_is_rolled_back_and_says_why():
    backend = FakeBackend()
    backend.fail_load_on = {1}
    with pytest.raises(RuntimeError, match=r"^400 load of 'policy-v1' failed on 1 of 2 replicas, rolled back"):
        asyncio.run(_ingress(backend).load_adapter("policy-v1", "/etc/passwd"))
    assert backend.adapters == {0: set(), 1: set()}


class _SlowBackend(FakeBackend):
    """Replicas that answer a while after loading, so that the caller can give up in the middle."""

    async def broadcast(self, command):
        results = await super().broadcast(command)
        if isinstance(command, LoadAdapter):
            await asyncio.sleep(0.2)
        return results


def test_a_caller_that_gives_up_never_leaves_a_load_half_done():
    from deployments.control.broadcast import load_everywhere

    backend = _SlowBackend()
    backend.fail_load_on = {1}

    async def give_up_then_wait():
        caller = asyncio.ensure_future(load_everywhere(backend, "policy-v1", "p"))
        await asyncio.sleep(0.05)
        caller.cancel()  # an HTTP client that disconnected, a handle call cancelled past its deadline
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.7)  # the broadcasts go on without the caller

    asyncio.run(give_up_then_wait())
    # Rolled back, and the fleet resumed in case the caller had paused it for the load (`control.broadcast`).
    assert [c[0] for c in backend.calls] == ["LoadAdapter", "UndoLoad", "Resume"]
    assert backend.adapters == {0: set(), 1: set()}  # rolled back, not left loaded on replica 0 alone
