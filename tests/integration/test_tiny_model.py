"""The tiny model folder loads in transformers, peft and vLLM, and they agree on log-probs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from core.models import load_tokenizer


def test_tiny_model_is_cached_and_in_range(tiny_model_path):
    info = json.loads((Path(tiny_model_path) / "spotrl_tiny.json").read_text())
    assert 0.2 <= info["heldout_accuracy"] <= 0.8
    # `make tiny-model`: the folder on stdout, which a fleet's config names; what its build measured on stderr.
    proc = subprocess.run([sys.executable, "-m", "tiny"], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == tiny_model_path
    line = json.loads(proc.stderr.strip().splitlines()[-1])
    assert line["cached"] is True
    assert 0.2 <= line["heldout_accuracy"] <= 0.8


def test_tokenizer_round_trips_as_transformers_loads_it(tiny_model_path):
    from transformers import AutoTokenizer

    ours = load_tokenizer(tiny_model_path)
    auto = AutoTokenizer.from_pretrained(tiny_model_path)  # what vLLM gets for model_type=qwen2
    text = "Compute 12+34. Answer: 46"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert auto.decode(auto(text)["input_ids"]) == text


def test_loads_in_transformers_and_peft(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in peft_model.parameters()) / 10


def test_vllm_and_transformers_agree_on_logprobs(tiny_model_path):
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.vllm_logprobs_check", tiny_model_path],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] > 0
    assert result["max_abs_err"] < 1e-4, result


def test_the_multi_turn_tiny_model_starts_in_a_learnable_range_on_whole_episodes():
    """Warmed up on chained episodes until greedy held-out episodes cross 30%: between 20% and 60%, measured again."""
    from transformers import AutoModelForCausalLM

    from app.tasks.problems import load_task
    from core.config import CONFIG_DIR, load_config
    from tiny.build import prepare_model
    from tiny.chains import greedy_episode_accuracy

    cfg = load_config(CONFIG_DIR / "tiny-multiturn.yaml")
    path = prepare_model(cfg.model, cfg.task)
    info = json.loads((Path(path) / "spotrl_tiny.json").read_text())
    assert 0.2 <= info["heldout_accuracy"] <= 0.6
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    measured = greedy_episode_accuracy(model, load_tokenizer(path), load_task(cfg.task).heldout, cfg.task.digits + 3)
    assert measured == info["heldout_accuracy"]
