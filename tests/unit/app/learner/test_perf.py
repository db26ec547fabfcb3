"""MFU's peak: spec-sheet dense bf16 FLOP/s looked up by the GPU's reported name, the config's overrides first."""

import math

import pytest

from app.learner.perf import mfu_percent, peak_flops


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # how an H100 SXM reports itself
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L4", 121e12),
    ],
)
def test_peak_by_device_name(name, expected):
    assert peak_flops(name, "cuda") == expected


def test_unknown_devices_have_no_peak_and_no_mfu():
    assert math.isnan(peak_flops("NVIDIA GeForce GTX 1080", "cuda"))
    assert math.isnan(peak_flops("cpu", "cpu"))
    assert math.isnan(mfu_percent(1e12, 1.0, 1, peak_flops("Some Accelerator", "cuda")))


def test_config_overrides_win_by_name_then_by_kind():
    assert peak_flops("NVIDIA H200", "cuda", {"nvidia h200": 790e12}) == 790e12  # e.g. a measured peak
    assert peak_flops("NVIDIA H200", "cuda", {"cuda": 500e12}) == 500e12
    assert peak_flops("NVIDIA H200", "cuda", {"NVIDIA L4": 1.0}) == 989e12  # another device's entry
    assert peak_flops("cpu", "cpu", {"cpu": 1e11}) == 1e11


def test_default_config_has_a_cpu_peak_and_leaves_gpus_to_the_table():
    from core.config import RunConfig

    overrides = RunConfig().learner.peak_flops
    assert peak_flops("cpu", "cpu", overrides) == 1e11
    assert peak_flops("NVIDIA H100 PCIe", "cuda", overrides) == 756e12
