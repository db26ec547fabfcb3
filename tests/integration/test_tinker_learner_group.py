"""The Tinker learner over two CPU ranks (FSDP2 over gloo, on a loopback Ray): the sharded base and the adapters
replicated outside FSDP compute and train as one learner on one device does, states saved by rank 0 load on every
rank, and a rank that dies brings the ranks back with the call answered as a lost learner (which the service rides
out by restoring the client from its last state)."""

import pytest
import ray

from app.learner.tinker_group import TinkerLearnerGroup
from app.learner.tinker_learner import TinkerLearner
from contracts.tinker import AdamStep, AdapterSpec, Datum, LearnerLost, Lineage, LossCall

SPEC = AdapterSpec(rank=4, seed=3)


def _datums(count: int) -> list[Datum]:
    """Datums of different lengths, so that two ranks get unequal shares (or one of them none)."""
    out = []
    for i in range(count):
        tokens = [(7 * i + 3 * j) % 50 + 2 for j in range(6 + 3 * i)]
        weights = [0.0] * 2 + [1.0] * (len(tokens) - 3)
        out.append(Datum(tokens[:-1], tokens[1:], {"weights": weights}))
    return out


def _step(model: str) -> AdamStep:
    return AdamStep(model, 1e-2, 0.9, 0.999, 1e-8, 0.0, 1.0)


@pytest.fixture(scope="module")
def group(tiny_model_path):
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False
    )
    actor = ray.remote(TinkerLearnerGroup).options(num_cpus=0).remote(tiny_model_path, 4, None, ranks=2)
    yield actor
    ray.shutdown()


def test_two_ranks_compute_and_train_as_one_learner_and_load_what_rank_0_saved(group, tiny_model_path, tmp_path):
    single = TinkerLearner(tiny_model_path, max_models=4)
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    ray.get(group.create.remote("m", SPEC))
    single.create("m", SPEC)
    for count in (1, 5):  # one datum: the second rank runs fillers only; five: both compute
        fb = LossCall("m", _datums(count), "cross_entropy")
        mine, theirs = single.forward_backward(fb), ray.get(group.forward_backward.remote(fb))
        assert theirs.metrics["loss:sum"] == pytest.approx(mine.metrics["loss:sum"], abs=1e-4)
        for a, b in zip(theirs.logprobs, mine.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-4)  # other rows, other float32 sums
        norm = ray.get(group.optim_step.remote(_step("m"))).grad_norm
        assert norm == pytest.approx(single.optim_step(_step("m")).grad_norm, rel=1e-4)
    after = LossCall("m", _datums(5), "cross_entropy", backward=False)
    expected = single.forward_backward(after).logprobs
    for a, b in zip(ray.get(group.forward_backward.remote(after)).logprobs, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-4)

    number = ray.get(group.save_state.remote("m", lineage))
    ray.get(group.load_state.remote("m2", lineage, number, True))
    loaded = ray.get(group.forward_backward.remote(LossCall("m2", _datums(5), "cross_entropy", backward=False)))
    for a, b in zip(loaded.logprobs, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert sorted(ray.get(group.models.remote())) == ["m", "m2"]
    assert ray.get(group.drop.remote("m2")) is True


def test_a_rank_that_dies_brings_the_ranks_back_and_the_call_is_a_lost_learner(group):
    ray.get(group.create.remote("d", SPEC))
    ray.kill(ray.get(group.rank_actors.remote())[1], no_restart=True)
    with pytest.raises(LearnerLost):
        ray.get(group.forward_backward.remote(LossCall("d", _datums(3), "cross_entropy")))
    assert ray.get(group.models.remote()) == []  # the ranks came back with the base model alone
    ray.get(group.create.remote("d", SPEC))
    reply = ray.get(group.forward_backward.remote(LossCall("d", _datums(3), "cross_entropy")))
    assert len(reply.logprobs) == 3
    with pytest.raises(ValueError, match="not supported"):  # a bad input is the user's, and the ranks stay up
        ray.get(group.forward_backward.remote(LossCall("d", _datums(1), "nonsense")))
    assert ray.get(group.models.remote()) == ["d"]
