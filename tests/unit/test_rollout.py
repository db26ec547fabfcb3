"""Rollout worker logic with a fake fleet: staleness, backpressure, failures that never kill it."""

import asyncio

import pytest

from app.config import load_config
from app.fleet_client import Choice
from app.rollout.producer import RolloutWorker
from app.tasks.problems import make_arithmetic
from app.tasks.rewards import RewardScorer, exact_answer

PROBLEMS = make_arithmetic(2, 200, 10, seed=0).train


def make_worker(generate, funcs=(exact_answer,), **overrides):
    sets = [f"{k}={v}" for k, v in overrides.items()]
    cfg = load_config(None, sets)
    scorer = RewardScorer(list(funcs), timeout_s=2.0)
    return RolloutWorker(cfg, PROBLEMS, lambda p: [1, 2, 3], generate, scorer)


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


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_groups_carry_version_and_stale_ones_are_dropped():
    async def main():
        calls = []
        w = make_worker(
            echo_answer_generate(calls),
            **{"grpo.max_staleness": 1, "rollout.queue_maxsize": 4, "rollout.max_inflight_tasks": 2},
        )
        w.start()
        first = await w.get_groups(2)
        assert [g.policy_version for g in first] == [0, 0] and len(first[0].samples) == 8
        while w.queue.qsize() < 4:  # a full queue of v0 groups
            await asyncio.sleep(0.01)
        w.set_versions(2)  # learner two versions ahead: queued v0 groups are now too stale
        fresh = await w.get_groups(3)
        assert all(g.policy_version == 2 for g in fresh)
        assert w.counters["dropped_stale"] >= 1
        assert "policy-v2" in calls
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


def test_generation_failures_are_retried_then_dropped():
    async def main():
        w = make_worker(
            echo_answer_generate(fail_first=2), **{"rollout.max_retries": 3, "rollout.max_inflight_tasks": 1}
        )
        w.start()
        groups = await w.get_groups(1)
        assert len(groups) == 1 and w.counters["request_retries"] == 2 and w.counters["dropped_failed"] == 0
        await w.stop()

        always = make_worker(
            echo_answer_generate(fail_first=10**9), **{"rollout.max_retries": 1, "rollout.max_inflight_tasks": 2}
        )
        always.start()
        assert await always.get_groups(1, timeout_s=2.0) == []
        assert always.counters["dropped_failed"] >= 1 and always._producer is not None and not always._producer.done()
        await always.stop()

    run(main())


def test_raising_reward_scores_none_and_worker_goes_on():
    def broken(completions, prompts, completion_ids, **_):
        raise RuntimeError("reward bug")

    async def main():
        w = make_worker(echo_answer_generate(), funcs=(exact_answer, broken))
        w.start()
        groups = await w.get_groups(3)
        assert len(groups) == 3 and groups[0].reward_errors == {"broken": 8}
        assert w.stats()["reward/errors/broken"] >= 24
        await w.stop()

    run(main())


def test_consumed_groups_are_never_produced_again():
    async def main():
        cfg = load_config(None, ["rollout.max_inflight_tasks=1"])
        w = RolloutWorker(
            cfg,
            PROBLEMS,
            lambda p: [1],
            echo_answer_generate(),
            RewardScorer([exact_answer]),
            data_cursor=0,
            consumed_group_ids={"g0", "g1"},
        )
        w.start()
        groups = await w.get_groups(2)
        assert [g.group_id for g in groups] == ["g2", "g3"]
        await w.stop()

    run(main())


def test_data_order_is_a_function_of_the_cursor():
    w1 = make_worker(echo_answer_generate())
    w2 = make_worker(echo_answer_generate())
    assert [w1._problem_at(i).id for i in range(300)] == [w2._problem_at(i).id for i in range(300)]
    assert {w1._problem_at(i).id for i in range(200)} == {p.id for p in PROBLEMS}


def test_stats_names_follow_trl():
    w = make_worker(echo_answer_generate())
    s = w.stats()
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
        groups = await w.get_groups(4)
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
    from app.bucket.store import AdapterStore, CheckpointStore
    from app.rollout.producer import resume_state

    cfg = load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache"])
    assert resume_state(cfg) == {"data_cursor": 0, "policy_version": 0}  # nothing trained yet

    checkpoints = CheckpointStore.from_config(cfg)
    checkpoints.save(3, {"state.json": b"{}"}, meta={"policy_version": 3, "data_cursor": 40})
    checkpoints.save(6, {"state.json": b"{}"}, meta={"policy_version": 6, "data_cursor": 97})
    assert resume_state(cfg) == {"data_cursor": 97, "policy_version": 6}

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    AdapterStore.from_config(cfg).publish(adapter, 8)  # published after the checkpoint: sample with it
    assert resume_state(cfg) == {"data_cursor": 97, "policy_version": 8}
