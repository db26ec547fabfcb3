"""The driver: `python -m app.train --config FILE [--set key=value ...] [--address ADDR] [--fleet URL]`.

Reads top to bottom like a recipe: start or join Ray, bring the fleet up unless one runs (or, with
`--fleet`, join a shared fleet over HTTP as a run of it, `app.fleet_run`), start
the learner (which resumes or publishes policy-v0) and the rollout actor, evaluate the base, then
loop to `max_steps`: get groups, train, log; evaluate again and write the summary. The driver only
wires: the groups go from the rollout to the learner as an ObjectRef it never opens, and the
roles answer with typed messages (`app.messages`). What it started, it stops, on success, on
error and on Ctrl-C alike.
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
from app.messages import ResumePoint, RolloutStats, StepResult
from app.models import is_local, pin_revision, resolve_model_path
from contracts.adapters import adapter_name
from contracts.auth import Secret, admin_token, inference_token

log = logging.getLogger("spotrl.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Asynchronous GRPO with LoRA on Ray.")
    add_config_args(parser)
    parser.add_argument("--address", default=None, help="Join this Ray cluster (default: start a local one).")
    parser.add_argument(
        "--fleet",
        default=None,
        metavar="URL",
        help="Train on the fleet running at URL, as a run of it (join.url): HTTP alone, no fleet of our own.",
    )
    args = parser.parse_args(argv)
    if args.fleet:
        args.overrides.append(f"join.url={args.fleet}")
    return args


def window_mean(values: list[float], share: float, last: bool) -> float | None:
    if not values:
        return None
    k = max(1, round(len(values) * share))
    chunk = values[-k:] if last else values[:k]
    return statistics.fmean(chunk)


class Run:
    """The numbers of one training run, so the loop and the summary read the same ones."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.history: list[dict] = []
        self.staleness: list[int] = []
        self.samples_trained = 0
        self.t0 = time.time()
        self.loop_t0: float | None = None  # start of the training loop, after start-up and the first evaluation
        self.loop_s = 0.0
        self.idle_at_loop_start = 0.0

    def start_loop(self, rollout_stats: RolloutStats) -> None:
        self.loop_t0 = time.time()
        self.idle_at_loop_start = rollout_stats.idle_s

    def end_loop(self) -> None:
        self.loop_s = time.time() - self.loop_t0

    def record(self, result: StepResult, rollout_stats: RolloutStats, rollout_wait_s: float) -> dict:
        """The step's metrics as logged: the learner's, the rollout's, its groups', and how long we waited for them."""
        metrics = {
            **result.metrics,
            "policy_version": result.policy_version,
            **rollout_stats.metrics(),
            **(result.batch.metrics() if result.batch else {}),
            "perf/rollout_wait_s": rollout_wait_s,
        }
        self.history.append(metrics)
        if result.batch:
            self.staleness.extend(result.batch.staleness)
            self.samples_trained += result.batch.num_samples
        return metrics

    def summary(self, before: dict | None, after: dict | None, rollout: RolloutStats, router: dict | None) -> dict:
        rewards = [m["reward"] for m in self.history if "reward" in m]
        ratios = [m["ratio"] for m in self.history if "ratio" in m]
        return {
            "run_name": self.cfg.logging.run_name,
            "fleet_run": self.cfg.fleet_run,  # its name on the shared fleet it joined, else None
            "steps": len(self.history),
            "samples_trained": self.samples_trained,
            "policy_version": self.history[-1].get("policy_version") if self.history else None,
            "reward_first_10pct": window_mean(rewards, 0.1, last=False),
            "reward_last_10pct": window_mean(rewards, 0.1, last=True),
            "heldout_accuracy_before": before and before["accuracy"],
            "heldout_accuracy_after": after and after["accuracy"],
            "heldout_models": [before and before["model"], after and after["model"]],
            "affinity_share": router_affinity(router),
            **episode_summary(self.history, rollout, router),
            "staleness_mean": statistics.fmean(self.staleness) if self.staleness else None,
            "staleness_max": max(self.staleness) if self.staleness else None,
            "dropped_stale_share": rollout.dropped_stale_share,
            "dropped_failed_total": rollout.dropped_failed_total,
            "ratio_mean": statistics.fmean(ratios) if ratios else None,
            "step_s_median": statistics.median([m["perf/step_s"] for m in self.history]) if self.history else None,
            "loop_wall_s": round(self.loop_s, 1),
            "trainer_idle_share": sum(m["perf/rollout_wait_s"] for m in self.history) / self.loop_s
            if self.loop_s
            else None,
            "generation_idle_share": (rollout.idle_s - self.idle_at_loop_start) / self.loop_s if self.loop_s else None,
            "wall_time_s": round(time.time() - self.t0, 1),
        }


