"""The replica (`deployments.replica.shell`) without an engine: its request path over its parts and its side of
`contracts.serving` (values vLLM refuses, an engine that dies mid-request, requests for versions it does not
hold), and the control calls it answers itself (pause leases)."""

import asyncio
import pickle

import pytest

from contracts.control import Pause, Resume
from contracts.serving import (
    BUNDLE_METHOD,
    GENERATE_METHOD,
    BadRequest,
    EngineDied,
    GenerateBundle,
    GenerateRequest,
    ModelNotFound,
    ReplicaError,
    ReplicaUnavailable,
    Sampling,
)
from deployments.replica.shell import Replica, VLLMReplica
from tests.support.replica_parts import REPLICA, StandInLLM, adapter_folder, adapter_slots


def _replica(tmp_path, llm=None, *, pause_lease_s=60.0, **slot_sizes) -> Replica:
    slots = adapter_slots(tmp_path, llm, **slot_sizes)
    return Replica(REPLICA, slots.engine, slots, pause_lease_s)


def test_the_routed_methods_exist():
    assert callable(getattr(VLLMReplica, GENERATE_METHOD)) and callable(getattr(VLLMReplica, BUNDLE_METHOD))


def test_a_bundle_answers_each_request_apart_and_fails_whole_only_when_the_replica_does(tmp_path):
    scored = Sampling(max_tokens=1, prompt_logprobs=0)
    bundle = GenerateBundle(
        (
            GenerateRequest([1, 2, 3], "base", scored),
            GenerateRequest([1, 2, 4], "base", Sampling(max_tokens=1, temperature=9.0)),  # vLLM refuses it: its own 400
            GenerateRequest([1, 2, 5], "base", scored),
        )
    )
    first, refused, last = asyncio.run(_replica(tmp_path).generate_bundle(bundle))
    assert isinstance(refused, BadRequest)
    assert [c.token_ids for c in first.choices] == [[7]] and first.choices[0].prompt_logprobs[2] == {3: (-1.0, 1)}
    assert last.choices[0].prompt_logprobs[2] == {5: (-1.0, 1)}  # each its own sequence scored
    from vllm.v1.engine.exceptions import EngineDeadError

    with pytest.raises(EngineDied):  # the engine died under it: the whole call fails, for the ingress to resend
        asyncio.run(_replica(tmp_path, StandInLLM(EngineDeadError(), dies=True)).generate_bundle(bundle))


def test_replica_errors_keep_their_class_and_status_through_pickling():
    errors = (
        ReplicaError("bucket unavailable", 503),
        BadRequest("bad"),
        ReplicaError("conflict", 409),
        EngineDied("x"),
    )
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and (back.status, back.message) == (error.status, error.message)


def test_what_the_engine_refuses_at_generate_is_a_400(tmp_path):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineGenerateError

    wrapped = EngineGenerateError()
    wrapped.__cause__ = ValueError("sampling distribution replay requires temperature > 0")
    for error in (VLLMValidationError("logprobs: at most 20", parameter="logprobs", value=99), wrapped):
        replica = _replica(tmp_path, StandInLLM(error))
        with pytest.raises(BadRequest, match="logprobs|replay"):
            asyncio.run(replica.generate(GenerateRequest([1, 2], "base", Sampling(logprobs=99))))
    # A values check never reaches the engine: nor does a request that would load an adapter first.
    llm = StandInLLM(RuntimeError("unreachable"))
    with pytest.raises(BadRequest):
        asyncio.run(_replica(tmp_path, llm).generate(GenerateRequest([1], "policy-v5", Sampling(temperature=9.0))))
    assert llm.generated == []


def test_an_engine_that_dies_serving_a_request_says_so_unlike_a_dead_replica(tmp_path):
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    replica = _replica(tmp_path, StandInLLM(EngineDeadError(), dies=True))
    request = GenerateRequest([1, 2], "base", Sampling(seed=2**63))
    with pytest.raises(EngineDied) as died:
        asyncio.run(replica.generate(request))
    assert died.value.status == 503 and not isinstance(died.value, ReplicaUnavailable)
    with pytest.raises(ReplicaUnavailable):  # dead before the next request came: that one is blameless
        asyncio.run(replica.generate(GenerateRequest([3], "base", Sampling())))
    alive = _replica(tmp_path, StandInLLM(EngineGenerateError()))  # a request failed, the engine lives on: neither
    with pytest.raises(EngineGenerateError):
        asyncio.run(alive.generate(request))


