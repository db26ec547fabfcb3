"""A run's two lineages by name (`contracts.adapters`): its policy's `policy-vN` and its ema teacher's `ema-vN`."""

import pytest

from contracts.adapters import AdapterRef, family_of, in_lineage


def test_an_ema_version_is_a_bucket_version_of_a_lineage_of_its_own():
    ref = AdapterRef.parse("alice/ema-v3")
    assert ref == AdapterRef(3, "alice", "ema") and (ref.name, ref.key, ref.family) == (
        "alice/ema-v3",
        "ema-v3",
        "alice/ema",
    )
    assert AdapterRef.parse("alice/policy-v3") == AdapterRef(3, "alice")  # the policy's, the default stem
    assert family_of("alice/ema-v3") != family_of("alice/policy-v3")  # pinned apart
    for name in ("alice/ema-v03", "alice/teacher-v1", "alice/emav3", "Alice/ema-v3"):
        assert AdapterRef.parse(name) is None


def test_the_ema_teacher_of_a_version_is_the_same_number_of_the_runs_ema_lineage():
    assert in_lineage("alice/policy-v7", "ema") == "alice/ema-v7"
    assert in_lineage("policy-v0", "ema") == "ema-v0"  # a fleet of the run's own: no run prefix
    with pytest.raises(ValueError):
        in_lineage("my-lora", "ema")
