"""The driver: `python -m launch.train --config FILE [--set key=value ...] [--address ADDR] [--fleet URL]`.

Reads top to bottom like a recipe: start or join Ray, bring the fleet up unless one runs (or, with
`--fleet`, join a shared fleet over HTTP as a run of it, `app.fleet_run`), start
the learner (which resumes or publishes policy-v0), a distilling run's teacher (`app.teacher_setup`) and the
rollout actor, evaluate the base (and the teacher), then
loop to `max_steps`: get groups, train, log; evaluate again and write the summary. The driver only
wires: the groups go from the rollout to the learner as an ObjectRef it never opens, and the
roles answer with typed messages (`app.messages`). What it started, it stops, on success, on
error and on Ctrl-C alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from contextlib import ExitStack

from app.evaluate import EvaluationLost
from app.kinds.registry import serve_environment
from app.messages import ResumePoint
from app.periodic_eval import EvalPoint, Measured, PeriodicEvaluation
from app.rollout.judge_probe import probe_judges
from app.run_evaluation import Evaluation, lost_note
from app.run_log import Run, StepLog, previous_steps
from app.spot import DriverNotices, Preempted, finished_line, preempted_line
from app.tasks.checks import check_episode_budget, check_names
from contracts.adapters import adapter_name
from contracts.auth import Secret, admin_token, inference_token
from core.config import ConfigError, RunConfig, add_config_args, config_errors_exit, config_from_args
from core.models import is_local, pin_revision
from tiny.build import prepare_run

log = logging.getLogger("spotrl.train")
# How long the end of a run waits for an evaluation during training still in flight, before its final one.
EVAL_IN_FLIGHT_WAIT_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    """The driver's options (`spotrl train --help` lists the config's fields after them)."""
    parser = argparse.ArgumentParser(description="Asynchronous GRPO with LoRA on Ray.")
    add_config_args(parser)
    parser.add_argument("--address", default=None, help="Join this Ray cluster (default: start a local one).")
    parser.add_argument(
        "--fleet",
        default=None,
        metavar="URL",
        help="Train on the fleet running at URL, as a run of it (join.url): HTTP alone, no fleet of our own.",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.fleet:
        args.overrides.append(f"join.url={args.fleet}")
    return args


def check_port_free(host: str, port: int, field: str = "fleet.port") -> None:
    """Refuse to start a fleet where another server already listens: the run would silently talk to it."""
    import socket

    with socket.socket() as sock:
        if sock.connect_ex((host, port)) == 0:
            raise SystemExit(f"{field}: {host}:{port} is already in use by another server; pick a free one")


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
    from core.bucket.filesystem import absolute_bucket_url
    from core.local_ray import start_ray
    from deployments.fleet import deploy_fleet, fleet_is_running, fleet_url, shutdown_fleet

    ray_is_ours = start_ray(address, offline=is_local(model_path))
    if ray_is_ours:
        stack.callback(ray.shutdown)
        # A Ray we just started serves nothing yet: whatever answers on the fleet's port is someone else's.
        check_port_free(cfg.fleet.host, cfg.fleet.port)
        if cfg.fleet.proxy_port is not None:
            check_port_free(cfg.fleet.host, cfg.fleet.proxy_port, "fleet.proxy_port")
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
    returns a client of the fleet with the run's token, and the token for the rollout and the learner; None when
    the run (in its prefix of the fleet's bucket) had finished already: it leaves the fleet again at once."""
    import ray

    from app import fleet_run
    from app.fleet_client import FleetClient
    from core.local_ray import start_ray

    run = fleet_run.join(cfg, model_path)  # first: a fleet that refuses us is known before Ray starts
    stack.callback(fleet_run.leave, run)  # after the learner and rollout stopped: nothing uses the adapters any more
    stack.enter_context(fleet_run.Heartbeat(run))
    fleet_run.publish_to_fleet_bucket(cfg, run)
    if report_finished(cfg):
        return None
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


def start_teacher(
    cfg: RunConfig, run: Run, fleet, model_path: str, evaluation: Evaluation, token: str | None, version: int
):
    """A distilling run's teacher, checked (`app.teacher_setup`) and its held-out accuracy measured as the student's
    is (a self teacher's under its privileged prompt); or its several teachers by name, each so measured; None when
    the run does not distil. `version` is the run's newest version now, a `live` self teacher's first."""
    if cfg.distill is None:
        return None
    from app.teacher_setup import prepare_teachers

    teachers = prepare_teachers(cfg, fleet, model_path, token, adapter_name(version, cfg.fleet_run))
    measured = {name: evaluation.of_teacher(teacher) for name, teacher in teachers.items()}
    for name, heldout in measured.items():
        log.info("teacher %s held-out accuracy: %.3f (%s)", name, heldout["accuracy"], heldout["model"])
    if cfg.distill.teachers is None:
        run.teacher_heldout = measured["teacher"]
        return teachers["teacher"]
    run.teachers_heldout = measured
    return teachers