def test_a_burst_of_requests_for_unknown_versions_lists_the_bucket_at_most_once(tmp_path, monkeypatch):
    replica = _replica(tmp_path, window=3)
    listings = []

    def versions() -> list[int]:  # v3 and v2 committed; v0 never committed, or collected
        listings.append(1)
        return [3, 2]

    monkeypatch.setattr(replica.slots.sources.store, "versions", versions)

    async def burst():
        requests = [replica.generate(GenerateRequest([1], f"policy-v{4 + i}", Sampling())) for i in range(900)]
        requests += [replica.generate(GenerateRequest([1], "policy-v0", Sampling())) for i in range(100)]
        return await asyncio.gather(*requests, return_exceptions=True)

    results = asyncio.run(burst())
    assert all(isinstance(r, ModelNotFound) for r in results)
    assert len(listings) <= 1  # not one a request


def test_a_pause_is_a_lease_that_ends_by_itself_and_resume_or_a_new_pause_renews_it(tmp_path):
    llm = StandInLLM()
    replica = _replica(tmp_path, llm, pause_lease_s=0.2)

    async def scenario():
        assert (await replica.control(Pause("keep"))).lease_s == 0.2 and llm.paused
        await asyncio.sleep(0.1)
        await replica.control(Pause("keep"))  # renewed: counts from now
        await asyncio.sleep(0.15)
        renewed = llm.paused
        await asyncio.sleep(0.15)
        expired = not llm.paused
        await replica.control(Pause("keep"))
        await replica.control(Resume())
        await asyncio.sleep(0.3)  # a resumed lease never fires later (it would resume a pause made since)
        llm.paused = True
        await asyncio.sleep(0.05)
        return renewed, expired, llm.paused

    assert asyncio.run(scenario()) == (True, True, True)


def test_an_evicted_committed_version_is_loaded_again_on_demand_never_a_404(tmp_path):
    llm = StandInLLM()
    replica = _replica(tmp_path, llm, window=2, max_loras=3)
    slots = replica.slots
    for version in (1, 2, 3, 4):
        slots.sources.store.publish(adapter_folder(tmp_path / f"v{version}", f"v{version}".encode()), version)

    async def load_all_then_ask_for_v1():  # one event loop, as a replica has
        for version in (1, 2, 3, 4):
            await slots.load(f"policy-v{version}", f"policy-v{version}")
        assert "policy-v1" not in slots.names  # evicted for v4
        return await replica.generate(GenerateRequest([1, 2], "policy-v1", Sampling()))

    served = asyncio.run(load_all_then_ask_for_v1())
    assert served.choices[0].token_ids == [7]
    assert llm.generated[-1].lora_name.startswith("policy-v1@")
    assert "policy-v1" in slots.names and len(llm.added) - len(llm.removed) == 3
    # Pinned (v3, v4: the newest two) stay; the least recently used unpinned one made room.
    assert {"policy-v3", "policy-v4"} <= set(slots.names)
    with pytest.raises(ModelNotFound):  # never committed: still a 404
        asyncio.run(replica.generate(GenerateRequest([1, 2], "policy-v0", Sampling())))


def test_a_scoring_request_answers_the_prompts_logprobs_on_every_choice(tmp_path):
    replica = _replica(tmp_path)
    scoring = Sampling(max_tokens=1, prompt_logprobs=0)
    (choice,) = asyncio.run(replica.generate(GenerateRequest([1, 2, 3], "base", scoring))).choices
    assert choice.prompt_logprobs == [None, {2: (-0.5, 1)}, {3: (-1.0, 1)}]  # vLLM's, as plain numbers
    (plain,) = asyncio.run(replica.generate(GenerateRequest([1, 2, 3], "base", Sampling(max_tokens=1)))).choices
    assert plain.prompt_logprobs is None
