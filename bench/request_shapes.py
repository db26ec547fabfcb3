"""Request shapes: the same sequences asked for as groups or one sample per request, on the fleet and on vLLM alone.

spotrl's rollout asks for a group at once (one request with `n=G`); TRL, the Tinker cookbook, verifiers and a KL
penalty's `compute_logprobs` send one request per sample. Here the same 128 sequences (P prompts x G samples) are
asked for four ways, each with and without an adapter: `grouped` (P requests of `n=G`), `single` (P x G requests of
`n=1`, all at once), and for scoring (`prompt_logprobs`, `max_tokens` 1) of P x G distinct sequences `score_batched`
(P requests of G prompts each) and `score_single` (P x G requests of one). Each shape runs `--rounds` times; the
medians are compared as ratios within one run (single / grouped, score_single / score_batched), and each shape's
median on the fleet (`make serve`'s: 2 replicas of the tiny model) against the same load on vLLM's own OpenAI
server with the same engine settings (`deployments.replica.engine.engine_args`), one engine: the engine's limit.

Where a request's time goes, per hop, from metrics the fleet exports anyway (nothing changed for the bench): Serve's
HTTP proxy latency, the ingress's and the replica's processing latency (`ray_serve_deployment_processing_latency_ms`;
at the front door the ingress is no Serve request, so its latency is the client's wall time),
and vLLM's own end-to-end latency in the engine (`ray_vllm:e2e_request_latency_seconds`), each as a mean per request
over a shape's rounds; and the CPU seconds each process of the fleet spent on the shape (psutil), which on a small
machine is where the time goes. Writes bench/results/request_shapes.json.

One fleet is measured at its two doors in one run, so before and after share the machine's load: Serve's own HTTP
proxy (`fleet.proxy_port`, which still routes to the same ingress: the path every request took before the fleet had a
front door of its own) and the front door (`fleet.port`, `deployments.ingress.front_door`). Both coalesce like
single-sample requests (`deployments.control.coalesce`).

    python -m bench.request_shapes [--rounds 5] [--prompts 16] [--group 8] [--skip-vllm] [--skip-fleet] [--skip-before]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from bench.common import print_table, summarize, write_result

TOKEN = "bench-request-shapes-token-7f31"
ADAPTER = "policy-v1"
SHAPES = ("grouped", "single", "score_batched", "score_single")
# Overrides that make the bench's fleet `make serve`'s (configs/fleet-tiny-cpu.yaml).
FLEET_SETS = [
    "model.max_model_len=64",
    "fleet.max_loras=8",
    "fleet.max_lora_rank=8",
    "fleet.kv_cache_memory_bytes=134217728",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds per shape; medians are compared")
    p.add_argument("--prompts", type=int, default=16, help="P: prompts")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=6, help="tokens sampled per sequence")
    p.add_argument("--skip-vllm", action="store_true", help="measure the fleet alone")
    p.add_argument("--skip-fleet", action="store_true", help="measure vLLM's own server alone")
    p.add_argument("--skip-before", action="store_true", help="leave out the fleet at Serve's proxy (the before)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---- the load -------------------------------------------------------------------------------------------------------


def bodies(shape: str, model: str, args, round_no: int) -> list[dict]:
    """The request bodies of one shape: fresh prompts every round (no prefix cache from an earlier round)."""
    rng = random.Random(args.seed * 100_003 + round_no * 101 + SHAPES.index(shape))
    prompts = [[rng.randrange(3, 300) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sample = {"model": model, "max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": 0, "ignore_eos": True}
    if shape == "grouped":
        return [{**sample, "prompt": p, "n": args.group} for p in prompts]
    if shape == "single":
        return [{**sample, "prompt": p, "n": 1} for p in prompts for _ in range(args.group)]
    # Scoring: each sequence is a prompt and a completion of its own, scored whole.
    sequences = [
        [p + [rng.randrange(3, 300) for _ in range(args.max_tokens)] for _ in range(args.group)] for p in prompts
    ]
    score = {"model": model, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    if shape == "score_batched":
        return [{**score, "prompt": group} for group in sequences]
    return [{**score, "prompt": s} for group in sequences for s in group]


async def send_all(url: str, headers: dict[str, str], requests: list[dict]) -> float:
    """All requests at once (as a client's gather does); the wall time until the last answer.

    aiohttp rather than httpx: httpx's connection pool costs the client milliseconds per request at this concurrency,
    on the same two cores as the servers."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=len(requests))
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as session:

        async def one(body: dict) -> None:
            async with session.post("/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {(await r.text())[:500]}")
                choices = (await r.json())["choices"]
            prompts = len(body["prompt"]) if isinstance(body["prompt"][0], list) else 1
            if len(choices) != prompts * body.get("n", 1):
                raise RuntimeError(f"{len(choices)} choices for {prompts} x n={body.get('n', 1)}")

        async def connect() -> None:
            # A wrong method on the completions route: the app's own 405, no replica asked (the status routes, which
            # this used before, ask every replica, and put ~36 calls a round in the replicas' counts).
            async with session.get("/v1/completions") as r:
                await r.read()

        # Connections opened first, so that the timed part is the requests, as a long-running client sees them.
        await asyncio.gather(*(connect() for _ in range(min(len(requests), 32))))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(b) for b in requests))
        return time.perf_counter() - t0


