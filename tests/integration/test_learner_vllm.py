"""The learner scores vLLM's samples as vLLM does, so `ratio` starts at 1; its adapters load in vLLM and peft.

On the real tiny model, float32, at a sampling temperature other than 1 (vLLM returns post-temperature
log-probs with `logprobs_mode="processed_logprobs"`, as the fleet runs it). The adapter is the one
the learner *published* to the bucket after a large step, fetched back: it is what replicas load.

vLLM spawns workers, so its part runs in a subprocess: this file is also that script
(`python tests/integration/test_learner_vllm.py MODEL ADAPTER OUT.json PROMPTS.json`).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

TEMPERATURE = 0.7
PAIRS = [(12, 34), (7, 99), (55, 5), (81, 19)]


def sample_with_vllm(model_path: str, adapter_dir: str, prompts: list[list[int]]) -> list[list[dict]]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=model_path,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_model_len=64,
        kv_cache_memory_bytes=128 * 2**20,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    params = SamplingParams(n=4, temperature=TEMPERATURE, max_tokens=8, logprobs=0, seed=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=LoRARequest("policy-v1", 1, adapter_dir)
    )
    return [
        [
            {
                "ids": list(s.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)],
            }
            for s in out.outputs
        ]
        for out in outs
    ]


if __name__ == "__main__":
    model, adapter, out_file, prompts_file = sys.argv[1:5]
    Path(out_file).write_text(json.dumps(sample_with_vllm(model, adapter, json.loads(Path(prompts_file).read_text()))))
    sys.exit(0)


import pytest  # noqa: E402 - the script above must not need pytest
import torch  # noqa: E402

from app.learner.rank import LearnerRank  # noqa: E402
from app.objectives import Objectives  # noqa: E402
from app.tasks.problems import arithmetic_prompt  # noqa: E402
from contracts.rollouts import Group, RolloutBatch, Sample  # noqa: E402
from core.bucket.store import AdapterStore  # noqa: E402
from core.config import RunConfig  # noqa: E402
from core.models import load_tokenizer  # noqa: E402


def _config(tmp_path) -> RunConfig:
    cfg = RunConfig()
    cfg.lora.rank, cfg.lora.alpha = 1, 2.0  # the seed recipe
    cfg.sampling.temperature = TEMPERATURE
    cfg.train.learning_rate = 0.05  # one large step, so the adapter is far from the identity
    cfg.bucket.url = f"file://{tmp_path}/bucket"
    cfg.bucket.cache_dir = str(tmp_path / "cache")
    return cfg


def _warm_groups(prompts: list[list[int]], eos: int, objectives: Objectives) -> list[Group]:
    """Arbitrary scored completions, annotated: any gradient will do to move the adapter away from zero."""
    digits = [[(13 * i + 7 * j) % 300 + 20 for j in range(5)] + [eos] for i in range(4)]
    return [
        objectives.annotate(
            Group(g, f"p{g}", p, 0, [Sample(d, [-2.0] * len(d), float(i % 2)) for i, d in enumerate(digits)])
        )
        for g, p in enumerate(prompts)
    ]


def test_learner_logprobs_match_vllm_and_published_adapter_loads(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(tiny_model_path)
    prompts = [tokenizer(arithmetic_prompt(a, b), add_special_tokens=False)["input_ids"] for a, b in PAIRS]
    cfg = _config(tmp_path)
    learner = LearnerRank(cfg, tiny_model_path)
    learner.setup()
    assert learner.start().policy_version == 0
    objectives = Objectives.from_config(cfg)
    warm = _warm_groups(prompts, tokenizer.eos_token_id, objectives)
    assert learner.train_step(RolloutBatch(warm)).policy_version == 1
    adapter_dir = AdapterStore.from_config(cfg).fetch(1)

    out_file, prompts_file = tmp_path / "vllm.json", tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, __file__, tiny_model_path, str(adapter_dir), str(out_file), str(prompts_file)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sampled = json.loads(out_file.read_text())
    groups = [
        objectives.annotate(
            Group(100 + g, f"p{g}", p, 1, [Sample(s["ids"], s["logprobs"], float(i % 2)) for i, s in enumerate(outs)])
        )
        for g, (p, outs) in enumerate(zip(prompts, sampled, strict=True))
    ]
    n_tokens = sum(len(s.completion_ids) for g in groups for s in g.samples)
    assert n_tokens > 20

    # The learner, through its training path (packing, temperature), agrees with vLLM token by token.
    scored = learner.score(groups)
    err = max(
        abs(a - b)
        for g, sc in zip(groups, scored, strict=True)
        for s, lps in zip(g.samples, sc, strict=True)
        for a, b in zip(s.sampling_logprobs, lps, strict=True)
    )
    assert err < 1e-4
    metrics = learner.forward_backward(groups)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_ratio/region_mean"] == 0.0

    # The adapter matters (the base model scores these tokens differently), so vLLM did apply it.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    sample = groups[0].samples[0]
    ids = torch.tensor([groups[0].prompt_ids + sample.completion_ids])
    first = len(groups[0].prompt_ids) - 1
    with torch.no_grad():
        base_lp = torch.log_softmax(base(ids).logits[0, first:-1] / TEMPERATURE, -1)
        base_lp = base_lp.gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
        assert (base_lp - torch.tensor(scored[0][0])).abs().max() > 1e-3

        # peft loads the published folder and agrees with the learner.
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        peft_lp = torch.log_softmax(peft_model(ids).logits[0, first:-1] / TEMPERATURE, -1)
        peft_lp = peft_lp.gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
    torch.testing.assert_close(peft_lp, torch.tensor(scored[0][0]), atol=1e-5, rtol=0)
