"""Building the learner's model: which precision and sharding a device gets, fp32 masters, the log-prob head."""

from types import SimpleNamespace

import pytest
import torch

from app.learner.logprobs import LogProbHead
from app.learner.model import build_lora_model, logprob_head, mixed_precision_policy, uses_fsdp
from tests.support.learner_parts import learner_config, random_model


def test_bf16_on_cuda_computes_in_bf16_and_reduces_in_fp32_elsewhere_no_policy():
    policy = mixed_precision_policy("bfloat16", "cuda")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy("float32", "cuda") is None  # nothing to cast
    assert mixed_precision_policy("bfloat16", "cpu") is None  # the CPU learner computes as before
    assert mixed_precision_policy("float32", "cpu") is None


def test_a_single_gpu_learner_runs_fsdp_too_a_single_cpu_learner_does_not():
    assert uses_fsdp(1, "cuda") and uses_fsdp(2, "cuda") and uses_fsdp(2, "cpu")
    assert not uses_fsdp(1, "cpu")


def test_bf16_base_gets_fp32_lora_masters_and_a_log_prob_head_on_the_tied_weight(tmp_path):
    cfg = learner_config(logprob_chunk_tokens=7)
    cfg.model.dtype = "bfloat16"
    model, _ = build_lora_model(cfg, random_model(tmp_path / "m"), torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    head = logprob_head(model)
    assert isinstance(head, LogProbHead) and head.chunk_tokens == 7
    assert head.head.weight is model.get_input_embeddings().weight  # tied: one weight, not a copy
    assert not head.head.weight.requires_grad


def test_the_model_revision_reaches_from_pretrained(monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = {}

    def fake_from_pretrained(path, **kwargs):
        seen.update(kwargs, path=path)
        raise RuntimeError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    cfg = learner_config()
    cfg.model.revision = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(RuntimeError, match="stop here"):
        build_lora_model(cfg, "Org/model", torch.device("cpu"))
    assert seen["path"] == "Org/model" and seen["revision"] == cfg.model.revision


def test_a_model_without_the_head_is_refused():
    plain = SimpleNamespace(get_output_embeddings=lambda: torch.nn.Linear(4, 8, bias=False))
    with pytest.raises(TypeError, match="LogProbHead"):
        logprob_head(plain)
