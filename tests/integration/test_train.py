"""End to end: `python -m launch.train` on the tiny config, with real Ray, Serve, vLLM and a file:// bucket."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.fleet_helpers import assert_nothing_left_behind, free_port

REPO = Path(__file__).resolve().parents[2]


def train_cmd(tmp_path: Path, steps: int, *extra: str, config: str = "configs/tiny-cpu.yaml") -> list[str]:
    sets = [
        f"train.max_steps={steps}",
        f"logging.output_dir={tmp_path}",
        "logging.run_name=smoke",
        f"bucket.url=file://{tmp_path}/bucket",
        f"bucket.cache_dir={tmp_path}/cache",
        f"fleet.port={free_port()}",
        "logging.progress_bar=false",
        "logging.diagnose_every=5",
        *extra,
    ]
    return [
        sys.executable,
        "-m",
        "launch.train",
        "--config",
        config,
        *(a for s in sets for a in ("--set", s)),
    ]


def run_train(tmp_path: Path, steps: int, *extra: str, config: str = "configs/tiny-cpu.yaml"):
    """`python -m launch.train` to completion; its summary, per-step metrics and output, after checking it ran cleanly."""
    proc = subprocess.run(
        train_cmd(tmp_path, steps, *extra, config=config),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    assert " ERROR " not in proc.stderr, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == steps and [m["step"] for m in metrics] == list(range(1, steps + 1))
    return summary, metrics, proc.stderr + proc.stdout


def assert_a_healthy_run(tmp_path: Path, summary: dict, metrics: list[dict], output: str, steps: int) -> None:
    """What every finished run of the embedded default shows: each step's samples trained once (`steps`: the run's,
    across its starts), newer versions sampled and trained within the
    staleness bound, the importance ratio at 1, its metrics and summary complete, the verdict printed, versions in the
    bucket."""
    from core.bucket.store import AdapterStore

    assert summary["samples_trained"] == steps * 16 * 8
    assert summary["policy_version"] >= 2
    assert max(m["sample/version_max"] for m in metrics) >= 2  # groups sampled under newer versions were trained
    # The admission bound keeps groups within rollout.max_staleness (2) as a rule; finished work is trained up to the hard
    # limit (twice that), never beyond.
    assert summary["staleness_max"] <= 4
    assert all(m["sample/staleness_max"] <= 4 for m in metrics)
    assert summary["dropped_stale_share"] == 0.0 and "partial_share" in summary
    assert 0.99 <= summary["ratio_mean"] <= 1.01
    for key in (
        "reward",
        "ratio",
        "perf/step_s",
        "perf/rollout_wait_s",
        "sample/rollout_queue_size",
        "rollout/inflight",
        "batch/pad_frac",
        "policy_version",
    ):
        assert all(key in m for m in metrics), key
    for key in (
        "heldout_accuracy_before",
        "heldout_accuracy_after",
        "affinity_share",
        "dropped_stale_share",
        "reward_first_10pct",
        "reward_last_10pct",
        "wall_time_s",
        "staleness_mean",
    ):
        assert summary[key] is not None, key
    assert "bottleneck:" in output or "drift alarm:" in output  # the verdict, printed when it changes and at the end
    assert len(AdapterStore(f"file://{tmp_path}/bucket").versions()) >= 2


@pytest.mark.slow
def test_a_multi_turn_run_trains_episodes_and_reports_turns_and_affinity_by_turn(tmp_path):
    steps = 8
    summary, metrics, _ = run_train(tmp_path, steps, config="configs/tiny-multiturn.yaml")
    assert summary["samples_trained"] == steps * 16 * 8
    assert 0.99 <= summary["ratio_mean"] <= 1.01  # model tokens only, scored as the fleet sampled them
    assert all(m["env/episodes"] == 128 and 1 <= m["env/turns_mean"] <= 3 for m in metrics)
    assert max(m["env/turns_max"] for m in metrics) >= 2  # episodes went past their first turn
    assert all("env/turn_reward/1" in m and "env/truncated_share" in m for m in metrics)
    assert summary["env_errors_total"] == 0 and 1 <= summary["env_turns_mean"] <= 3
    assert {"1", "2"} <= set(summary["affinity_by_turn"])
    assert summary["heldout_accuracy_before"] is not None and summary["heldout_accuracy_after"] is not None


@pytest.mark.slow
def test_the_calculator_tool_environment_runs_end_to_end(tmp_path):
    summary, metrics, _ = run_train(
        tmp_path,
        3,
        "env.name=calculator",
        "env.kwargs={max_calls: 1}",
        "env.max_turns=2",
        "sampling.max_completion_length=8",
    )
    assert all(m["env/episodes"] == 128 for m in metrics) and summary["env_errors_total"] == 0
    assert 0.99 <= summary["ratio_mean"] <= 1.01


@pytest.mark.slow  # ~3 min, as its multi-turn siblings
def test_a_judge_of_whole_episodes_scores_a_multi_turn_run_on_the_base_model(tmp_path):
    """The recipe's second-chance environment (a wrong answer earns a retry: episodes of one or two turns) judged
    besides its own reward: a logprob judge on the base model reads each episode's transcript (one scoring pass per
    group, through the run's fleet seat), every trained episode judged, none failed. The judge's prompts get room
    beyond the episode's budget (`model.max_model_len`); the held-out split is measured by the environment alone
    (`eval.reward_funcs` names no judge)."""
    steps, n = 2, 8
    judge = "{ep: {template: '{transcript} ok? ', verdict: {kind: logprob, yes_token: '1', no_token: '0'}}}"
    summary, metrics, _ = run_train(
        tmp_path,
        steps,
        "env.name=examples.env_second_chance:SecondChance",
        "env.kwargs={attempts: 2}",
        "env.max_turns=2",
        "env.max_episode_tokens=64",
        "model.max_model_len=128",
        f"judges={judge}",
        "task.reward_funcs=[ep]",
        "eval.reward_funcs=[exact_answer]",
    )
    assert summary["env_errors_total"] == 0 and all(m["env/episodes"] == 16 * n for m in metrics)
    assert max(m["env/turns_max"] for m in metrics) == 2  # retries: the judge read transcripts of two turns
    last = metrics[-1]
    judged = last["judge/ep/samples"]
    # Every trained episode was judged (a group is judged whole, before it is queued); groups sampled beyond the last
    # step may have been judged too.
    assert judged >= steps * 16 * n and judged % n == 0, last
    assert last["judge/ep/requests"] >= judged / n  # one request per group at least
    assert last["judge/ep/failed"] == 0 and last["judge/failed_total"] == 0 and last["reward/errors_total"] == 0


@pytest.mark.slow
def test_a_trl_environment_factory_run_learns_to_call_tools_on_the_tiny_model(tmp_path):
    """`configs/tiny-trl-tools.yaml`: TRL's `CalculatorEnv`, unchanged, played by the tiny model built to call tools;
    held-out episodes (greedy, rewarded by its `get_reward`) up by 10 points, no episode lost to the protocol."""
    steps = 100
    summary, metrics, _ = run_train(tmp_path, steps, config="configs/tiny-trl-tools.yaml")
    assert summary["env_errors_total"] == 0 and all(m["env/errors_total"] == 0 for m in metrics)
    assert 0.99 <= summary["ratio_mean"] <= 1.01
    assert max(m["env/turns_max"] for m in metrics) >= 3  # add, submit, then the answer
    assert summary["heldout_accuracy_after"] >= summary["heldout_accuracy_before"] + 0.10, summary


@pytest.mark.slow  # ~3 min, two runs; in CI test_spot's notices on the learner's node stand for it
def test_a_notice_for_the_machine_checkpoints_and_stops_cleanly_and_the_same_command_resumes_then_says_finished(
    tmp_path, tiny_model_path
):
    """The embedded default on a spot machine: a SIGTERM (the scheduler's notice) ends the run after the step under way
    with a checkpoint, exit code 0 and one line, and leaves no process of it behind (Ray, its workers, the vLLM
    engines: the same unwinding as a Ctrl-C, whose exit code 130 `test_shared_training.py` checks); the same command
    resumes from that step, trains each step and each group once, and once finished is reported in one line without
    starting anything or touching its files. Across the two starts it is a healthy run (`assert_a_healthy_run`): the
    embedded default's smoke test, which no longer costs a run of its own."""
    from core.bucket.store import CheckpointStore

    steps, env = 8, {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    cmd = train_cmd(tmp_path, steps, "learner.save_steps=100")  # no periodic checkpoint: only the notice's
    metrics = tmp_path / "smoke" / "metrics.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 900
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        time.sleep(1)
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert descendants, "the run should have started Ray and vLLM processes"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]
    assert_nothing_left_behind(descendants)
    stopped = metrics.read_text().count("\n")
    line = "run smoke was preempted (sigterm notice, "
    assert line in out and f"checkpointed at step {stopped} " in out and "the same command resumes it" in out, out[
        -3000:
    ]
    assert CheckpointStore(f"file://{tmp_path}/bucket").latest() == stopped
    assert "Traceback" not in out

    resumed = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"resuming run smoke from step {stopped} (policy-v" in resumed.stderr
    trained = [json.loads(x) for x in (tmp_path / "smoke" / "trained_groups.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, steps + 1))  # no step lost, none trained twice
    groups = [g for t in trained for g in t["groups"]]
    assert len(groups) == len(set(groups)) == steps * 16
    summary_file = tmp_path / "smoke" / "summary.json"
    summary = json.loads(summary_file.read_text())
    assert summary["heldout_accuracy_before"] is not None  # the run's own baseline, kept from its first start
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, steps + 1))
    assert summary["steps"] == steps  # the whole run's, the first start's steps read back from its metrics
    assert_a_healthy_run(tmp_path, summary, logged, resumed.stderr + resumed.stdout, steps)
    kept = summary_file.read_bytes(), summary_file.stat().st_mtime_ns

    t0 = time.monotonic()
    finished = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert finished.returncode == 0 and time.monotonic() - t0 < 60, finished.stderr[-3000:]
    assert "run smoke is finished (8 steps" in finished.stderr and "train.max_steps=16" in finished.stderr
    assert (summary_file.read_bytes(), summary_file.stat().st_mtime_ns) == kept  # its files untouched
    assert "Ray" not in finished.stderr  # nothing was started


def test_evaluation_during_training_logs_a_curve_while_the_steps_go_on_and_keeps_the_best_version(tmp_path):
    """Every 2 steps the newest version is evaluated on the held-out split, a reasoning-gym dataset and an extra set
    whose reward takes 2 s a problem (`tests.support.slow_reward`): each evaluation runs for several steps, which go
    on meanwhile (a point lands steps after the step whose version it measured); one due while another runs waits, a
    second one replaces it (skipped, counted), and each measures the version committed last as it starts; the summary
    lists the curve with the final evaluation last, names the best version and keeps its adapter."""
    steps = 12
    extra = (
        "eval.extra=[{name: slow, task: {name: arithmetic, digits: 2, num_heldout: 4, seed: 99, "
        "reward_funcs: [tests.support.slow_reward:slow_exact_answer]}}, "
        "{name: rg, task: {name: reasoning_gym, reward_funcs: [reasoning_gym], num_train: 16, num_heldout: 16, "
        "datasets: {basic_arithmetic: {weight: 1, config: {min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2, "
        "operators: ['+'], allow_parentheses: false, allow_negation: false}}}}}]"
    )
    sets = ("task.num_heldout=32", "eval.every_steps=2", "eval.keep_best=true", extra)  # each evaluation about 2-3 s
    summary, metrics, output = run_train(tmp_path, steps, *sets)
    rows = [m for m in metrics if "eval/version" in m]
    assert rows, output[-3000:]
    for m in rows:
        assert m["step"] > m["eval/step"] >= 2
        assert all(0 <= m[f"eval/{name}accuracy"] <= 1 for name in ("", "slow/", "rg/"))
        assert m["eval/seconds"] >= 2.0 and "eval/skipped" in m
    first = rows[0]
    # The steps went on while it ran: those after the step it measured and before the one it landed at (which is
    # logged after it ended, so may end later than it) took less than it.
    during = [m for m in metrics if first["eval/step"] < m["step"] < first["step"]]
    assert len(during) >= 2 and during[-1]["time"] - during[0]["time"] < first["eval/seconds"]
    curve = summary["eval_curve"]
    assert [p["step"] for p in curve[: len(rows)]] == [m["eval/step"] for m in rows]  # then one landed at the end
    assert curve[-1]["step"] == steps and curve[-1]["version"] == summary["policy_version"]
    assert curve[-1]["accuracy"] == summary["heldout_accuracy_after"] and {"slow", "rg"} <= set(curve[-1])
    best = max(curve, key=lambda p: p["accuracy"])
    assert (summary["best_version"], summary["best_accuracy"]) == (best["version"], best["accuracy"])
    assert summary["best_adapter_version"] == best["version"]
    assert (Path(summary["best_adapter"]) / "adapter_config.json").is_file()
    # trackio got the same points (its offline SQLite store under TRACKIO_DIR).
    logged = [
        json.loads(m)
        for db in (tmp_path / "trackio").glob("**/*.db")
        for (m,) in sqlite3.connect(db).execute("SELECT metrics FROM metrics")
    ]
    assert sum("eval/accuracy" in m for m in logged) == len(rows), len(logged)
    due = steps // 2 - 1  # steps 2, 4, ..., 10: not the last, which the final evaluation measures
    assert len(curve) - 1 + summary["eval_skipped"] <= due  # a retry answers those due meanwhile


def trl_env_run(tmp_path: Path, factory: str, steps: int = 2) -> list[str]:
    """The driver on the embedded default with a TRL environment of tests/support/trl_flaky.py (no tools: the tiny
    model's prompt fits 128 tokens), scored by a keyword-style reward."""
    return train_cmd(
        tmp_path,
        steps,
        f"env.factory=tests.support.trl_flaky:{factory}",
        "task.reward_funcs=[tests.support.trl_flaky:counted_right]",
        "model.max_model_len=128",
    )


@pytest.mark.slow  # ~2 min; in CI test_episodes and test_openenv's failing episodes stand for it
def test_a_reset_that_raises_on_some_problems_costs_those_episodes_and_the_run_finishes(tmp_path):
    """The evaluation before step 1 plays each held-out problem as a group of one: a `reset` that raised on one of
    them used to end the run with a traceback. Now each such episode scores unsolved and is counted, the training
    groups it costs are dropped and counted, and the keyword-style reward scores without an error."""
    from app.tasks.problems import load_task
    from core.config import load_config

    cmd = trl_env_run(tmp_path, "ResetRaisesSometimes")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env=os.environ.copy())
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    heldout = load_task(load_config("configs/tiny-cpu.yaml", []).task).heldout
    broken = sum(int(p.answer) % 4 == 0 for p in heldout)
    assert 0 < broken < len(heldout)
    assert summary["heldout_lost_before"] == broken and summary["heldout_lost_after"] == broken
    assert f"{broken} of {len(heldout)} episodes lost, scored unsolved" in proc.stderr
    assert summary["steps"] == 2 and summary["dropped_failed_total"] > 0
    assert summary["reward_errors_total"] == 0 and summary["reward_errors"] == {}  # the keyword-style reward scored


