"""The ema teacher's average (`app.learner.ema`): TRL's update, on its schedule, from zero."""

import pytest
import torch

from app.learner.ema import AdapterEma


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"a.lora_A.weight": torch.full((2, 3), value), "a.lora_B.weight": torch.full((3, 2), 2 * value)}


def test_the_average_starts_at_zero_and_follows_trls_update_every_sync_steps():
    ema = AdapterEma(0.25, 2, tensors(0.0))
    assert all((t == 0).all() for t in ema.state().values())  # the base model, as TRL's teacher adapter starts
    shadow = 0.0
    for step, value in enumerate([4.0, 8.0, 1.0, 3.0, -2.0], start=1):
        updated = ema.step(step, tensors(value))
        assert updated == (step % 2 == 0)
        if updated:
            shadow = (1 - 0.25) * shadow + 0.25 * value  # TRL: (1 - update_rate) * shadow + update_rate * student
        assert ema.state()["a.lora_A.weight"] == pytest.approx(torch.full((2, 3), shadow))
        assert ema.state()["a.lora_B.weight"] == pytest.approx(torch.full((3, 2), 2 * shadow))
    assert shadow == pytest.approx(0.25 * 3.0 + 0.75 * 0.25 * 8.0)


def test_an_update_rate_of_one_copies_the_student_and_the_average_is_its_own_copy():
    ema = AdapterEma(1.0, 1, tensors(0.0))
    student = tensors(5.0)
    ema.step(1, student)
    student["a.lora_A.weight"].add_(1.0)  # the student trains on: the average keeps what it was given
    assert (ema.state()["a.lora_A.weight"] == 5.0).all()
    published = ema.state(torch.bfloat16)
    assert published["a.lora_A.weight"].dtype == torch.bfloat16
    published["a.lora_A.weight"].zero_()  # what is published is a copy too
    assert (ema.state()["a.lora_A.weight"] == 5.0).all()


def test_a_restored_average_continues_and_a_foreign_adapter_is_refused():
    ema = AdapterEma(0.5, 1, tensors(0.0))
    ema.restore(tensors(2.0))
    ema.step(1, tensors(4.0))
    assert (ema.state()["a.lora_A.weight"] == 3.0).all()
    with pytest.raises(ValueError, match="differ"):
        ema.step(2, {"other.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="differ"):
        ema.restore({"other.weight": torch.zeros(1)})
    for rate, steps in ((0.0, 1), (1.5, 1), (0.1, 0)):
        with pytest.raises(ValueError):
            AdapterEma(rate, steps, tensors(0.0))
