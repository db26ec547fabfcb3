"""`make bench`: every benchmark, one after the other, each comparing ours with its baseline in one run."""

from __future__ import annotations

import importlib
import sys
import time

# learner_gpu prints "no CUDA device: skipped" on a CPU box and writes nothing.
BENCHMARKS = [
    "adapter_sync",
    "router",
    "request_shapes",
    "learner",
    "learner_memory",
    "learner_gpu",
    "pipeline",
    "vs_trl",
    "shared_fleet",
    "preemption",
    "partial_rollouts",
    "distill",
    "self_distill",
    "dynamic_sampling",
    "off_policy_masks",
    "tinker_rl",
    "judge",
]


def main() -> None:
    only = sys.argv[1:] or BENCHMARKS
    failed = []
    for name in only:
        print(f"\n===== bench.{name} =====", flush=True)
        t0 = time.time()
        try:
            importlib.import_module(f"bench.{name}").main([])
        except SystemExit as e:
            if e.code not in (0, None):
                failed.append(name)
                print(f"bench.{name} failed: {e}", flush=True)
        print(f"===== bench.{name}: {time.time() - t0:.0f} s =====", flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
