"""Three runs on one shared fleet at the same time, against the same three runs one after another on it.

One 2-replica fleet of the tiny model serves both phases; each run is `python -m launch.train --fleet URL`
(tiny-cpu config, a Ray of its own, its adapters `<run>/policy-vN`). The sequence phase runs them one
after the other, the together phase all at once; the question is how much sooner a team's three
experiments finish when they share the fleet, and whether each still learns as much.

    python -m bench.shared_fleet [--steps 150] [--runs 3] [--set key=value ...]

Fleet utilisation is sampled from `/engine/stats` every second: the share of seconds in which a
replica generated tokens, and the fleet's generated tokens per second, per phase. Writes
bench/results/shared_fleet.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import print_table, write_result
from tests.support.fleet_helpers import REPO, finish_fleet_run, running_fleet, start_fleet_run

TOKEN = "bench-shared-fleet-token-51d2"
RUN_TIMEOUT_S = 3600


class Utilisation:
    """Samples the fleet's engine counters every `interval_s` while the `with` block runs."""

    def __init__(self, client, interval_s: float = 1.0):
        self.client, self.interval_s = client, interval_s
        self.busy: list[float] = []  # per sample, the share of replicas whose generated tokens grew
        self._first: dict | None = None
        self._last: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _read(self) -> dict[str, int]:
        return {r["replica"]: r["generation_tokens"] for r in self.client.engine_stats()}

    def _sample(self) -> None:
        previous = self._first = self._read()
        while not self._stop.wait(self.interval_s):
            try:
                now = self._read()
            except Exception:  # noqa: BLE001 - a missed sample; the next one counts
                continue
            self.busy.append(statistics.fmean(now.get(r, 0) > n for r, n in previous.items()) if previous else 0.0)
            previous = self._last = now

    def __enter__(self) -> Utilisation:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall_s = time.monotonic() - self.t0

    def result(self) -> dict:
        tokens = sum(self._last.values()) - sum(self._first.values()) if self._last and self._first else 0
        return {
            "replica_busy_share": round(statistics.fmean(self.busy), 3) if self.busy else None,
            "generated_tokens": tokens,
            "generated_tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else None,
        }


def run_phase(fleet, work: Path, names: list[str], steps: int, extra: tuple[str, ...], together: bool) -> dict:
    """Train `names` on the fleet, all at once or one after the other; wall time, summaries, utilisation."""
    env = {"SPOTRL_ADMIN_TOKEN": TOKEN, "SPOTRL_RUN_TOKEN": ""}
    summaries = {}
    with Utilisation(fleet.client) as use:
        if together:
            procs = {n: start_fleet_run(work, fleet.url, n, steps, env, extra) for n in names}
            summaries = {n: finish_fleet_run(p, work, n, RUN_TIMEOUT_S) for n, p in procs.items()}
        else:
            for n in names:
                summaries[n] = finish_fleet_run(
                    start_fleet_run(work, fleet.url, n, steps, env, extra), work, n, RUN_TIMEOUT_S
                )
    return {"wall_s": round(use.wall_s, 1), **use.result(), "runs": summaries}


def run_row(phase: str, name: str, s: dict) -> list:
    return [
        f"{phase}: {name}",
        f"{s['heldout_accuracy_before']:.3f}",
        f"{s['heldout_accuracy_after']:.3f}",
        f"{s['heldout_accuracy_after'] - s['heldout_accuracy_before']:+.3f}",
        f"{s['wall_time_s']:.0f} s",
        f"{s['step_s_median']:.2f} s",
        f"{s['ratio_mean']:.4f}",
    ]


def main(argv: list[str] | None = None) -> None:
    from core.config import load_config
    from tiny.build import prepare_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="Steps of each run (tiny-cpu's own: 150).")
    parser.add_argument("--runs", type=int, default=3, help="Runs per phase.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    runs = load_config(REPO / "configs/tiny-cpu.yaml", args.overrides)  # what each run trains, so the fleet serves it
    model_path = prepare_model(runs.model, runs.task, log=print)
    window = 3  # tiny-cpu's max_staleness 2, plus one
    fleet_overrides = ["rollout.max_staleness=2", f"fleet.max_loras={(args.runs + 1) * window + 1}"]
    with (
        tempfile.TemporaryDirectory(prefix="spotrl-bench-shared-") as tmp,
        running_fleet(Path(tmp), model_path, fleet_overrides, TOKEN) as fleet,
    ):
        phases = {}
        for phase, together in (("sequence", False), ("together", True)):
            names = [f"{phase[:3]}-{i}" for i in range(args.runs)]
            print(f"{phase}: {args.runs} runs of {args.steps} steps {'at once' if together else 'one after another'}")
            phases[phase] = run_phase(fleet, Path(tmp), names, args.steps, tuple(args.overrides), together)
            print(f"{phase}: {phases[phase]['wall_s']:.0f} s", flush=True)

    seq, tog = phases["sequence"], phases["together"]
    gains = {
        p: [s["heldout_accuracy_after"] - s["heldout_accuracy_before"] for s in phases[p]["runs"].values()]
        for p in phases
    }
    ratio = seq["wall_s"] / tog["wall_s"]
    print_table(
        ["run", "held-out before", "after", "gain", "wall", "step (median)", "ratio"],
        [run_row(p, n, s) for p in phases for n, s in phases[p]["runs"].items()],
        title=f"{args.runs} tiny runs of {args.steps} steps on one 2-replica fleet",
    )
    print_table(
        ["phase", "wall", "replica busy share", "generated tokens/s", "median gain"],
        [
            [
                p,
                f"{phases[p]['wall_s']:.0f} s",
                phases[p]["replica_busy_share"],
                phases[p]["generated_tokens_per_s"],
                f"{statistics.median(gains[p]):+.3f}",
            ]
            for p in phases
        ],
    )
    print(f"\ntogether finished {ratio:.2f}x sooner than in sequence (goal: 1.5x)")
    path = write_result(
        "shared_fleet",
        {
            "config": {"runs": args.runs, "steps": args.steps, "replicas": 2, "overrides": args.overrides},
            "wall_ratio_sequence_over_together": round(ratio, 3),
            "median_gain": {p: round(statistics.median(g), 3) for p, g in gains.items()},
            "phases": phases,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
