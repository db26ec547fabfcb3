"""The driver: `python -m app.train --config FILE [--set key=value ...] [--address ADDR]`.

Reads top to bottom like a recipe: start or join Ray, bring the fleet up unless one runs, start
the learner (which resumes or publishes policy-v0) and the rollout actor, evaluate the base, loop
to `max_steps` feeding the learner groups from the rollout queue, evaluate again and write the
summary. What it started, it stops, on success, on error and on Ctrl-C alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import time
from contextlib import ExitStack

from app.config import RunConfig, add_config_args, config_from_args

log = logging.getLogger("spotrl.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Asynchronous GRPO with LoRA on Ray.")
    add_config_args(parser)
    parser.add_argument("--address", default=None, help="Join this Ray cluster (default: start a local one).")
    return parser.parse_args(argv)


def staleness_of(groups, learner_version: int) -> list[int]:
    return [learner_version - g.policy_version for g in groups]


def window_mean(values: list[float], share: float, last: bool) -> float | None:
    if not values:
        return None
    k = max(1, round(len(values) * share))
    chunk = values[-k:] if last else values[:k]
    return statistics.fmean(chunk)


class Run:
    """State of one training run, so the loop and the summary read the same numbers."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.history: list[dict] = []
        self.staleness: list[int] = []
        self.samples_trained = 0
        self.t0 = time.time()
        self.loop_t0: float | None = None  # start of the training loop, after start-up and the first evaluation
        self.loop_s = 0.0
        self.idle_at_loop_start = 0.0

    def summary(self, before: dict | None, after: dict | None, rollout_stats: dict, router: dict | None) -> dict:
        rewards = [m["reward"] for m in self.history if "reward" in m]
        ratios = [m["ratio"] for m in self.history if "ratio" in m]
        return {
            "run_name": self.cfg.logging.run_name,
            "steps": len(self.history),
            "samples_trained": self.samples_trained,
            "policy_version": self.history[-1].get("policy_version") if self.history else None,
            "reward_first_10pct": window_mean(rewards, 0.1, last=False),
            "reward_last_10pct": window_mean(rewards, 0.1, last=True),
            "heldout_accuracy_before": before and before["accuracy"],
            "heldout_accuracy_after": after and after["accuracy"],
            "heldout_models": [before and before["model"], after and after["model"]],
            "affinity_share": router_affinity(router),
            "staleness_mean": statistics.fmean(self.staleness) if self.staleness else None,
            "staleness_max": max(self.staleness) if self.staleness else None,
            "dropped_stale_share": rollout_stats.get("sample/dropped_stale_share"),
            "dropped_failed_total": rollout_stats.get("rollout/dropped_failed_total"),
            "ratio_mean": statistics.fmean(ratios) if ratios else None,
            "step_s_median": statistics.median([m["perf/step_s"] for m in self.history]) if self.history else None,
            "loop_wall_s": round(self.loop_s, 1),
            "trainer_idle_share": sum(m["perf/rollout_wait_s"] for m in self.history) / self.loop_s
            if self.loop_s
            else None,
            "generation_idle_share": (
                (rollout_stats.get("rollout/idle_s", 0.0) - self.idle_at_loop_start) / self.loop_s
                if self.loop_s
                else None
            ),
            "wall_time_s": round(time.time() - self.t0, 1),
        }


def router_affinity(router: dict | None) -> float | None:
    """Share of routed requests that matched a specific prefix, from the fleet's /router/stats."""
    if not router:
        return None
    totals = router.get("totals", router)
    routed = totals.get("routed", 0)
    return totals.get("affinity", 0) / routed if routed else None


def check_port_free(host: str, port: int) -> None:
    """Refuse to start a fleet where another server already listens: the run would silently talk to it."""
    import socket

    with socket.socket() as sock:
        if sock.connect_ex((host, port)) == 0:
            raise SystemExit(f"fleet.port: {host}:{port} is already in use by another server; pick a free one")


def stop_actor(actor, timeout_s: float = 10.0) -> None:
    """Ask an actor to stop cleanly, then kill it whatever happened: cleanup must never mask why we stop."""
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a busy or dead actor is killed below all the same
        log.warning("%s did not stop cleanly (%s): killing it", actor, type(exc).__name__)
    ray.kill(actor, no_restart=True)


def ensure_served(fleet, cfg: RunConfig, version: int) -> None:
    """Make sure the fleet serves the learner's version before sampling from it.

    The learner asks the fleet to load each version it publishes but only counts a failed load
    (training goes on); at start-up there is no point going on without it, so load it here or fail.
    """
    from app.bucket.store import AdapterStore
    from app.messages import adapter_name

    name = adapter_name(version)
    if name not in {m["id"] for m in fleet.models()}:
        log.info("the fleet does not serve %s yet: loading it from the bucket", name)
        fleet.load_adapter(name, AdapterStore.from_config(cfg).url_of(version))


