"""Cutting a run's generations in flight (partial rollouts' fleet side): `/v1/cut` over a fake backend, and a
replica whose stand-in engine holds its requests until they are aborted."""

import asyncio
from types import SimpleNamespace

from contracts.control import Cut, CutGenerations
from contracts.serving import GenerateRequest, Sampling
from deployments.replica.shell import Replica
from tests.support.fake_fleet import ADMIN, bearer, register
from tests.support.replica_parts import REPLICA, StandInLLM, adapter_folder, adapter_slots


def test_a_run_cuts_its_own_adapters_only_and_the_admin_any(fleet):
    backend, client = fleet
    alice = bearer(register(client, "alice"))
    r = client.post(
        "/v1/cut", json={"models": ["alice/policy-v1", "alice/policy-v2", "alice/policy-v1"]}, headers=alice
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "status": "ok",
        "models": ["alice/policy-v1", "alice/policy-v2"],
        "replicas": 2,
        "failed": 0,
        "cut": 4,
    }
    assert ("CutGenerations", CutGenerations(("alice/policy-v1", "alice/policy-v2"))) in backend.calls
    for models in (["bob/policy-v1"], ["alice/policy-v1", "policy-v1"]):  # another run's, the fleet's own
        denied = client.post("/v1/cut", json={"models": models}, headers=alice)
        assert denied.status_code == 403 and "cut only its own adapters" in denied.json()["error"]["message"]
    assert client.post("/v1/cut", json={"models": ["bob/policy-v1", "policy-v3"]}, headers=ADMIN).status_code == 200
    assert client.post("/v1/cut", json={"models": ["alice/policy-v1"]}).status_code == 401


def test_bad_cut_bodies_are_400_and_a_replica_that_fails_to_cut_is_counted_not_fatal(fleet):
    backend, client = fleet
    for body in ({"models": []}, {"models": ["no spaces please"]}, {"models": "policy-v1"}, {"model": ["policy-v1"]}):
        r = client.post("/v1/cut", json=body, headers=ADMIN)
        assert r.status_code == 400, (body, r.text)
    backend.fail_cut_on = {1}
    r = client.post("/v1/cut", json={"models": ["policy-v1"]}, headers=ADMIN)
    assert r.status_code == 200 and (r.json()["replicas"], r.json()["failed"], r.json()["cut"]) == (1, 1, 1)
    backend.fail_cut_on = {0, 1}
    assert client.post("/v1/cut", json={"models": ["policy-v1"]}, headers=ADMIN).status_code == 502


class HeldLLM(StandInLLM):
    """Generates one token per request, then holds it until aborted; an aborted request answers its token so far,
    finish reason `abort`, as vLLM's abort output does."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, asyncio.Event] = {}

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.generated.append((request_id, lora_request))
        self.held[request_id] = asyncio.Event()
        await self.held[request_id].wait()
        outputs = [SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="abort", stop_reason=None)]
        yield SimpleNamespace(outputs=outputs, prompt_logprobs=None)

    async def abort(self, request_ids):
        for request_id in request_ids:
            self.held[request_id].set()


def test_a_replica_cuts_the_generations_under_the_named_adapters_and_no_other(tmp_path):
    for version in (1, 2):
        adapter_folder(tmp_path / "trl" / f"trl-policy-v{version}", bytes([version]))

    async def main():
        llm = HeldLLM()
        slots = adapter_slots(tmp_path, llm)
        replica = Replica(REPLICA, slots.engine, slots, 60.0)
        for version in (1, 2):
            await slots.load(f"trl-policy-v{version}", str(tmp_path / "trl" / f"trl-policy-v{version}"))
        old = asyncio.create_task(replica.generate(GenerateRequest([1, 2], "trl-policy-v1", Sampling(max_tokens=9))))
        new = asyncio.create_task(replica.generate(GenerateRequest([1, 2], "trl-policy-v2", Sampling(max_tokens=9))))
        while len(llm.held) < 2:
            await asyncio.sleep(0.01)
        assert await replica.control(CutGenerations(("trl-policy-v1", "someone-else-v1"))) == Cut(REPLICA, 1)
        cut = await asyncio.wait_for(old, 5)
        assert cut.choices[0].finish_reason == "abort" and cut.choices[0].token_ids == [7]
        assert not new.done()  # the other version's generation goes on
        assert await replica.control(CutGenerations(("trl-policy-v1",))) == Cut(REPLICA, 0)  # nothing left to cut
        await replica.control(CutGenerations(("trl-policy-v2",)))
        await asyncio.wait_for(new, 5)
        assert replica.inflight.requests == 0

    asyncio.run(asyncio.wait_for(main(), 30))