class StepLog:
    """Where each step goes: the audit trail of trained groups, the metrics sink, the progress bar, the verdicts."""

    def __init__(self, stack: ExitStack, run: Run, initial_step: int):
        from app.metrics_sink import MetricsSink

        cfg = run.cfg
        self.cfg, self.run = cfg, run
        # Which groups each step trained: the audit trail of exactly-once across restarts (a resumed learner
        # repeats step numbers; the last line of a step is the one its checkpoints descend from).
        self.trained = stack.enter_context(open(cfg.run_dir / "trained_groups.jsonl", "a"))
        self.sink = MetricsSink(cfg.run_dir, cfg.logging.run_name, cfg.model_dump(mode="json"), cfg.logging.trackio)
        stack.callback(self.sink.close)
        self.bar = progress_bar(cfg, initial_step)
        stack.callback(self.bar.close)

    def write(self, result: StepResult, metrics: dict) -> None:
        from app.diagnosis import diagnose

        self.trained.write(json.dumps({"step": result.step, "groups": result.trained_group_ids}) + "\n")
        self.trained.flush()
        self.sink.log(metrics, result.step)
        self.bar.update(1)
        self.bar.set_postfix(
            reward=f"{metrics['reward']:.2f}",
            step_s=f"{metrics['perf/step_s']:.2f}",
            stale=f"{metrics['sample/staleness_mean']:.1f}",
            queue=int(metrics["sample/rollout_queue_size"]),
        )
        every = self.cfg.logging.diagnose_every
        if result.step % every == 0:
            self.bar.write(str(diagnose(self.run.history[-every:], self.cfg)))


def router_affinity(router: dict | None) -> float | None:
    """Share of routed requests that matched a specific prefix, from the fleet's /router/stats."""
    if not router:
        return None
    totals = router.get("totals", router)
    routed = totals.get("routed", 0)
    return totals.get("affinity", 0) / routed if routed else None


def episode_summary(history: list[dict], rollout: RolloutStats, router: dict | None) -> dict:
    """Multi-turn runs: turns per episode, truncated share, environment errors, and the router's affinity by turn
    (from turn 2 on, the share of requests that stayed on the replica holding their trajectory); {} otherwise."""
    steps = [m for m in history if "env/turns_mean" in m]
    if not steps:
        return {}
    return {
        "env_turns_mean": statistics.fmean(m["env/turns_mean"] for m in steps),
        "env_truncated_share": statistics.fmean(m["env/truncated_share"] for m in steps),
        "env_errors_total": rollout.env_errors_total,
        "affinity_by_turn": {k: v["affinity_share"] for k, v in (router or {}).get("turns", {}).items()},
    }


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


def start_fleet(stack: ExitStack, cfg: RunConfig, model_path: str, address: str | None):
    """Start or join Ray, and use the fleet that runs there or deploy one; returns an admin client of it.

    The client speaks HTTP to Serve's proxy on the head, like the rollout actor and the evaluation,
    which run on the head too; the learner, on a node of its own, gets `learner_fleet_address`."""
    import ray

    from app import fleet_run
    from app.fleet_client import FleetClient
    from app.local_ray import start_ray
    from deployments.fleet import absolute_bucket_url, deploy_fleet, fleet_is_running, fleet_url, shutdown_fleet

    ray_is_ours = start_ray(address, offline=is_local(model_path))
    if ray_is_ours:
        stack.callback(ray.shutdown)
        # A Ray we just started serves nothing yet: whatever answers on the fleet's port is someone else's.
        check_port_free(cfg.fleet.host, cfg.fleet.port)
    own = cfg.own_fleet()
    if not fleet_is_running(own):
        log.info("starting the fleet (%d replicas)", cfg.fleet.num_replicas)
        base_url = deploy_fleet(own, model_path)
        stack.callback(shutdown_fleet, own, stop_serve=not ray_is_ours)
        return FleetClient(base_url, token=admin_token(cfg))
    base_url = fleet_url(own)  # where Serve's proxy listens, whatever this run's config says
    log.info("using the fleet already running at %s", base_url)
    client = FleetClient(base_url, token=admin_token(cfg))
    # A fleet another run started may serve another base model than ours, or its own lineage from another bucket.
    fleet_run.check_base_model(client, model_path, cfg.model.revision)
    fleet_run.check_same_bucket(client, absolute_bucket_url(cfg.bucket_url))
    return client