def train(cfg: RunConfig, address: str | None = None) -> dict:
    import ray

    from app.auth import admin_token, inference_token
    from app.diagnosis import diagnose
    from app.evaluate import evaluate
    from app.fleet_client import FleetClient
    from app.learner.group import LearnerGroup
    from app.local_ray import start_ray
    from app.messages import adapter_name
    from app.metrics_sink import MetricsSink
    from app.models import resolve_model_path
    from app.rollout.producer import RolloutActor
    from deployments.fleet import deploy_fleet, fleet_is_running, shutdown_fleet

    run = Run(cfg)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg.model, cfg.task, log=lambda m: log.info(m))
    token = admin_token(cfg)
    eval_token = inference_token(cfg)

    with ExitStack() as stack:
        ray_is_ours = start_ray(address)
        if ray_is_ours:
            stack.callback(ray.shutdown)
            # A Ray we just started serves nothing yet: whatever answers on the fleet's port is someone else's.
            check_port_free(cfg.fleet.host, cfg.fleet.port)
        if fleet_is_running(cfg):
            base_url = f"http://{cfg.fleet.host}:{cfg.fleet.port}"
            log.info("using the fleet already running at %s", base_url)
        else:
            log.info("starting the fleet (%d replicas)", cfg.fleet.num_replicas)
            base_url = deploy_fleet(cfg, model_path)
            stack.callback(shutdown_fleet, cfg, stop_serve=not ray_is_ours)
        fleet = FleetClient(base_url, token=token)

        learner = LearnerGroup(cfg, model_path, fleet_url=base_url, fleet_token=token)
        stack.callback(learner.shutdown)
        state = learner.start()
        version = state["policy_version"]
        log.info("learner at step %d, policy version %d", state["step"], version)
        ensure_served(fleet, cfg, version)

        before = evaluate(cfg, base_url, model_path, adapter_name(version), eval_token)
        log.info("held-out accuracy before: %.3f (%s)", before["accuracy"], before["model"])

        # Named, so that the dashboard and `ray.get_actor(name, namespace="spotrl")` find it.
        rollout = RolloutActor.options(name=f"rollout-{cfg.logging.run_name}", namespace="spotrl").remote(
            cfg, model_path, base_url, state
        )
        stack.callback(stop_actor, rollout)
        ray.get(rollout.start.remote())

        # Which groups each step trained: the audit trail of exactly-once across restarts (a resumed learner
        # repeats step numbers; the last line of a step is the one its checkpoints descend from).
        trained_log = stack.enter_context(open(run_dir / "trained_groups.jsonl", "a"))
        sink = MetricsSink(run_dir, cfg.logging.run_name, cfg.model_dump(mode="json"), cfg.logging.trackio)
        stack.callback(sink.close)
        bar = progress_bar(cfg, state["step"])
        stack.callback(bar.close)

        step = state["step"]
        run.loop_t0 = time.time()
        run.idle_at_loop_start = ray.get(rollout.stats.remote())["rollout/idle_s"]
        while step < cfg.grpo.max_steps:
            t_wait = time.perf_counter()
            groups = ray.get(rollout.get_groups.remote(cfg.grpo.num_prompts_per_step))
            rollout_wait_s = time.perf_counter() - t_wait
            stale = staleness_of(groups, version)
            rollout_stats = ray.get(rollout.stats.remote())
            metrics = learner.train_step(groups, data_cursor=rollout_stats["rollout/data_frontier"])
            step = metrics["step"]
            trained_log.write(json.dumps({"step": step, "groups": metrics.pop("learner/trained_group_ids")}) + "\n")
            trained_log.flush()
            if metrics["policy_version"] != version:
                version = metrics["policy_version"]
                ray.get(rollout.set_versions.remote(version))
            rewards = [r for g in groups for r in g.rewards]
            metrics.update(rollout_stats)
            metrics.update(
                {
                    "reward": statistics.fmean(rewards),
                    "reward_std": statistics.pstdev(rewards),
                    "sample/staleness_mean": statistics.fmean(stale),
                    "sample/staleness_max": max(stale),
                    "sample/version_min": min(g.policy_version for g in groups),
                    "sample/version_max": max(g.policy_version for g in groups),
                    "perf/rollout_wait_s": rollout_wait_s,
                    "samples": len(rewards),
                }
            )
            run.history.append(metrics)
            run.staleness.extend(stale)
            run.samples_trained += len(rewards)
            sink.log(metrics, step)
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward']:.2f}",
                step_s=f"{metrics['perf/step_s']:.2f}",
                stale=f"{metrics['sample/staleness_mean']:.1f}",
                queue=int(metrics["sample/rollout_queue_size"]),
            )
            if step % cfg.logging.diagnose_every == 0:
                bar.write(str(diagnose(run.history[-cfg.logging.diagnose_every :], cfg)))

        run.loop_s = time.time() - run.loop_t0
        final_stats = ray.get(rollout.stats.remote())
        verdict = diagnose(run.history[-max(2, cfg.logging.diagnose_every * 2) :], cfg)
        after = evaluate(cfg, base_url, model_path, adapter_name(version), eval_token)
        summary = run.summary(before, after, final_stats, fleet.router_stats())
        summary["bottleneck"] = verdict.kind
        summary["bottleneck_detail"] = str(verdict)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        bar.write(str(verdict))
    return summary


def progress_bar(cfg: RunConfig, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=cfg.grpo.max_steps,
        initial=initial,
        desc=cfg.logging.run_name,
        unit="step",
        disable=not cfg.logging.progress_bar,
        dynamic_ncols=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the run
    # SIGTERM ends a run like Ctrl-C does, so the cleanup in train() also runs when a scheduler stops us.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        summary = train(cfg, args.address)
    except KeyboardInterrupt:
        print("interrupted: stopped what this run started", file=sys.stderr)
        raise SystemExit(130) from None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
