"""Learner checkpoints hold no pickle: optimizer, scheduler and RNG states round-trip through safetensors + JSON."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from app.learner.state import (
    TENSORS_FILE,
    TRAINING_FILE,
    _rng_state,
    _set_rng_state,
    join_tensors,
    read_training_state,
    split_tensors,
)


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def _write(folder, state):
    tensors = {}
    rest = split_tensors(state, tensors)
    save_file(tensors, folder / TENSORS_FILE)
    (folder / TRAINING_FILE).write_text(json.dumps(rest))


def test_optimizer_scheduler_and_rng_round_trip_without_pickle(tmp_path, monkeypatch):
    model, optimizer, scheduler = _trained()
    _write(tmp_path, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": [_rng_state()]})
    expected = [random.random(), float(np.random.rand()), torch.rand(1).item()]

    def no_pickle(*args, **kwargs):
        raise AssertionError("torch.load must not be used for checkpoints")

    monkeypatch.setattr(torch, "load", no_pickle)
    saved = read_training_state(tmp_path)
    _, fresh_optimizer, fresh_scheduler = _trained()
    fresh_optimizer.load_state_dict(saved["optimizer"])
    fresh_scheduler.load_state_dict(saved["scheduler"])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(
            fresh_optimizer.state_dict()["state"][0][key], optimizer.state_dict()["state"][0][key]
        )
    assert fresh_optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    _set_rng_state(saved["rng"][0])
    assert [random.random(), float(np.random.rand()), torch.rand(1).item()] == expected


def test_split_and_join_keep_types():
    state = {"a": (1, [2.5, None], "x"), 3: {"t": torch.arange(4)}, "n": np.arange(3, dtype=np.uint32)}
    tensors = {}
    back = join_tensors(json.loads(json.dumps(split_tensors(state, tensors))), tensors)
    assert back["a"] == (1, [2.5, None], "x") and 3 in back
    assert torch.equal(back[3]["t"], torch.arange(4)) and back["n"].dtype == np.uint32
    with pytest.raises(TypeError, match="without pickle"):
        split_tensors({"f": object()}, {})


def test_an_old_pickled_checkpoint_is_refused_with_a_clear_message(tmp_path):
    (tmp_path / "optimizer.pt").write_bytes(b"pickle")
    with pytest.raises(RuntimeError, match="old pickled layout"):
        read_training_state(tmp_path)
