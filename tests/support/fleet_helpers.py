"""A fleet on this one machine, for the integration tests and the router and shared-fleet benchmarks.

They need the same things: Ray on loopback only (nothing else may be reached or exposed), a free
port for the HTTP ingress, and adapters to serve. Real adapters come from the learner; here a PEFT
LoRA on the base model with random `lora_B` (PEFT initialises it to zero, which would change
nothing) stands in, so that each version visibly changes the model's outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.support import REPO


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray(num_cpus: int = 2, metrics_export_port: int | None = None) -> None:
    """Start a fresh single-node Ray bound to 127.0.0.1 (metrics exported every second when a port is given).

    Listens on loopback only, as `make train`'s Ray does (`core.local_ray`: one-machine mode, worker preload)."""
    import ray

    from core.local_ray import LOOPBACK, loopback_system_config, single_machine_mode

    system_config = loopback_system_config()
    kwargs = {}
    if metrics_export_port is not None:
        kwargs = {"_metrics_export_port": metrics_export_port}
        system_config["metrics_report_interval_ms"] = 1000
    with single_machine_mode():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            configure_logging=False,
            log_to_driver=False,
            _system_config=system_config,
            **kwargs,
        )


@contextlib.contextmanager
def running_fleet(
    work: Path, model_path: str, overrides: list[str], token: str, block_size: int = 32, judge: dict | None = None
):
    """A 2-replica fleet of the tiny model on a fresh loopback Ray, with the admin token `token`; yields what the
    tests use (config, URL, an admin client, the bucket, the base model's name, the metrics port).

    `overrides` go on top of a small test config (max_model_len 128, max_staleness 2, a bucket under `work`); `judge`
    is a judge deployment the fleet serves too (`FleetConfig.judge`: a fleet's config names it, a run's cannot).
    Policy version 1 is committed before start-up, so every replica loads it itself."""
    import ray

    from app.fleet_client import FleetClient
    from contracts.auth import lineage_key, signing_secret
    from core.bucket.store import AdapterStore
    from core.config import FleetConfig, load_config
    from deployments.fleet import deploy_fleet, shutdown_fleet

    cfg = load_config(
        None,
        [
            "model.max_model_len=128",
            f"fleet.port={free_port()}",
            f"fleet.router.block_size={block_size}",
            "rollout.max_staleness=2",
            f"bucket.url=file://{work}/bucket",
            f"bucket.cache_dir={work}/cache",
            "logging.run_name=fleet-test",
            *overrides,
        ],
    )
    own = cfg.own_fleet()
    if judge is not None:
        own = FleetConfig.model_validate({**own.model_dump(), "judge": judge})
    store = AdapterStore.from_config(cfg, lineage_key(signing_secret(token), None))  # as the fleet's own learner
    publish_random_adapters(store, model_path, [1], work)
    metrics_port = free_port()
    start_local_ray(num_cpus=2, metrics_export_port=metrics_port)
    saved = os.environ.get("SPOTRL_ADMIN_TOKEN")
    os.environ["SPOTRL_ADMIN_TOKEN"] = token  # as a user would export it before deploying
    try:
        url = deploy_fleet(own, model_path, timeout_s=600)
    except BaseException:
        ray.shutdown()
        raise
    finally:
        if saved is None:
            del os.environ["SPOTRL_ADMIN_TOKEN"]
        else:
            os.environ["SPOTRL_ADMIN_TOKEN"] = saved
    client = FleetClient(url, token=token)
    try:
        yield SimpleNamespace(
            cfg=cfg,
            url=url,
            client=client,
            store=store,
            work=work,
            model_path=model_path,
            base=client.models()[0]["id"],
            metrics_port=metrics_port,
        )
    finally:
        client.close()
        shutdown_fleet(cfg)
        ray.shutdown()


def run_store(fleet, run: str | None):
    """The store run `run`'s learner publishes to on `fleet` (a `running_fleet`): its prefix of the fleet's bucket,
    signed with the key the fleet gives its lineage (None: the fleet's own lineage)."""
    from contracts.adapters import run_prefix
    from core.bucket.store import AdapterStore

    key = fleet.client.signing_key(run)
    return AdapterStore(run_prefix(fleet.store.url, run), cache_dir=fleet.work / "cache", signing_key=key)


