"""The learner's side of an `ema` self teacher (`LearnerRank` with `app.learner.ema`): every version is published with
the average of the adapter under its number (`ema-vN`, the run's second lineage), the average follows TRL's update
over the very adapters published, and a resumed learner continues it from its checkpoint.

A small random Qwen2 in-process and a file:// bucket: the real training, publish and commit path, without Ray."""

import pytest
import torch
from safetensors.torch import load_file

from app.learner.ema import EMA_FILE
from app.learner.rank import LearnerRank
from contracts.rollouts import RolloutBatch
from core.bucket.store import AdapterStore, CheckpointStore, EmaAdapterStore
from core.config.teacher import SelfTeacher
from tests.support.learner_parts import learner_config, random_groups, random_model

RATE = 0.5


@pytest.fixture
def make_rank(tmp_path):
    model = random_model(tmp_path / "model")
    torch.set_num_threads(1)

    def make() -> LearnerRank:
        cfg = learner_config(save_steps=2)
        cfg.bucket.url, cfg.bucket.cache_dir = f"file://{tmp_path}/bucket", str(tmp_path / "cache")
        cfg.bucket.keep_versions = 10
        rank = LearnerRank(cfg, model)
        # the run's ema teacher (a distill objective's, which these random groups carry no teacher scores for)
        rank.ema_spec = SelfTeacher(model="ema", context="{answer} {prompt}", update_rate=RATE, sync_steps=1)
        rank.setup()
        rank.start()
        return rank

    return make


def _weights(store, version: int) -> dict[str, torch.Tensor]:
    return load_file(store.fetch(version) / "adapter_model.safetensors")


def test_each_version_is_published_with_the_average_of_the_adapters_under_its_number_and_a_resume_continues_it(
    make_rank, tmp_path
):
    rank = make_rank()
    for step in (1, 2, 3):
        rank.train_step(RolloutBatch(random_groups(2, seed=step, first_id=10 * step), data_cursor=step))
    url = f"file://{tmp_path}/bucket"
    policy, ema = AdapterStore(url, cache_dir=tmp_path / "c2"), EmaAdapterStore(url, cache_dir=tmp_path / "c2")
    assert policy.versions() == ema.versions() == [3, 2, 1, 0]
    assert all((t == 0).all() for t in _weights(ema, 0).values())  # zero: the base model, as TRL's starts
    expected = {k: torch.zeros_like(v) for k, v in _weights(policy, 0).items()}
    for version in (1, 2, 3):
        expected = {k: (1 - RATE) * v + RATE * _weights(policy, version)[k] for k, v in expected.items()}
        got = _weights(ema, version)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7)
    saved = load_file(CheckpointStore(url, cache_dir=tmp_path / "c3").load(2) / EMA_FILE)
    assert saved.keys() == rank.ema.average.shadow.keys()
    rank.close()

    again = make_rank()  # resumed from step 2 (save_steps 2): its average as it was then, not zero
    assert again.state.step == 2 and again.state.policy_version == 4  # republished above v3, with the average
    for key, value in saved.items():
        torch.testing.assert_close(again.ema.average.shadow[key], value)
    assert ema.versions()[0] == 4
    again.close()
