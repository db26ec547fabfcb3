"""What every benchmark shares: summaries of timings, a printed table, and JSON results in bench/results/.

Benchmarks are thin scripts (`python -m bench.<name>`); keeping the reporting here means every result
file has the same shape (name, environment, data) and every table reads the same way.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parent.parent


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict:
    """n, median, p99, mean, min and max of a list of measurements."""
    return {
        "n": len(values),
        "median": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(headers, rows))


def environment() -> dict:
    """Where a result was measured: enough to tell two result files apart."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=RESULTS_DIR.parent
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg_1m_at_write": round(os.getloadavg()[0], 2),  # other work on the machine skews timings
        "git_commit": commit or None,
    }


def write_result(name: str, data: dict, results_dir: Path | None = None) -> Path:
    """Write `<results_dir>/<name>.json` (atomically) with the environment; returns its path."""
    folder = results_dir or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"benchmark": name, "environment": environment(), **data}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics, one dict per logged step (`run_dir/metrics.jsonl`, as `app.metrics_sink` writes it)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def bench_run_sets(out: Path, workdir: Path, steps: int, port: int, trusted: list[str]) -> list[str]:
    """The overrides of a benchmark arm run as `bench` under `out`: its bucket there (every step's adapter kept for
    the evaluation), a model cache shared by the arms under `workdir`, no trackio or progress bar, the fleet on
    `port` trusting the adapter folders `trusted`."""
    return [
        f"train.max_steps={steps}",
        f"logging.output_dir={out}",
        "logging.run_name=bench",
        f"bucket.url=file://{out / 'bench' / 'bucket'}",
        f"bucket.cache_dir={workdir / 'cache'}",
        f"bucket.keep_versions={steps + 2}",
        "logging.report_to=[jsonl, ray]",
        "logging.progress_bar=false",
        f"fleet.extra_adapter_dirs={json.dumps(trusted)}",
        f"fleet.port={port}",
    ]


def train_run(config: str, sets: list[str], out: Path, label: str) -> dict:
    """`python -m launch.train --config CONFIG --set ...` as run `bench`, every file of it under `out` (its bucket, a fleet
    on a free port of its own, no trackio, no progress bar): its summary.json. Its metrics are in
    `out/bench/metrics.jsonl`."""
    from tests.support.fleet_helpers import free_port

    sets = [
        *sets,
        f"logging.output_dir={out}",
        "logging.run_name=bench",
        f"bucket.url=file://{out}/bucket",
        f"bucket.cache_dir={out}/cache",
        "logging.report_to=[jsonl, ray]",
        "logging.progress_bar=false",
        f"fleet.port={free_port()}",
    ]
    cmd = [sys.executable, "-m", "launch.train", "--config", config, *(a for s in sets for a in ("--set", s))]
    print(f"running {label}: {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "bench" / "summary.json").read_text())