def start_rollout(
    stack: ExitStack,
    cfg: RunConfig,
    model_path: str,
    fleet_url: str,
    resume: ResumePoint,
    run_token: Secret | None,
    teacher=None,
):
    """The rollout actor, producing from where the learner resumed (with the run's token on a shared fleet, and
    the teacher that scores its groups when the run distils)."""
    import ray

    from app.rollout.actor import RolloutActor

    # Named, so that the dashboard and `ray.get_actor(name, namespace="spotrl")` find it.
    rollout = RolloutActor.options(name=f"rollout-{cfg.logging.run_name}", namespace="spotrl").remote(
        cfg, model_path, fleet_url, resume, run_token, teacher
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


def train(cfg: RunConfig, address: str | None = None, notices: DriverNotices | None = None) -> dict | None:
    """Train to `train.max_steps`; returns the run's summary (also in runs/<name>/summary.json), or None when the run
    had finished already (reported in one line, nothing touched). Raises `Preempted` after checkpointing when the
    driver's machine gets a spot notice."""
    from app.learner.group import LearnerGroup
    from app.weight_sync import ensure_served

    run = Run(cfg)
    model_path = prepare_run(cfg, log=log.info)  # a tiny teacher too, named by its folder for its deployment
    pin_revision(cfg.model, model_path, log=log.info)
    check_episode_budget(cfg, model_path)  # needs the model's tokenizer; before Ray and the fleet all the same
    if not cfg.join.url and report_finished(cfg):
        return None
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        # What the environment's kind serves (an OpenEnv app): up before any episode, down after everything stopped.
        cfg = serve_environment(stack, cfg)
        if cfg.join.url:  # a shared fleet: the learner, like everyone, tells it of versions over HTTP
            joined = join_fleet(stack, cfg, model_path, address)
            if joined is None:
                return None
            fleet, run_token = joined
            learner_address = fleet.base_url
        else:
            fleet, run_token = start_fleet(stack, cfg, model_path, address), None
            learner_address = learner_fleet_address(cfg)
        if notices is not None:
            notices.take_sigterm()  # Ray has started: its handler replaced ours
        token = run_token.value if run_token else None
        # The fleet loads only versions signed with the key it gives this run's lineage (the run's token's, or the
        # fleet's own lineage's for its admin): the learner signs each one.
        signing_key = fleet.signing_key()
        learner = LearnerGroup(cfg, model_path, fleet_url=learner_address, fleet_token=token, signing_key=signing_key)
        stack.callback(learner.shutdown)
        resume = learner.start()
        ensure_served(fleet, cfg, resume.policy_version)
        # Each judge asked once, as the rollout will: one the fleet refuses the run (403) ends it here, in one line.
        probe_judges(cfg, fleet.base_url, token or admin_token(cfg), model_path)
        extra_sets = {s.name: serve_environment(stack, s.applied_to(cfg)) for s in cfg.eval.extra}
        evaluation = Evaluation(cfg, fleet.base_url, model_path, token or inference_token(cfg), extra_sets)
        before = evaluation.baseline(resume)
        teacher = start_teacher(
            cfg, run, fleet, model_path, evaluation, token or admin_token(cfg), resume.policy_version
        )
        rollout = start_rollout(stack, cfg, model_path, fleet.base_url, resume, run_token, teacher)
        run.restore(previous_steps(cfg.run_dir, resume.step))  # a resumed run's summary is the whole run's
        steps = StepLog(stack, run, resume.step)
        periodic = start_periodic_eval(stack, cfg, run, evaluation)
        version = loop(cfg, run, steps, learner, rollout, resume, notices, periodic)
        return finish(cfg, run, steps, rollout, fleet, evaluation, before, version, periodic)


def report_finished(cfg: RunConfig) -> bool:
    """Print one line and say True when this run reached `train.max_steps` already (`app.spot.finished_line`)."""
    line = finished_line(cfg)
    if line:
        print(line, file=sys.stderr)
    return line is not None


def start_periodic_eval(stack: ExitStack, cfg: RunConfig, run: Run, evaluation: Evaluation) -> PeriodicEvaluation:
    """Evaluation during training (`eval.every_steps`; with 0 it never evaluates), stopped with the run (a spot
    notice included) without waiting for an evaluation in flight."""
    e = cfg.eval
    best = max((p.measured.accuracy for p in run.eval_points), default=None)  # an earlier process's best
    keep = evaluation.keep if e.keep_best else None
    periodic = PeriodicEvaluation(evaluation.during, e.every_steps, e.max_retries, cfg.train.max_steps, keep, best)
    stack.callback(periodic.stop)
    return periodic


def loop(
    cfg,
    run: Run,
    steps: StepLog,
    learner,
    rollout,
    resume: ResumePoint,
    notices: DriverNotices | None,
    periodic: PeriodicEvaluation,
) -> int:
    """Get groups, train, log, to `train.max_steps`; returns the policy version trained last. A spot notice for this
    machine stops it after the step under way, checkpointed (`Preempted`). The last step is always checkpointed, so
    that a run trained further later resumes exactly where this one ended. Each step hands its version to the
    evaluation during training and logs what it measured meanwhile; it never waits for it."""
    import ray

    from app.weight_sync import tell_rollout

    step, version = resume.step, resume.policy_version
    checkpointed = step
    run.start_loop(ray.get(rollout.stats.remote()))
    while step < cfg.train.max_steps:
        if notices is not None and notices.binding is not None:
            if checkpointed != step:
                learner.checkpoint()
            raise Preempted(preempted_line(cfg, notices.binding, step, version))
        batch, rollout_wait_s = take_groups(rollout, cfg.train.num_prompts_per_step)
        rollout_stats = ray.get(rollout.stats.remote())
        if rollout_stats.failing:  # the take raised: no group is coming (the learner would only find the error)
            raise SystemExit(f"rollout: {rollout_stats.failing}")
        result = learner.train_step(batch)
        if result.policy_version != version:
            version = result.policy_version
            tell_rollout(rollout, version)
        step = result.step
        periodic.committed(step, version)
        if step % cfg.learner.save_steps == 0:
            checkpointed = step
        evaluated = periodic.landed()
        metrics = run.record(result, rollout_stats, rollout_wait_s, evaluated, periodic.counts() if evaluated else {})
        steps.write(result, metrics)
    if checkpointed != step:
        learner.checkpoint()
    run.end_loop()
    return version


def finish(
    cfg,
    run: Run,
    steps: StepLog,
    rollout,
    fleet,
    evaluation: Evaluation,
    before: dict,
    version: int,
    periodic: PeriodicEvaluation,
) -> dict:
    """Evaluate the trained policy, write the summary, say which side was the bottleneck."""
    import ray

    from app.diagnosis import diagnose

    final_stats = ray.get(rollout.stats.remote())
    verdict = diagnose(run.history[-max(2, cfg.logging.diagnose_every * 2) :], cfg)
    late = periodic.stop(wait_s=EVAL_IN_FLIGHT_WAIT_S)  # an evaluation in flight would compete with the final one
    after = evaluation.of(version)
    log.info("held-out accuracy after: %.3f (%s)%s", after["accuracy"], after["model"], lost_note(after))
    summary = run.summary(before, after, final_stats, fleet.router_stats())
    if cfg.eval.every_steps:
        try:
            measured = evaluation.during(version, after)  # the extra sets too
        except Exception as e:  # noqa: BLE001 - an extra set failing costs its point, never the summary
            log.warning("evaluation of the extra sets after the run failed: %s", e)
            measured = Measured(after["accuracy"], after.get("lost", 0))
        curve = [*run.eval_points, *late, EvalPoint(cfg.train.max_steps, version, measured)]
        summary.update(evaluation.summary(curve, periodic.counts()))
        log.info("best evaluated version: %s (accuracy %.3f)", summary["best_version"], summary["best_accuracy"])
    summary["bottleneck"] = verdict.kind
    summary["bottleneck_detail"] = str(verdict)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    steps.bar.write(str(verdict))
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run(config_from_args(args), args.address)


def run(cfg: RunConfig, address: str | None = None) -> None:
    """Train a loaded config as `spotrl train` does, with its exit codes: 2 and one line for a config error (its
    names checked first, before Ray and the fleet), 1 when evaluation is lost, 0 when preempted after a checkpoint,
    130 on Ctrl-C; the summary printed as one JSON line. Recipes that build their own config (`examples/`) call it."""
    with config_errors_exit():
        check_names(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the run
    # A spot notice for this machine (a SIGTERM too: a scheduler stopping us) ends the run after a checkpoint;
    # a second SIGTERM, like Ctrl-C, stops it at once. Either way train() stops what it started.
    notices = DriverNotices(cfg.spot, joined=address is not None).start()
    try:
        summary = train(cfg, address, notices)
    except ConfigError as e:  # found once the model was built (its context, its tokenizer): as any config error
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except EvaluationLost as e:  # an environment that fails on every problem: one line, not a traceback
        print(f"evaluation: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Preempted as e:
        print(e, file=sys.stderr)
        raise SystemExit(0) from None
    except KeyboardInterrupt:
        print("interrupted: stopped what this run started", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        notices.stop()
    if summary is not None:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