@pytest.mark.slow  # ~1.5 min; in CI test_rollout's every-recent-group-failed test stands for it
def test_an_environment_that_fails_on_every_problem_stops_the_run_with_one_line(tmp_path):
    proc = subprocess.Popen(
        trl_env_run(tmp_path, "ResetAlwaysRaises"), cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    descendants = []
    while proc.poll() is None and not descendants:  # the run's tree, to check nothing of it outlives the run
        time.sleep(1.0)
        descendants = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 1 and "Traceback" not in err, err[-5000:]
    assert err.strip().splitlines()[-1] == (
        "evaluation: every one of the 256 held-out episodes was lost, the last with RuntimeError: every environment "
        "of the group failed to start (reset_raised)"
    )
    assert_nothing_left_behind(descendants)


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (  # the reasoning-gym splits: found by the rollout 52 s in, after Ray and the fleet
            [
                "task.name=reasoning_gym",
                "task.reward_funcs=[reasoning_gym]",
                "task.datasets={chain_sum: {weight: 1, config: {min_terms: 2, max_terms: 3, min_digits: 1, "
                "max_digits: 1}}}",
                "task.num_train=4000",
            ],
            "config error: task.num_train=4000: the datasets gave 3438 distinct questions",
        ),
        (  # a TRL environment with tools on the tiny model without its tool template: 46 s in, no hint of the fix
            ["env.factory=examples.trl_calculator:CalculatorEnv", "task.reward_funcs=[]", "model.max_model_len=256"],
            "config error: model.tiny.warmup_tools: the first problem's prompt with CalculatorEnv's 2 tools takes",
        ),
        (  # a context too short for the task: a traceback at the model's build
            [
                "task.name=reasoning_gym",
                "task.reward_funcs=[reasoning_gym]",
                "task.datasets={letter_counting: {weight: 1, config: {}}}",
                "model.max_model_len=96",
                "task.num_train=300",
            ],
            "config error: model.max_model_len=96: the task's longest problem takes",
        ),
    ],
    ids=["reasoning_gym_splits", "tools_budget", "context"],
)
def test_a_late_config_error_is_one_line_and_exit_2_before_anything_starts(tmp_path, sets, line):
    t0 = time.monotonic()
    proc = subprocess.run(
        train_cmd(tmp_path, 2, *sets), cwd=REPO, capture_output=True, text=True, timeout=600, env=os.environ.copy()
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "starting the fleet" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-3000:]
    print(f"exit 2 after {time.monotonic() - t0:.1f} s")