def join_fleet(stack: ExitStack, cfg: RunConfig, model_path: str, address: str | None):
    """Start or join a Ray of our own and become a run of the fleet at `join.url` (`app.fleet_run`);
    returns a client of the fleet with the run's token, and the token for the rollout and the learner."""
    import ray

    from app import fleet_run
    from app.fleet_client import FleetClient
    from app.local_ray import start_ray

    run = fleet_run.join(cfg, model_path)  # first: a fleet that refuses us is known before Ray starts
    stack.callback(fleet_run.leave, run)  # after the learner and rollout stopped: nothing uses the adapters any more
    stack.enter_context(fleet_run.Heartbeat(run))
    fleet_run.publish_to_fleet_bucket(cfg, run)
    if start_ray(address, offline=is_local(model_path)):
        stack.callback(ray.shutdown)
    client = FleetClient(run.url, token=run.token.value)
    stack.callback(client.close)
    return client, run.token


def learner_fleet_address(cfg: RunConfig) -> str:
    """The fleet as the learner reaches it: by Serve handle, from whichever node Ray puts it on."""
    from contracts.serving import serve_address

    address = serve_address(cfg.fleet.app_name)
    log.info("the learner tells the fleet of new versions through %s", address)
    return address


def start_rollout(
    stack: ExitStack, cfg: RunConfig, model_path: str, fleet_url: str, resume: ResumePoint, run_token: Secret | None
):
    """The rollout actor, producing from where the learner resumed (with the run's token on a shared fleet)."""
    import ray

    from app.rollout.actor import RolloutActor

    # Named, so that the dashboard and `ray.get_actor(name, namespace="spotrl")` find it.
    rollout = RolloutActor.options(name=f"rollout-{cfg.logging.run_name}", namespace="spotrl").remote(
        cfg, model_path, fleet_url, resume, run_token
    )
    stack.callback(stop_actor, rollout)
    ray.get(rollout.start.remote())
    return rollout


def take_groups(rollout, n: int):
    """Ask the rollout for a step's groups and wait until they exist; returns their ObjectRef and the wait.

    The driver never fetches them: the learner's ranks read them from the object store."""
    import ray

    t0 = time.perf_counter()
    batch = rollout.get_groups.remote(n)
    ray.wait([batch], fetch_local=False)
    return batch, time.perf_counter() - t0


def train(cfg: RunConfig, address: str | None = None) -> dict:
    """Train to `grpo.max_steps`; returns the run's summary (also in runs/<name>/summary.json)."""
    import ray

    from app.diagnosis import diagnose
    from app.evaluate import evaluate
    from app.learner.group import LearnerGroup
    from app.weight_sync import ensure_served, tell_rollout

    run = Run(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg.model, cfg.task, log=lambda m: log.info(m))
    pin_revision(cfg.model, model_path, log=log.info)
    with ExitStack() as stack:
        if cfg.join.url:  # a shared fleet: the learner, like everyone, tells it of versions over HTTP
            fleet, run_token = join_fleet(stack, cfg, model_path, address)
            learner_address = fleet.base_url
        else:
            fleet, run_token = start_fleet(stack, cfg, model_path, address), None
            learner_address = learner_fleet_address(cfg)
        token = run_token.value if run_token else None
        eval_token = token or inference_token(cfg)
        learner = LearnerGroup(cfg, model_path, fleet_url=learner_address, fleet_token=token)
        stack.callback(learner.shutdown)
        resume = learner.start()
        version = resume.policy_version
        log.info("learner at step %d, policy version %d", resume.step, version)
        ensure_served(fleet, cfg, version)

        before = evaluate(cfg, fleet.base_url, model_path, adapter_name(version, cfg.fleet_run), eval_token)
        log.info("held-out accuracy before: %.3f (%s)", before["accuracy"], before["model"])

        rollout = start_rollout(stack, cfg, model_path, fleet.base_url, resume, run_token)
        steps = StepLog(stack, run, resume.step)
        step = resume.step
        run.start_loop(ray.get(rollout.stats.remote()))
        while step < cfg.grpo.max_steps:
            batch, rollout_wait_s = take_groups(rollout, cfg.grpo.num_prompts_per_step)
            rollout_stats = ray.get(rollout.stats.remote())
            result = learner.train_step(batch)
            if result.policy_version != version:
                version = result.policy_version
                tell_rollout(rollout, version)
            step = result.step
            steps.write(result, run.record(result, rollout_stats, rollout_wait_s))
        run.end_loop()

        final_stats = ray.get(rollout.stats.remote())
        verdict = diagnose(run.history[-max(2, cfg.logging.diagnose_every * 2) :], cfg)
        after = evaluate(cfg, fleet.base_url, model_path, adapter_name(version, cfg.fleet_run), eval_token)
        log.info("held-out accuracy after: %.3f (%s)", after["accuracy"], after["model"])
        summary = run.summary(before, after, final_stats, fleet.router_stats())
        summary["bottleneck"] = verdict.kind
        summary["bottleneck_detail"] = str(verdict)
        (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        steps.bar.write(str(verdict))
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
