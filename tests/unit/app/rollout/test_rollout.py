"""The rollout's group producer with a fake fleet: staleness, backpressure, failures that never kill it."""

import asyncio
import json
import threading
from http.server import ThreadingHTTPServer

import pytest

from app.messages import ResumePoint
from app.objectives.grpo import group_advantages
from app.rollout.producer import GroupProducer
from app.rollout.sampling import CompletionSampler, SamplingArgs
from app.tasks.rewards import RewardScorer, exact_answer
from contracts.rollouts import Choice
from core.config import load_config
from tests.support.fake_fleet import JSONHandler
from tests.support.rollout_parts import PROBLEMS, run


def make_worker(generate, funcs=(exact_answer,), retries_done=lambda: 0, **overrides):
    sets = [f"{k}={v}" for k, v in overrides.items()]
    cfg = load_config(None, sets)
    sampler = CompletionSampler(generate, RewardScorer(list(funcs), timeout_s=2.0))
    return GroupProducer(cfg, PROBLEMS, lambda p: [1, 2, 3], sampler, retries_done=retries_done)


def echo_answer_generate(calls=None, delay=0.0, fail_first=0):
    state = {"n": 0}

    async def generate(prompt_ids, model, n, max_tokens, temperature, top_p=1.0, top_k=-1):
        state["n"] += 1
        if calls is not None:
            calls.append(model)
        if state["n"] <= fail_first:
            raise ConnectionError("replica went away")
        await asyncio.sleep(delay)
        return [Choice(i, [5, 6], [-0.1, -0.2], str(i), "stop") for i in range(n)]

    return generate


def test_groups_carry_version_and_stale_ones_are_dropped():
    async def main():
        calls = []
        w = make_worker(
            echo_answer_generate(calls),
            **{
                "rollout.max_staleness": 1,
                "rollout.queue_maxsize": 4,
                "rollout.max_inflight_tasks": 2,
                "rollout.staleness_rule": "drop_at_take",
            },
        )
        w.start()
        first = (await w.get_groups(2)).groups
        assert [g.policy_version for g in first] == [0, 0] and len(first[0].samples) == 8
        for group in first:  # annotated by the run's objectives before they were queued: ready to train
            for sample, advantage in zip(group.samples, group_advantages(group.rewards), strict=True):
                assert sample.streams == {"advantages": [advantage] * 2, "versions": [0.0, 0.0]}
        while w.queue.qsize() < 4:  # a full queue of v0 groups
            await asyncio.sleep(0.01)
        w.set_policy_version(2)  # learner two versions ahead: queued v0 groups are now too stale
        batch = await w.get_groups(3)
        assert all(g.policy_version == 2 for g in batch.groups)
        assert batch.learner_version == 2 and batch.stats().staleness == [0, 0, 0]
        assert w.counters["dropped_stale"] >= 1
        assert "policy-v2" in calls
        await w.stop()

    run(main())


def test_a_run_of_a_shared_fleet_samples_its_own_namespaced_versions():
    async def main():
        calls = []
        w = make_worker(
            echo_answer_generate(calls), **{"join.url": "http://127.0.0.1:8000", "logging.run_name": "alice"}
        )
        w.start()
        await w.get_groups(1)
        w.set_policy_version(1)
        while "alice/policy-v1" not in calls:
            await w.get_groups(1)
        assert set(calls) == {"alice/policy-v0", "alice/policy-v1"}
        await w.stop()

    run(main())


def test_backpressure_bounds_what_is_buffered():
    async def main():
        w = make_worker(echo_answer_generate(), **{"rollout.queue_maxsize": 3, "rollout.max_inflight_tasks": 2})
        w.start()
        await asyncio.sleep(0.5)  # nobody consumes
        started = w.cursor
        await asyncio.sleep(0.5)
        assert w.queue.qsize() == 3
        assert w.cursor == started  # no new requests while the queue is full
        assert w.cursor <= 3 + 2 + 1
        await w.stop()

    run(main())


class _FlakyFleet(JSONHandler):
    """Answers /v1/completions with 503 (no live replica) `failures` times, then with n completions."""

    failures = 0

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).failures > 0:
            type(self).failures -= 1
            status, payload = 503, {"error": {"message": "no live replica"}}
        else:
            choice = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop"}
            status, payload = 200, {"choices": [{**choice, "index": i, "text": str(i)} for i in range(body["n"])]}
        self.answer(status, payload)


