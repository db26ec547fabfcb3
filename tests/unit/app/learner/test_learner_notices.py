"""The learner on a noticed node (`app.learner.notices`, `LearnerRank`): whether a step still fits the deadline,
a checkpoint at once and after every step, an abandoned step that a resumed learner trains exactly once.

A small random Qwen2 in-process and a file:// bucket: the real training and commit path, without Ray."""

import logging
import time

import pytest
import torch

from app.learner.notices import OUTLIVED_S, LearnerNotices, StepAbandoned
from app.learner.rank import LearnerRank
from contracts.notices import Notice
from contracts.rollouts import RolloutBatch
from core.bucket.store import CheckpointStore
from core.config import SpotConfig
from tests.support.learner_parts import learner_config, random_groups, random_model


def test_a_step_fits_when_it_and_a_checkpoint_end_before_the_deadline_with_the_margin():
    notices = LearnerNotices(SpotConfig(deadline_margin_s=5.0))
    assert notices.step_fits() and not notices.noticed  # no notice: always
    notices.step_s, notices.checkpoint_s = 10.0, 4.0
    notices.heard(Notice("gcp", 1000.0 + 30.0), now=1000.0)
    assert notices.step_fits(now=1000.0)  # 10 + 4 + 5 <= 30
    assert not notices.step_fits(now=1012.0)  # 18 s left
    assert notices.step_fits(elapsed_s=8.0, now=1012.0)  # 2 s of the step left: 2 + 4 + 5 <= 18
    assert notices.step_fits(now=1030.0 + OUTLIVED_S + 1)  # the node outlived its notice: train on
    assert LearnerNotices(SpotConfig()).step_fits()


def test_notice_to_checkpoint_is_measured_once_and_a_notice_shorter_than_a_checkpoint_is_said(caplog):
    notices = LearnerNotices(SpotConfig())
    notices.checkpointed(3.0, now=10.0)
    assert notices.take_metrics() == {"perf/checkpoint_s": 3.0} and notices.take_metrics() == {}
    with caplog.at_level(logging.WARNING, logger="app.learner.notices"):
        notices.heard(Notice("gcp", 102.0), now=100.0)  # 2 s left, a checkpoint takes 3
    assert "a checkpoint takes 3.0 s" in caplog.text and "trained again" in caplog.text
    notices.checkpointed(2.5, now=104.5)
    notices.checkpointed(2.0, now=110.0)
    metrics = notices.take_metrics()
    assert metrics == {"perf/checkpoint_s": 2.0, "spot/notice_to_checkpoint_s": 4.5, "spot/noticed": 1.0}


@pytest.fixture
def rank_factory(tmp_path):
    model = random_model(tmp_path / "model")
    torch.set_num_threads(1)

    def make() -> LearnerRank:
        cfg = learner_config(save_steps=100, token_budget=40)  # several micro-batches per step
        cfg.bucket.url, cfg.bucket.cache_dir = f"file://{tmp_path}/bucket", str(tmp_path / "cache")
        cfg.bucket.keep_checkpoints = 10
        rank = LearnerRank(cfg, model)
        rank.setup()
        rank.start()
        return rank

    return make


def _batch(step: int) -> RolloutBatch:
    return RolloutBatch(random_groups(2, seed=step, first_id=10 * step), data_cursor=step)


def test_a_noticed_learner_commits_every_step_and_an_abandoned_step_is_trained_once_after_resuming(
    rank_factory, tmp_path
):
    rank = rank_factory()
    store = rank.checkpoints
    assert rank.train_step(_batch(1)).step == 1 and store.latest() is None  # save_steps 100: nothing committed

    rank.notices.heard(Notice("aws", time.time() + 120.0))
    second = rank.train_step(_batch(2))  # commits step 1 at once, then step 2 at its end
    assert second.step == 2 and sorted(store.steps()) == [1, 2]
    assert second.metrics["spot/notice_to_checkpoint_s"] >= 0 and second.metrics["spot/noticed"] == 1.0

    rank.notices.heard(Notice("gcp", time.time() + 1.0))  # 1 s left: no step fits
    abandoned = rank.train_step(_batch(3))
    assert abandoned.abandoned and abandoned.trained_group_ids == [] and abandoned.step == 2
    assert abandoned.node_deadline == pytest.approx(time.time() + 1.0, abs=1.0)
    assert sorted(store.steps()) == [1, 2] and all(p.grad is None for p in rank.model.parameters())

    replacement = rank_factory()  # the node's replacement resumes from the bucket ...
    assert replacement.state.step == 2
    retried = replacement.train_step(_batch(3))  # ... and trains the abandoned batch, once
    assert retried.step == 3 and sorted(retried.trained_group_ids) == [30, 31]
    assert CheckpointStore.from_config(replacement.cfg).latest() == 2  # an un-noticed learner keeps its schedule


def test_a_pass_told_to_stop_raises_before_its_next_micro_batch(rank_factory):
    rank = rank_factory()
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(StepAbandoned):
        rank.forward_backward(random_groups(6, seed=5), stop=stop)
    assert len(asked) == 2


def test_a_step_abandoned_half_way_commits_the_cursor_of_the_last_step_trained_not_its_own(rank_factory):
    """A notice heard during a step that then no longer fits: the checkpoint it commits holds the data cursor of the
    step before, so that a learner (and rollout) resumed from it are fed this step's groups again."""
    rank = rank_factory()
    assert rank.train_step(_batch(1)).step == 1  # cursor 1, not committed yet (save_steps 100)
    asked = []

    def fits(elapsed_s: float = 0.0, now=None) -> bool:  # the notice comes after the step began
        asked.append(elapsed_s)
        if len(asked) == 2:
            rank.notices.heard(Notice("gcp", time.time() + 1.0))
        return len(asked) < 2

    rank.notices.step_fits = fits
    abandoned = rank.train_step(_batch(2))
    assert abandoned.abandoned and abandoned.trained_group_ids == [] and len(asked) >= 2
    committed = rank.checkpoints.manifest(1)["meta"]
    assert committed["data_cursor"] == 1 and rank.state.data_cursor == 1
