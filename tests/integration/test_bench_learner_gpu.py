"""bench.learner_gpu (and its profile) run where the GPU benchmark runs: no Ray, no vLLM, no pydantic; and it runs the
seed recipe.

The GPU box has torch, transformers, peft, accelerate, safetensors and numpy only. Here the bench runs
at its small shape on the CPU in a fresh interpreter where those modules (and a few more this venv has
and that box lacks) cannot be imported, the way a missing package looks to both `import` and
`importlib.util.find_spec`. Its stand-in for `RunConfig` must hold the seed config's values.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import learner_gpu

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("ray", "vllm", "pydantic", "pydantic_core", "s3fs", "trackio", "datasets", "trl")
WRAPPER = """
import runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None  # as if not installed
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
assert all(sys.modules[name] is None for name in {blocked!r})
"""


def run_blocked(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` in a fresh interpreter where BLOCKED cannot be imported; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER.format(blocked=BLOCKED, module=module), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_small_run_needs_no_ray_vllm_or_pydantic(tmp_path):
    proc = run_blocked("bench.learner_gpu", "--small", "--device", "cpu", "--out", str(tmp_path))
    assert "MFU" in proc.stdout
    result = json.loads((tmp_path / "learner_gpu_small.json").read_text())
    assert not (tmp_path / "learner_gpu.json").exists()  # small figures never stand for the GPU run's
    assert result["device_name"] == "cpu" and result["config"]["world_size"] == 1
    step = learner_gpu.SMALL_STEP
    assert result["samples"] == step["prompts"] * step["group_size"] and result["microbatches"] > 1
    assert result["step_s"] > 0 and result["trained_tok_s"] > 0 and result["peak_memory_bytes"] > 0
    assert len(result["step_s_all"]) == 2 and result["mfu_step_percent"] > 0
    tinker = json.loads((tmp_path / "tinker_learner_gpu_small.json").read_text())  # the Tinker learner's leg
    assert "error" not in tinker, tinker["error"]
    assert tinker["device"] == "cpu" and len(tinker["step_s_all"]) == 2 and tinker["tok_s"] > 0
    assert all(loss == loss for loss in tinker["loss"])  # no NaN


def test_the_profile_runs_without_ray_vllm_or_pydantic_and_names_where_the_step_went(tmp_path):
    proc = run_blocked("bench.learner_gpu_profile", "--small", "--rows", "5", "--out", str(tmp_path))
    text = (tmp_path / "learner_gpu_profile.txt").read_text()
    assert text in proc.stdout and "profiled step" in text and "aten::mm" in text
    assert "'enable_gqa': 0." in text  # the attention probe timed sdpa with grouped KV heads


def test_without_cuda_the_full_run_is_skipped_and_writes_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        return  # on a GPU box the full run is the real one
    learner_gpu.main(["--out", str(tmp_path)])
    assert "no CUDA device: skipped" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_the_stand_in_config_is_the_seed_recipe():
    from core.config import CONFIG_DIR, load_config

    seed = load_config(CONFIG_DIR / "qwen2.5-math-1.5b.yaml")
    cfg = learner_gpu.bench_config()
    for section, values in learner_gpu.SEED_RECIPE.items():
        for field in values:
            assert getattr(getattr(cfg, section), field) == getattr(getattr(seed, section), field), f"{section}.{field}"
    assert [vars(spec) for spec in cfg.objectives] == [spec.model_dump() for spec in seed.objectives]
    assert cfg.learner.token_budget == 16384 and seed.sampling.num_generations == learner_gpu.SEED_STEP["group_size"]
    assert seed.train.num_prompts_per_step == learner_gpu.SEED_STEP["prompts"]