# ---- where the time goes: metrics and CPU ---------------------------------------------------------------------------

HOPS = {  # hop: (metric, label filter, scale to seconds)
    "proxy": ("ray_serve_http_request_latency_ms", ('route="/v1/completions"',), 1e-3),
    "ingress": (
        "ray_serve_deployment_processing_latency_ms",
        ('deployment="Ingress"', 'route="/v1/completions"'),
        1e-3,
    ),
    # A replica's calls carry the route of the HTTP request they serve through Serve's proxy, none through the door.
    "replica": ("ray_serve_deployment_processing_latency_ms", ('deployment="VLLMReplica"',), 1e-3),
    "engine": ("ray_vllm_e2e_request_latency_seconds", (), 1.0),
}


def scrape(port: int) -> dict[str, tuple[float, float]]:
    """Per hop, the (sum, count) of its latency histogram, summed over the fleet's processes."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, trust_env=False).text
    out = {}
    for hop, (metric, label, scale) in HOPS.items():  # label: the label pairs a series must carry
        totals = []
        for suffix in ("_sum", "_count"):
            pattern = re.compile(rf"^{re.escape(metric + suffix)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", re.M)
            totals.append(sum(float(v) for labels, v in pattern.findall(text) if all(x in labels for x in label)))
        out[hop] = (totals[0] * scale, totals[1])
    return out


def role(cmdline: str, name: str) -> str | None:
    """Which part of a server a process is, by its title."""
    for marker, what in (
        ("ProxyActor", "http proxy"),
        ("Ingress", "ingress"),
        ("VLLMReplica", "replica (Serve actor)"),
        ("EngineCore", "engine core"),
        ("ServeController", "serve controller"),
        ("api_server", "vllm api server"),
        ("raylet", "ray (raylet, gcs, workers)"),
        ("gcs_server", "ray (raylet, gcs, workers)"),
        ("ray::", "ray (raylet, gcs, workers)"),
    ):
        if marker in cmdline or marker in name:
            return what
    return None


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) each part of the servers has used so far (this bench's own process left out)."""
    import psutil

    out: dict[str, float] = defaultdict(float)
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        try:
            if proc.info["pid"] == me or proc.info["cpu_times"] is None:
                continue
            what = role(" ".join(proc.info["cmdline"] or []), proc.info["name"] or "")
            if what is not None:
                out[what] += proc.info["cpu_times"].user + proc.info["cpu_times"].system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return dict(out)