@pytest.fixture
def flaky_fleet():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FlakyFleet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_generation_failures_are_retried_then_dropped(flaky_fleet):
    from app.rollout.actor import sampling_client

    async def main(max_retries: int, failures: int, n: int, timeout_s: float | None):
        sets = {"rollout.max_retries": max_retries, "rollout.max_inflight_tasks": 1}
        client = sampling_client(load_config(None, [f"{k}={v}" for k, v in sets.items()]), flaky_fleet)
        _FlakyFleet.failures = failures
        w = make_worker(client.acompletions, retries_done=lambda: client.retries_done, **sets)
        w.start()
        groups = (await w.get_groups(n, timeout_s=timeout_s)).groups
        alive = w._producer is not None and not w._producer.done()
        await w.stop()
        await client.aclose()
        return groups, w.counters["dropped_failed"], w.stats().request_retries_total, alive

    # The fleet client retries (rollout.max_retries) and the rollout reports its retries.
    groups, dropped, retries, _ = run(main(max_retries=3, failures=2, n=1, timeout_s=None))
    assert len(groups) == 1 and retries == 2 and dropped == 0
    # Beyond the retries the group is lost, counted, and the producer goes on.
    groups, dropped, retries, alive = run(main(max_retries=1, failures=10**9, n=1, timeout_s=2.0))
    assert groups == [] and dropped >= 1 and retries >= 1 and alive


def test_raising_reward_scores_none_and_worker_goes_on():
    def broken(completions, prompts, completion_ids, **_):
        raise RuntimeError("reward bug")

    async def main():
        w = make_worker(echo_answer_generate(), funcs=(exact_answer, broken))
        w.start()
        groups = (await w.get_groups(3)).groups
        assert len(groups) == 3 and groups[0].reward_errors == {"broken": 8}
        assert w.stats().metrics()["reward/errors/broken"] >= 24
        await w.stop()

    run(main())


def test_consumed_groups_are_never_produced_again():
    async def main():
        cfg = load_config(None, ["rollout.max_inflight_tasks=1"])
        w = GroupProducer(
            cfg,
            PROBLEMS,
            lambda p: [1],
            CompletionSampler(echo_answer_generate(), RewardScorer([exact_answer])),
            resume=ResumePoint(data_cursor=0, consumed_group_ids=(0, 1)),
        )
        w.start()
        batch = await w.get_groups(2)
        assert [g.group_id for g in batch.groups] == [2, 3]
        assert batch.data_cursor == 4  # both taken: a resumed run goes on after them
        await w.stop()

    run(main())


def test_data_order_is_a_function_of_the_cursor():
    w1 = make_worker(echo_answer_generate())
    w2 = make_worker(echo_answer_generate())
    assert [w1._problem_at(i).id for i in range(300)] == [w2._problem_at(i).id for i in range(300)]
    assert {w1._problem_at(i).id for i in range(200)} == {p.id for p in PROBLEMS}


def test_stats_names_follow_trl():
    w = make_worker(echo_answer_generate())
    s = w.stats().metrics()
    for key in (
        "sample/rollout_queue_size",
        "rollout/inflight",
        "rollout/generated_tok_s",
        "sample/dropped_stale_total",
    ):
        assert key in s


def test_sync_mode_generates_only_when_asked():
    async def main():
        calls = []
        w = make_worker(echo_answer_generate(calls, fail_first=1), **{"rollout.mode": "sync", "rollout.max_retries": 0})
        w.start()
        await asyncio.sleep(0.3)
        assert calls == [] and w.queue.qsize() == 0
        groups = (await w.get_groups(4)).groups
        assert len(groups) == 4 and w.counters["dropped_failed"] == 1  # the failed one was generated again
        await asyncio.sleep(0.3)
        assert len(calls) == 5 and w.queue.qsize() == 0
        await w.stop()

    run(main())


def test_a_dead_producer_is_an_error_not_a_hang():
    async def main():
        w = make_worker(echo_answer_generate())
        w.cursor = None  # a bug that kills the producer
        w.start()
        with pytest.raises(RuntimeError, match="producer died"):
            await w.get_groups(1, timeout_s=10)

    run(main())


def test_a_restarted_rollout_resumes_from_the_newest_checkpoint_and_version(tmp_path):
    from app.rollout.actor import resume_state
    from core.bucket.store import AdapterStore, CheckpointStore

    cfg = load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache"])
    assert resume_state(cfg) == ResumePoint(step=0, data_cursor=0, policy_version=0)  # nothing trained yet

    checkpoints = CheckpointStore.from_config(cfg)
    checkpoints.save(3, {"state.json": b"{}"}, meta={"policy_version": 3, "data_cursor": 40})
    checkpoints.save(6, {"state.json": b"{}"}, meta={"policy_version": 6, "data_cursor": 97})
    assert resume_state(cfg) == ResumePoint(step=6, data_cursor=97, policy_version=6)

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    AdapterStore.from_config(cfg).publish(adapter, 8)  # published after the checkpoint: sample with it
    assert resume_state(cfg) == ResumePoint(step=6, data_cursor=97, policy_version=8)