def random_adapter(model_path: str, folder: str | Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """Save a PEFT LoRA (all linear layers) with random `lora_A` and `lora_B`, so the adapter changes the outputs.

    Both come from `seed` alone (PEFT would draw `lora_A` from the global RNG): a seed is one adapter, always."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:  # PEFT's kaiming-uniform scale, ~1/sqrt(fan_in)
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(folder))
    return Path(folder)


def publish_random_adapters(store, model_path: str, versions: list[int], work_dir: str | Path, rank: int = 8) -> None:
    """Publish `policy-v{N}` for each version (a distinct random adapter each) to the bucket."""
    for version in versions:
        folder = random_adapter(model_path, Path(work_dir) / f"adapter-v{version}", seed=version, rank=rank)
        store.publish(folder, version)


# ---- Runs of a shared fleet (tests/integration/test_shared_training.py, bench/shared_fleet.py) -----------


def start_fleet_run(
    work: Path, url: str, name: str, steps: int, env: dict[str, str], extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`python -m launch.train --fleet URL` as run `name` of a shared fleet (tiny-cpu config), output under `work/name`,
    log in `work/name.log`; `env` holds its token (SPOTRL_ADMIN_TOKEN to register itself, or SPOTRL_RUN_TOKEN)."""
    sets = [
        f"logging.run_name={name}",
        f"train.max_steps={steps}",
        f"logging.output_dir={work}",
        f"bucket.cache_dir={work}/cache-{name}",
        "logging.progress_bar=false",
        "logging.diagnose_every=10",
        *extra,
    ]
    cmd = [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", "--fleet", url]
    cmd += [a for s in sets for a in ("--set", s)]
    log = open(work / f"{name}.log", "w")  # noqa: SIM115 - the process writes to it until it ends
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TRACKIO_DIR": str(work / f"trackio-{name}"), **env},
    )


def finish_fleet_run(proc: subprocess.Popen, work: Path, name: str, timeout_s: float) -> dict:
    """Wait for run `name` to end; its summary, or RuntimeError with the end of its log when it failed."""
    rc = proc.wait(timeout=timeout_s)
    output = (work / f"{name}.log").read_text()
    if rc != 0 or "Traceback" in output or " ERROR " in output:
        raise RuntimeError(f"run {name} ended with {rc}:\n{output[-5000:]}")
    return json.loads((work / name / "summary.json").read_text())


# ---- What a process tree listens on (tests/integration/test_loopback.py) ---------------------------------


def process_tree(*root_pids: int, marker: tuple[str, str] | None = None) -> list:
    """The processes `root_pids` (none given and no marker: this process) and all their descendants, plus
    every process whose environment holds `marker` (NAME, VALUE) and all of theirs: what `ray start`
    spawns outlives it (re-parented to init) but inherits its environment: GCS, raylet, dashboard,
    agents, then the workers the raylet starts and the vLLM engines under them."""
    import psutil

    roots = [psutil.Process(pid) for pid in root_pids] or ([] if marker else [psutil.Process()])
    if marker is not None:
        name, value = marker
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(name) == value:
                    roots.append(proc)
            except psutil.Error:  # gone, a zombie, or not ours to read
                continue
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for proc in [root, *root.children(recursive=True)]:
                found.setdefault(proc.pid, proc)
        except psutil.Error:
            continue
    return list(found.values())


def assert_nothing_left_behind(processes: list, timeout_s: float = 30.0) -> None:
    """Every one of `processes` (a run's tree, taken while it ran) has ended, or is a zombie its parent will reap:
    a run that stops, however it was stopped, leaves no Ray worker or vLLM engine running."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    left = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline()[:3] for p in left]


def listening_sockets(processes) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, command line) of every listening TCP socket (IPv4 and IPv6) of `processes`."""
    import psutil

    found = []
    for proc in processes:
        try:
            # Ray workers and vLLM engines retitle themselves (`ray::ServeReplica:...`, `VLLM::EngineCore`).
            name = " ".join(proc.cmdline()) or proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((conn.laddr.ip, conn.laddr.port, proc.pid, name))
        except psutil.Error:  # ended meanwhile
            continue
    return sorted(set(found))


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (`::ffff:127.0.0.1`, an IPv6 socket bound to 127.0.0.1)."""
    import ipaddress

    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def random_prompt(seed: int, length: int = 96) -> list[int]:
    """A prompt of random token ids (of the tiny model's vocabulary), the same for a seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]
