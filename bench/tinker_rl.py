"""RL written with the Tinker SDK alone, on the user's own fleet: the issue's acceptance loop, and its API overhead.

The loop is what a Tinker user writes (the cookbook's shape): each step samples a group per prompt from the latest
sampler weights, scores it, turns group-normalised rewards (GRPO's `(r - mean) / std`, as `make train` does) into
per-token advantages, calls `forward_backward(..., "importance_sampling")`, `optim_step(AdamParams)` and
`save_weights_for_sampler` (every step), and samples the next step from those weights. Only the task (the tiny
model's arithmetic: prompts, gold answers) comes from spotrl; every model call is the SDK's, against the Tinker API
beside a real 2-replica fleet (`launch/tinker.py`).

    python -m bench.tinker_rl [--steps 40] [--prompts 16] [--group 8] [--skip-per-sample] [--skip-make-train]

Held-out accuracy (greedy, the task's held-out split, through the fleet) before and after; per step the wall time
of sampling, of forward_backward + optim_step, and of save_weights_for_sampler (the API's overhead against `make
train`, whose step does the same work without HTTP, futures or a bucket commit per step). A second arm (unless
`--skip-per-sample`) runs the same loop sampling as the cookbook's RL loops do, one request of one sample per
environment (16 prompts x 8 samples: 128 requests a step, where the acceptance loop sends 16 of 8). Then, the
baseline (unless `--skip-make-train`), the same steps of `launch.train` (tiny-cpu: 16 prompts x 8 samples, the same optimizer,
`make_train_adam`, and completion length) run afterwards on the same box, and the ratio of loop times is reported.
Writes bench/results/tinker_rl.json. `tests/integration/test_tinker_api.py` checks one step of the loop (on-policy
log-probs, the step along the advantages) and, marked slow, that 50 steps raise held-out accuracy by 20 points.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

MAX_TOKENS = 6
ADVANTAGE_EPS = 1e-8
TOKEN = "bench-tinker-rl-token-7d3e"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def heldout_accuracy(sampler, tokenizer, problems) -> float:
    """Share of held-out problems whose greedy completion is exactly the answer (all requested at once: futures)."""
    from tinker import types

    greedy = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(encode(tokenizer, p.prompt)), 1, greedy) for p in problems]
    right = 0
    for problem, future in zip(problems, futures, strict=True):
        tokens = future.result().sequences[0].tokens
        right += tokenizer.decode(tokens, skip_special_tokens=True).strip() == problem.answer
    return right / len(problems)


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float):
    """Tinker's RL datum: the sequence shifted by one, the sampler's log-probs and the advantage on the completion."""
    from tinker import types

    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + tokens,
            "logprobs": [0.0] * pad + list(logprobs),
            "advantages": [0.0] * pad + [advantage] * len(tokens),
        },
    )


def make_train_adam():
    """`AdamParams` of the optimizer `make train` steps with (tiny-cpu's train section: AdamW at 1e-3, torch's
    beta2 and eps, gradients clipped at norm 1), not the SDK's defaults (beta2 0.95, eps 1e-12, no clipping): the
    two loops then differ by the API alone."""
    from tinker import types

    from core.config import load_config

    train = load_config().train
    return types.AdamParams(
        learning_rate=train.learning_rate,
        beta1=train.adam_beta1,
        beta2=train.adam_beta2,
        eps=1e-8,
        weight_decay=train.weight_decay,
        grad_clip_norm=train.max_grad_norm,
    )


def rl_loop(
    url: str,
    api_key: str,
    base_model: str,
    train,
    heldout,
    steps: int,
    prompts_per_step: int = 16,
    group: int = 8,
    seed: int = 0,
    adam=None,
    per_sample: bool = False,
) -> dict:
    """The loop, SDK calls only; held-out accuracy before and after, reward and timings per step. `adam`: the
    `AdamParams` of every `optim_step`, by default `make train`'s optimizer (`make_train_adam`). `per_sample`: each
    group sampled as `group` requests of one sample (the cookbook's shape) rather than one request of `group`."""
    import tinker
    from tinker import types

    adam = adam or make_train_adam()
    rng = random.Random(seed)
    report: dict = {"steps": [], "prompts_per_step": prompts_per_step, "group": group, "per_sample": per_sample}
    with tinker.ServiceClient(base_url=url, api_key=api_key) as service:
        training = service.create_lora_training_client(base_model=base_model, rank=8, seed=seed).result()
        tokenizer = training.get_tokenizer()
        sampler = service.create_sampling_client(base_model=base_model).result()
        report["accuracy_before"] = heldout_accuracy(sampler, tokenizer, heldout)
        params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
        started = time.perf_counter()
        for step in range(steps):
            t0 = time.perf_counter()
            batch = rng.sample(train, prompts_per_step)
            prompts = [encode(tokenizer, p.prompt) for p in batch]
            shape = [1] * group if per_sample else [group]  # samples per request of one group
            futures = [[sampler.sample(types.ModelInput.from_ints(ids), n, params) for n in shape] for ids in prompts]
            data, rewards = [], []
            for problem, ids, requests in zip(batch, prompts, futures, strict=True):
                sequences = [s for request in requests for s in request.result().sequences]
                scores = [
                    float(tokenizer.decode(s.tokens, skip_special_tokens=True).strip() == problem.answer)
                    for s in sequences
                ]
                rewards += scores
                mean = sum(scores) / len(scores)
                std = statistics.pstdev(scores)
                for seq, score in zip(sequences, scores, strict=True):
                    if std > 0 and seq.tokens:  # a group that agrees teaches nothing
                        advantage = (score - mean) / (std + ADVANTAGE_EPS)  # GRPO's, as `make train` computes it
                        data.append(rl_datum(ids, list(seq.tokens), list(seq.logprobs), advantage))
            t1 = time.perf_counter()
            if data:
                fwd_bwd = training.forward_backward(data, "importance_sampling")
                optim = training.optim_step(adam)
                fwd_bwd.result()
                optim.result()
            t2 = time.perf_counter()
            path = training.save_weights_for_sampler(f"step-{step}").result().path
            sampler = service.create_sampling_client(model_path=path).result()
            t3 = time.perf_counter()
            report["steps"].append(
                {
                    "reward": sum(rewards) / len(rewards),
                    "datums": len(data),
                    "sample_s": t1 - t0,
                    "train_s": t2 - t1,
                    "save_s": t3 - t2,
                }
            )
        report["loop_s"] = time.perf_counter() - started
        report["accuracy_after"] = heldout_accuracy(sampler, tokenizer, heldout)
    report["gain_points"] = 100 * (report["accuracy_after"] - report["accuracy_before"])
    return report


def make_train_arm(steps: int, work: Path) -> dict:
    """`launch.train` (tiny-cpu config, a fleet of its own) for `steps` steps: its held-out accuracy and loop time."""
    import json
    import os
    import subprocess
    import sys

    from tests.support.fleet_helpers import REPO

    # No evaluation during training: the SDK's loops evaluate before and after only.
    sets = [
        f"train.max_steps={steps}",
        "eval.every_steps=0",
        f"logging.output_dir={work}",
        "logging.run_name=make-train",
    ]
    # Its bucket in the bench's folder too: the config's own (runs/make-train/bucket) would hold the last bench's
    # finished run, and the same command would then only say so.
    sets += [f"bucket.url=file://{work}/bucket", f"bucket.cache_dir={work}/cache", "logging.progress_bar=false"]
    cmd = [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "TRACKIO_DIR": str(work / "trackio")}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((work / "make-train" / "summary.json").read_text())
    return {
        "accuracy_before": summary["heldout_accuracy_before"],
        "accuracy_after": summary["heldout_accuracy_after"],
        "loop_s": summary["loop_wall_s"],
    }


def main(argv: list[str] | None = None) -> None:
    from bench.common import print_table, write_result
    from core.config import load_config
    from tests.support.fleet_helpers import running_fleet

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument(
        "--skip-per-sample", action="store_true", help="leave out the arm that sends one request per sample"
    )
    parser.add_argument(
        "--skip-make-train", action="store_true", help="leave out the baseline: launch.train for the same steps"
    )
    args = parser.parse_args(argv)

    import httpx

    from app.kinds.registry import problems_of
    from deployments.tinker.settings import TinkerSettings
    from launch.tinker import start_tinker, stop_tinker
    from tiny.build import prepare_model

    cfg = load_config()
    model_path = prepare_model(cfg.model, cfg.task)
    splits = problems_of(cfg)
    with tempfile.TemporaryDirectory(prefix="bench-tinker-rl-") as tmp:
        work = Path(tmp)
        with running_fleet(work, model_path, ["fleet.max_loras=12"], TOKEN) as fleet:
            settings = TinkerSettings.of_fleet(
                fleet.cfg.own_fleet(), fleet.url, fleet.base, fleet.model_path, cache_dir=str(work / "cache")
            )
            url = start_tinker(settings, TOKEN)
            try:
                key = httpx.post(
                    f"{url}/api/v1/admin/keys",
                    json={"name": "bench", "lora_rank": 8},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    timeout=60,
                ).json()["api_key"]
                loop = (url, key, fleet.base, splits.train, splits.heldout, args.steps, args.prompts, args.group)
                report = rl_loop(*loop)
                if not args.skip_per_sample:
                    report["per_sample_arm"] = rl_loop(*loop, per_sample=True)
            finally:
                stop_tinker()
        if not args.skip_make_train:
            report["make_train"] = make_train_arm(args.steps, work / "make-train-arm")
            for arm in (report, report.get("per_sample_arm")):
                if arm is not None:
                    arm["loop_ratio_vs_make_train"] = arm["loop_s"] / report["make_train"]["loop_s"]
    arms = {"groups": report, "one per sample": report.get("per_sample_arm")}
    arms = {name: arm for name, arm in arms.items() if arm is not None}
    timings = ("sample_s", "train_s", "save_s")
    rows = [
        [name, *(f"{statistics.median(s[t] for s in arm['steps']):.2f}" for t in timings)] for name, arm in arms.items()
    ]
    print_table(["arm: median per step, seconds", *timings], rows)
    for name, arm in arms.items():
        ratio = f"; {arm['loop_ratio_vs_make_train']:.2f}x make train's loop" if "make_train" in report else ""
        print(
            f"{name}: held-out {100 * arm['accuracy_before']:.1f}% -> {100 * arm['accuracy_after']:.1f}% "
            f"({arm['gain_points']:+.1f} points) in {args.steps} steps, loop {arm['loop_s']:.0f} s{ratio}"
        )
    if "make_train" in report:
        arm = report["make_train"]
        print(
            f"make train, same steps: held-out {100 * arm['accuracy_before']:.1f}% -> {100 * arm['accuracy_after']:.1f}%, "
            f"loop {arm['loop_s']:.0f} s"
        )
    write_result("tinker_rl", report)


if __name__ == "__main__":
    main()