def counted_right(completions, answer, environments=None, **kwargs):
    """A reward as TRL users write them: keyword parameters in their own order, `environments` defaulted."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def by_position(prompts, completions, completion_ids, **kw):
    """TRL's parameter names in TRL's order: prompts first (spotrl passed completions first, so this scored wrong)."""
    assert all(isinstance(p, str) and p.startswith("Compute") for p in prompts)
    return [
        float(c.strip() == a) * len(ids) for c, a, ids in zip(completions, kw["answer"], completion_ids, strict=True)
    ]


def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):
    """TRL's hooks: the trainer's state at the group's step, a metric and an extra column logged."""
    log_metric("shaped_calls", 1.0)
    log_extra("seen", list(completions))
    return [float(trainer_state.global_step) / trainer_state.max_steps] * len(completions)


def sample_four(scorer, model="policy-v3"):
    """Four samples of a problem through the rollout's sampler, every other one right, with three tokens each."""
    problem = PROBLEMS[0]

    async def generate(prompt_ids, model, n, max_tokens, temperature, top_p=1.0, top_k=-1):
        texts = [problem.answer if i % 2 == 0 else "0" for i in range(n)]
        return [Choice(i, [5, 6, 7], [-0.1] * 3, t, "stop") for i, t in enumerate(texts)]

    async def main():
        sampler = CompletionSampler(generate, scorer)
        try:
            sampled = await sampler.sample(problem, [1, 2], model, 4, SamplingArgs(8))
        finally:
            sampler.close()
        return sampled, sampler.reward_metrics()

    return run(main())


def test_reward_functions_are_called_by_keyword_as_trl_calls_them():
    """Rewards written for TRL, keyword-style or positional with TRL's names, score the rollout's samples right: the
    scorer used to pass completions, prompts and completion ids by position."""
    sampled, metrics = sample_four(RewardScorer([counted_right, by_position], timeout_s=5.0))
    assert [s.reward for s in sampled.samples] == [4.0, 0.0, 4.0, 0.0]
    assert sampled.reward_errors == {} and not any(v for k, v in metrics.items() if k.startswith("reward/errors"))


def test_reward_functions_get_trls_state_and_logging_hooks():
    """`trainer_state` (the group's step of `train.max_steps`), and `log_metric` / `log_extra` as TRL passes them;
    what `log_metric` logs is in the rollout's metrics."""
    sampled, metrics = sample_four(RewardScorer([shaped], timeout_s=5.0, max_steps=10))
    assert [s.reward for s in sampled.samples] == [0.3] * 4
    assert metrics["reward/errors_total"] == 0 and metrics["reward/logged/shaped_calls"] == 1.0


class AlwaysLost(CompletionSampler):
    """A sampler whose every group fails, as a TRL environment whose `reset` raises on every problem makes them."""

    async def sample(self, problem, prompt_ids, model, n, sampling, flight=None):
        raise RuntimeError("every environment of the group failed to start (reset_raised)")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_when_every_recent_group_failed_taking_groups_stops_naming_the_cause(mode):
    """Groups that always fail used to leave the driver waiting for ever: nothing ever reached the queue."""
    from app.rollout.producer import GroupsKeepFailing

    async def main():
        cfg = load_config(None, [f"rollout.mode={mode}", "rollout.max_failed_groups=5", "rollout.max_inflight_tasks=2"])
        w = GroupProducer(
            cfg, PROBLEMS, lambda p: [1], AlwaysLost(echo_answer_generate(), RewardScorer([exact_answer]))
        )
        w.start()
        try:
            with pytest.raises(GroupsKeepFailing) as failing:
                await w.get_groups(2)
            assert str(failing.value) == (
                "the last 5 groups all failed (rollout.max_failed_groups), the last one with RuntimeError: every "
                "environment of the group failed to start (reset_raised)"
            )
            assert w.stats().failing == str(failing.value) and w.counters["dropped_failed"] >= 5
        finally:
            await w.stop()

    run(main())


def test_a_group_that_comes_through_resets_the_count_of_failures_in_a_row():
    async def main():
        w = make_worker(
            echo_answer_generate(fail_first=2), **{"rollout.max_failed_groups": 3, "rollout.max_retries": 0}
        )
        w.start()
        groups = (await w.get_groups(4)).groups
        assert len(groups) == 4 and w.counters["dropped_failed"] == 2 and w.stats().failing is None
        await w.stop()

    run(main())
