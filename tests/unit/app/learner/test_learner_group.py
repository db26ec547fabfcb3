"""The learner group's step loop (`app.learner.group.LearnerGroup.train_step`) over stand-in attempts: a step abandoned
on a noticed node is trained again, and one that cannot be trained fails loudly instead of returning without its
batch. The Ray calls themselves (`_attempt`, `_outlive`) are the integration tests' (`test_spot`)."""

import pytest

from app.learner.group import MAX_RETRIES, LearnerGroup, StepNotTrained
from app.messages import StepResult


class ScriptedGroup(LearnerGroup):
    """A learner group whose attempts answer `results` in turn, without Ray."""

    def __init__(self, results: list[StepResult]):
        self.results, self.restarts, self.abandoned, self.waited = list(results), 0, 0, 0

    @staticmethod
    def _stored(batch):
        return batch

    def _attempt(self, batch_ref):
        return self.results.pop(0)

    def _outlive(self, deadline):
        self.waited += 1
        return None  # the node stayed after all


def abandoned() -> StepResult:
    return StepResult(step=4, policy_version=4, trained_group_ids=[], metrics={}, abandoned=True, node_deadline=1.0)


def trained() -> StepResult:
    return StepResult(step=5, policy_version=5, trained_group_ids=[50, 51], metrics={})


def test_an_abandoned_step_is_trained_again_and_counted():
    group = ScriptedGroup([abandoned(), trained()])
    result = group.train_step("batch")
    assert result.trained_group_ids == [50, 51] and result.metrics["learner/abandoned"] == 1.0 and group.waited == 1


def test_a_step_abandoned_on_every_try_fails_loudly_and_never_returns_without_its_batch():
    group = ScriptedGroup([abandoned()] * (MAX_RETRIES + 1))
    with pytest.raises(StepNotTrained, match="not trained"):
        group.train_step("batch")
    assert group.results == [] and group.abandoned == MAX_RETRIES
