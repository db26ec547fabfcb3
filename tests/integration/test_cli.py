"""The `spotrl` command end to end, as installed (`.venv/bin/spotrl`): `spotrl train` is `make train`'s run on the
embedded default (a few steps), `spotrl eval` measures the adapter that run produced as the driver measured it,
and `spotrl runs` lists, shows and removes the runs of a fleet with its admin token."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.bucket.store import AdapterStore
from tests.integration.test_train import train_cmd
from tests.support.fleet_helpers import running_fleet

REPO = Path(__file__).resolve().parents[2]
SPOTRL = Path(sys.executable).parent / "spotrl"  # what `pip install -e .` (`make setup`) puts beside the venv's python
TOKEN = "cli-test-admin-token-5d2e"


def spotrl(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPOTRL), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ)
    )


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


@pytest.mark.slow  # ~4.5 min, a run and an evaluation; in CI launch/test_cli and `spotrl runs`/`eval` below
def test_spotrl_train_is_make_trains_run_and_spotrl_eval_measures_the_adapter_it_produced(tmp_path, tiny_model_path):
    cmd = train_cmd(tmp_path, 2, "fleet.num_replicas=1")  # one engine fewer to start on a 2-core CI machine
    assert cmd[1:3] == ["-m", "launch.train"]  # what `make train` runs, with these arguments
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    trained = spotrl("train", *cmd[3:], env=env)
    assert trained.returncode == 0 and "Traceback" not in trained.stderr, trained.stderr[-5000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [m["step"] for m in metrics] == [1, 2]
    assert summary["samples_trained"] == 2 * 16 * 8 and 0.99 <= summary["ratio_mean"] <= 1.01
    assert last_json(trained.stdout) == summary  # printed at the end, as `make train` prints it

    # The adapter it produced, as a folder (as `tinker checkpoint download` or a copy would hand it over), measured
    # on a fleet of its own as the driver starts one (one replica is enough: greedy, the same answers), from a
    # scratch bucket where it is version 1.
    folder = AdapterStore(f"file://{tmp_path}/bucket").fetch(summary["policy_version"], dest=tmp_path / "adapter")
    measured = spotrl("eval", *cmd[3:], str(folder), env=env)
    assert measured.returncode == 0 and "Traceback" not in measured.stderr, measured.stderr[-5000:]
    heldout = last_json(measured.stdout)
    assert heldout["model"] == "policy-v1" and heldout["num_problems"] == 256 and heldout["lost"] == 0
    # Greedy on the run's model and adapter: the accuracy the run measured after its last step, to a problem or two.
    assert abs(heldout["accuracy"] - summary["heldout_accuracy_after"]) <= 2 / 256, (heldout, summary)


def test_spotrl_runs_lists_shows_and_removes_a_fleets_runs_and_eval_measures_on_a_running_fleet(
    tmp_path, tiny_model_path
):
    with running_fleet(tmp_path, tiny_model_path, ["fleet.num_replicas=1", "fleet.max_loras=8"], TOKEN) as fleet:
        fleet.client.register_run("alice")
        admin = {**os.environ, "SPOTRL_ADMIN_TOKEN": TOKEN}
        at = ("--url", fleet.url)
        assert spotrl("runs", *at, env=admin).stdout.split() == ["alice"]
        shown = json.loads(spotrl("runs", "show", "alice", *at, env=admin).stdout)
        assert shown["name"] == "alice" and shown["bucket_url"].endswith("/runs/alice")
        removed = spotrl("runs", "remove", "alice", *at, env=admin)
        assert removed.returncode == 0 and removed.stdout.startswith("run alice removed")
        assert fleet.client.list_runs() == []
        anonymous = spotrl("runs", *at, env={**os.environ, "SPOTRL_ADMIN_TOKEN": ""})
        assert anonymous.returncode == 1 and anonymous.stderr.startswith("runs: ") and "401" in anonymous.stderr
        assert "Traceback" not in anonymous.stderr

        # The fleet's committed policy-v1 (a random adapter), measured on the fleet as it runs.
        measured = spotrl("eval", "--url", fleet.url, "--set", f"bucket.url=file://{tmp_path}/bucket", "1", env=admin)
        assert measured.returncode == 0, measured.stderr[-5000:]
        heldout = last_json(measured.stdout)
        assert heldout["model"] == "policy-v1" and 0.0 <= heldout["accuracy"] <= 1.0 and heldout["num_problems"] == 256