def measure(url: str, headers: dict[str, str], models: dict[str, str], args, metrics_port: int | None) -> dict:
    """Every shape with and without the adapter, `--rounds` times; per arm its wall times, per-hop means, CPU."""
    arms = {f"{shape}:{label}": (shape, model) for label, model in models.items() for shape in SHAPES}
    for shape, model in arms.values():  # warm-up: the adapter loaded, the paths taken once
        asyncio.run(send_all(url, headers, bodies(shape, model, args, -1)))
    walls: dict[str, list[float]] = defaultdict(list)
    hops: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for round_no in range(args.rounds):
        for arm, (shape, model) in arms.items():
            requests = bodies(shape, model, args, round_no)
            before = scrape(metrics_port) if metrics_port else None
            cpu_before, client_before = cpu_seconds(), time.process_time()
            walls[arm].append(asyncio.run(send_all(url, headers, requests)))
            cpu[arm]["client (this bench)"] += time.process_time() - client_before
            for what, used in cpu_seconds().items():
                cpu[arm][what] += used - cpu_before.get(what, 0.0)
            if before is not None:
                time.sleep(2.5)  # Ray exports metrics every second; the replicas report to it with a lag
                after = scrape(metrics_port)
                for hop in HOPS:
                    count = after[hop][1] - before[hop][1]
                    if count:
                        hops[arm][hop].append((after[hop][0] - before[hop][0]) / count)
                        hops[arm][f"{hop}_calls"].append(count)
        print(f"round {round_no + 1}/{args.rounds}: " + ", ".join(f"{a} {walls[a][-1]:.2f}s" for a in arms), flush=True)
    return {
        arm: {
            "requests": len(bodies(shape, model, args, 0)),
            "wall_s": summarize(walls[arm]),
            "hop_mean_s": {hop: statistics.median(v) for hop, v in hops[arm].items()},
            "cpu_s_per_round": {what: round(s / args.rounds, 3) for what, s in sorted(cpu[arm].items())},
        }
        for arm, (shape, model) in arms.items()
    }


# ---- the two servers ----------------------------------------------------------------------------------------------


