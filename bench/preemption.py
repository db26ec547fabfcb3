"""The same preemptions with and without a spot notice, side by side in one run: what a warning is worth.

One spot-like cluster on this machine (`tests.support.spot_cluster`: a head, a learner node, two rollout nodes, SeaweedFS
S3, a fake cloud metadata server per node on 127.0.0.1) and one run in legs, each a driver that resumes where
the previous one stopped and loses one node in its middle:

- learner node, no notice: killed `--kill-after` steps into the leg (checkpoints every `--save-steps`);
- learner node, GCP notice: the same steps in, noticed, killed 30 s later (the notice's deadline);
- learner node, AWS notice: the same, killed once two more steps were committed (well inside the 120 s);
- replica node, no notice: killed while long generations run on it, its replacement added at once;
- replica node, AWS notice (120 s) and a notice 35 s ahead: noticed while they run, killed once its replacement
  serves. Serve stops the noticed replica once its replacement runs or `graceful_shutdown_timeout_s` (30 s) before
  the deadline, whichever is first, and the replica hands back what still runs then.

Per leg: groups trained twice, learner-seconds lost (steps trained, then lost with the node and trained
again), time from the kill to the next step, requests failed, and for the replica legs generations sent again
from their start (their tokens lost) against those handed back and continued. Writes
bench/results/preemption.json.

    python -m bench.preemption [--steps 8] [--save-steps 4] [--kill-after 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.common import print_table, write_result
from tests.support.spot_cluster import spot_cluster
from tests.support.spot_legs import LONG_TOKENS, learner_leg, replica_leg

EXTRA = (
    "spot.poll_interval_s=1",  # every other spot setting as shipped
    "model.max_model_len=256",  # room for generations long enough to be in flight when a replica goes
)


def learner_legs(spot, steps: int, kill_after: int) -> dict[str, dict]:
    node = lambda: spot.metadata_of(spot.learner_node)  # noqa: E731 - the learner's node changes every leg
    legs = {
        "learner, no notice": (None, 0.0),
        "learner, GCP notice (30 s)": (lambda: node().gcp_preempt(), 30.0),
        "learner, AWS notice (120 s)": (lambda: node().aws_notice(in_s=120), None),
    }
    out = {}
    for name, (notify, kill_after_s) in legs.items():
        t0 = time.time()
        out[name] = learner_leg(spot, steps, notify, kill_after_s, wait_steps=kill_after)
        print(f"{name}: {out[name]} ({time.time() - t0:.0f} s)", flush=True)
    return out


def replica_legs(spot) -> dict[str, dict]:
    out = {}
    legs = {"replica, no notice": None, "replica, AWS notice (120 s)": 120.0, "replica, notice 35 s ahead": 35.0}
    for name, notice_in_s in legs.items():
        t0 = time.time()
        figures = replica_leg(spot, notice_in_s)
        figures["long_tokens_ok"] = all(len(c["token_ids"]) == LONG_TOKENS for c in figures.pop("long_choices"))
        out[name] = figures
        print(f"{name}: {figures} ({time.time() - t0:.0f} s)", flush=True)
    return out


def table(legs: dict[str, dict]) -> list[list]:
    def cell(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    rows = []
    for name, f in legs.items():
        failed = f["requests_failed"] + f.get("long_requests_failed", 0)
        rows.append(
            [
                name,
                cell(f.get("groups_trained_twice"), "{}"),
                cell(f.get("learner_seconds_lost")),
                cell(f.get("notice_to_checkpoint_s")),
                cell(f["kill_to_next_step_s"]),
                failed,
                cell(f.get("replica_failures"), "{}"),
                cell(f.get("handed_back"), "{}"),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="Steps per leg.")
    parser.add_argument("--save-steps", type=int, default=4, help="learner.save_steps (the no-notice checkpoints).")
    parser.add_argument("--kill-after", type=int, default=3, help="Steps into a learner leg before its node goes.")
    args = parser.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as tmp:
        with spot_cluster(Path(tmp), save_steps=args.save_steps, metadata=True, extra=EXTRA) as spot:
            legs = {**learner_legs(spot, args.steps, args.kill_after), **replica_legs(spot)}
    headers = [
        "node lost",
        "groups trained twice",
        "learner-s lost",
        "notice to ckpt s",
        "kill to next step s",
        "requests failed",
        "sent again from start",
        "handed back",
    ]
    print_table(headers, table(legs), title="The same preemptions with and without a notice (one run, this machine)")
    base, gcp = legs["learner, no notice"], legs["learner, GCP notice (30 s)"]
    print(
        f"\nlearner: {base['learner_seconds_lost']:.1f} learner-s and {base['groups_trained_twice']} groups lost "
        f"without a notice, {gcp['learner_seconds_lost']:.1f} and {gcp['groups_trained_twice']} with GCP's 30 s; "
        f"kill to next step {base['kill_to_next_step_s']:.1f} s vs {gcp['kill_to_next_step_s']:.1f} s "
        f"(x{gcp['kill_to_next_step_s'] / base['kill_to_next_step_s']:.2f})"
    )
    path = write_result(
        "preemption",
        {
            "config": {**vars(args), "extra": list(EXTRA), "cpus": os.cpu_count()},
            "legs": legs,
            "wall_s": time.time() - t0,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
