"""app.models: local or hub model, the pinned revision; app.local_ray's offline flags follow it."""

import pytest

from app.config import ModelConfig
from app.local_ray import run_env_vars
from app.models import is_local, pin_revision

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Stands in for huggingface_hub.HfApi: no hub is reachable from tests."""

    calls: list = []

    def model_info(self, repo_id, revision=None):
        FakeHub.calls.append((repo_id, revision))
        return type("Info", (), {"sha": SHA})()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    FakeHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    return FakeHub


def test_a_hub_model_is_pinned_to_a_commit_once(hub):
    cfg = ModelConfig(name_or_path="Qwen/Qwen2.5-Math-1.5B")
    pin_revision(cfg, cfg.name_or_path, log=lambda m: None)
    assert cfg.revision == SHA and hub.calls == [("Qwen/Qwen2.5-Math-1.5B", "main")]
    pin_revision(cfg, cfg.name_or_path, log=lambda m: None)  # already a commit: no second lookup
    assert len(hub.calls) == 1


def test_a_branch_is_resolved_and_a_local_folder_is_left_alone(hub, tmp_path):
    cfg = ModelConfig(name_or_path="org/model", revision="v1.0")
    pin_revision(cfg, "org/model", log=lambda m: None)
    assert cfg.revision == SHA and hub.calls == [("org/model", "v1.0")]
    local = ModelConfig(name_or_path=str(tmp_path))
    pin_revision(local, str(tmp_path), log=lambda m: None)
    assert local.revision is None and len(hub.calls) == 1
    assert is_local(str(tmp_path)) and not is_local("org/model")


def test_offline_flags_only_for_a_local_model():
    assert run_env_vars(offline=True)["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in run_env_vars(offline=False)