def vllm_server(cfg, model_path: str, adapter: Path, port: int, log: Path) -> subprocess.Popen:
    """vLLM's own OpenAI server, one engine with the fleet's engine settings, pinned to one core as a replica's is."""
    from deployments.replica.engine import engine_args

    kwargs = engine_args(cfg, model_path, True, cfg.fleet.router.block_size)
    flags = [
        "--model", kwargs["model"],
        "--dtype", kwargs["dtype"],
        "--max-model-len", str(kwargs["max_model_len"]),
        "--enable-lora",
        "--max-loras", str(kwargs["max_loras"]),
        "--max-cpu-loras", str(kwargs["max_cpu_loras"]),
        "--max-lora-rank", str(kwargs["max_lora_rank"]),
        "--enable-prefix-caching",
        "--block-size", str(kwargs["block_size"]),
        "--max-num-seqs", str(kwargs["max_num_seqs"]),
        "--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"]),
        "--logprobs-mode", kwargs["logprobs_mode"],
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"]),
        "--lora-modules", f"{ADAPTER}={adapter}",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
    }
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(
        [*cmd, *flags], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("vllm server not up in time")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_vllm(cfg, model_path: str, adapter: Path, work: Path, args) -> dict:
    from tests.support.fleet_helpers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = vllm_server(cfg, model_path, adapter, port, work / "vllm.log")
    try:
        wait_up(url, proc)
        print(f"vllm serve up at {url}, measuring ...", flush=True)
        return measure(url, {}, {"base": model_path, "adapter": ADAPTER}, args, None)
    finally:
        stop(proc)


def run_fleet(model_path: str, work: Path, args) -> dict[str, dict]:
    """The fleet's numbers at its front door, and (unless --skip-before) at Serve's proxy behind it."""
    from deployments.fleet import _proxy_address
    from tests.support.fleet_helpers import running_fleet

    work.mkdir()
    with running_fleet(work, model_path, FLEET_SETS, TOKEN) as fleet:
        doors = {"fleet": fleet.url}
        if not args.skip_before:
            doors = {"fleet_via_serve_proxy": "http://{}:{}".format(*_proxy_address(fleet.cfg)), **doors}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        models = {"base": fleet.base, "adapter": ADAPTER}
        try:
            out = {}
            for name, url in doors.items():
                print(f"fleet up, measuring at {url} ({name}) ...", flush=True)
                out[name] = measure(url, headers, models, args, fleet.metrics_port)
            return out
        finally:
            if os.environ.get("BENCH_DUMP_METRICS"):
                url = f"http://127.0.0.1:{fleet.metrics_port}/metrics"
                Path(os.environ["BENCH_DUMP_METRICS"]).write_text(httpx.get(url, trust_env=False).text)


# ---- report -------------------------------------------------------------------------------------------------------


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """single / grouped and score_single / score_batched on each server; fleet / vllm per shape."""
    out = {}
    for server, arms in results.items():
        for label in ("base", "adapter"):
            med = {shape: arms[f"{shape}:{label}"]["wall_s"]["median"] for shape in SHAPES}
            out[f"{server}:{label}:single/grouped"] = med["single"] / med["grouped"]
            out[f"{server}:{label}:score_single/score_batched"] = med["score_single"] / med["score_batched"]
    if {"fleet", "vllm"} <= set(results):
        for arm in results["fleet"]:
            out[f"fleet/vllm:{arm}"] = (
                results["fleet"][arm]["wall_s"]["median"] / results["vllm"][arm]["wall_s"]["median"]
            )
    return out


def report(results: dict[str, dict], found: dict[str, float]) -> None:
    rows = []
    for server, arms in results.items():
        for arm, r in arms.items():
            hop = r["hop_mean_s"]
            rows.append(
                [
                    f"{server} {arm}",
                    r["requests"],
                    f"{r['wall_s']['median']:.2f}",
                    f"{r['wall_s']['min']:.2f}-{r['wall_s']['max']:.2f}",
                    *(f"{hop[h] * 1000:.0f}" if h in hop else "-" for h in HOPS),
                    f"{hop['replica_calls']:.0f}" if "replica_calls" in hop else "-",
                    f"{sum(r['cpu_s_per_round'].values()):.1f}",
                ]
            )
    print_table(
        ["server shape:model", "requests", "median s", "range s", *(f"{h} ms" for h in HOPS), "replica calls", "cpu s"],
        rows,
        title="wall time per shape (median of rounds); per hop the mean latency of a request (an engine call) there, "
        "which includes the hops after it; replica calls: the replicas' calls per round; cpu: every process's",
    )
    print_table(["ratio", "value"], [[k, f"{v:.2f}"] for k, v in found.items()], title="ratios (medians)")
    cpu_rows = [
        [f"{server} {arm}", *(f"{r['cpu_s_per_round'].get(w, 0):.2f}" for w in sorted_roles(results))]
        for server, arms in results.items()
        for arm, r in arms.items()
    ]
    print_table(["server shape:model", *sorted_roles(results)], cpu_rows, title="CPU seconds per round, by process")


def sorted_roles(results: dict[str, dict]) -> list[str]:
    return sorted({w for arms in results.values() for r in arms.values() for w in r["cpu_s_per_round"]})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from core.config import load_config
    from tests.support.fleet_helpers import random_adapter
    from tiny.build import prepare_model

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-request-shapes-") as tmp:
        work = Path(tmp)
        cfg = load_config(None, [*FLEET_SETS, f"bucket.url=file://{work}/bucket", f"bucket.cache_dir={work}/cache"])
        model_path = prepare_model(cfg.model, cfg.task, log=lambda m: print(m, file=sys.stderr))
        if not args.skip_vllm:
            # The adapter the fleet serves as policy-v1 (`running_fleet` publishes this one, seed 1).
            adapter = random_adapter(model_path, work / "vllm-adapter", seed=1)
            results["vllm"] = run_vllm(cfg.own_fleet(), model_path, adapter, work, args)
        if not args.skip_fleet:
            results.update(run_fleet(model_path, work / "fleet", args))
    found = ratios(results)
    report(results, found)
    data = {
        "workload": {k: getattr(args, k) for k in ("rounds", "prompts", "group", "prompt_len", "max_tokens", "seed")},
        "fleet_settings": FLEET_SETS,
        "how_hops_were_measured": "Serve's and vLLM's own latency histograms (mean per request, median over rounds); "
        "CPU seconds per process from psutil; nothing in the fleet changed for the bench",
        "servers": results,
        "ratios": found,
    }
    path = write_result("request_shapes", data)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
