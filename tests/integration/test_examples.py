"""The recipes of docs/extending.md run as a user runs them (`python -m examples.<recipe> key=value ...`): a short
run each, with real Ray, Serve, vLLM and a file:// bucket. The kind's and the objective's runs (in make test) show
that one file is enough: their configs reach the rollout's and the learner's Ray workers, which import the recipe's
module to read them and so register its kind or objective there too. The reward's and the environment's, whose names
the driver resolves as it resolves any, are `slow`; the route's recipe is served by test_fleet.py's shared fleet."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.fleet_helpers import free_port


def run_recipe(module: str, tmp_path: Path, *args: str, steps: int = 2) -> tuple[dict, list[dict], str]:
    """`python -m examples.<module> steps=<steps> run_name=smoke ...` with the run's files under `tmp_path`; its
    summary, metrics and output, once it ran cleanly."""
    sets = [
        f"logging.output_dir={tmp_path}",
        f"bucket.url=file://{tmp_path}/bucket",
        f"bucket.cache_dir={tmp_path}/cache",
        f"fleet.port={free_port()}",
        "fleet.num_replicas=1",
        "logging.progress_bar=false",
        "task.num_heldout=16",
        "train.num_prompts_per_step=4",
    ]
    argv = [f"steps={steps}", "run_name=smoke", f"sets={json.dumps(sets)}", *args]
    proc = subprocess.run(
        [sys.executable, "-m", f"examples.{module}", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")},
    )
    output = proc.stderr + proc.stdout
    assert proc.returncode == 0 and "Traceback" not in output, output[-5000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == steps and [m["step"] for m in metrics] == list(range(1, steps + 1))
    return summary, metrics, output


def test_the_kind_recipe_trains_on_its_own_problems(tmp_path):
    summary, metrics, _ = run_recipe("kind_inline", tmp_path, "num_problems=24", "num_heldout=8")
    assert all(m["reward"] >= 0 for m in metrics)
    assert 0 <= summary["heldout_accuracy_after"] <= 1


@pytest.mark.slow  # ~1.7 min, a run; in CI tests/unit/examples/test_objective_rloo.py checks its loss
def test_the_objective_recipe_trains_with_its_loss_alone(tmp_path):
    _, metrics, _ = run_recipe("objective_rloo", tmp_path, "is_cap=1.5")
    assert all("rloo/is_weight" in m and 0 < m["rloo/is_weight"] <= 1.5 for m in metrics)
    assert not any("clip_ratio/region_mean" in m for m in metrics)  # GRPO's metric: not in this run's loss


@pytest.mark.slow
def test_the_reward_recipe_scores_with_its_partial_credit(tmp_path):
    _, metrics, _ = run_recipe("reward_partial_credit", tmp_path)
    assert all(0 <= m["reward/logged/parsed_share"] <= 1 for m in metrics)


@pytest.mark.slow
def test_the_environment_recipe_plays_second_chances(tmp_path):
    _, metrics, _ = run_recipe("env_second_chance", tmp_path, "attempts=2")
    assert all(1 <= m["env/turns_mean"] <= 2 for m in metrics)


@pytest.mark.slow
def test_the_route_recipe_brings_up_a_fleet_with_its_endpoint_and_asks_it(tmp_path):
    sets = [f"fleet.port={free_port()}", "fleet.num_replicas=1", f"bucket.url=file://{tmp_path}/bucket"]
    proc = subprocess.run(
        [sys.executable, "-m", "examples.route_tokenize", f"sets={json.dumps(sets)}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stderr + proc.stdout)[-5000:]
    # Its one line of JSON; Ray's own lines (a raylet's, at shutdown) may come after it on stdout.
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith('{"url"')]
    answer = json.loads(line)
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 64
