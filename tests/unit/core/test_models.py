"""core.models: local or hub model, the pinned revision; core.local_ray's offline flags follow it."""

import json

import pytest

from core.config import ModelConfig
from core.local_ray import run_env_vars
from core.models import is_local, pin_revision

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


def _model_folder(path, weights=b"\x01" * (3 * 2**20), **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 64, "transformers_version": "4.0", **config}))
    (path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_model_folder_is_known_by_its_contents_wherever_it_lies_and_a_hub_name_by_its_revision(tmp_path):
    from core.models import model_fingerprint

    weights = bytes(range(256)) * (3 * 2**12)  # 3 MiB: more than the first and last MiB it reads
    one = model_fingerprint(str(_model_folder(tmp_path / "one", weights)))
    assert one.startswith("files:")
    # The same model elsewhere, saved by another transformers: the same fingerprint.
    assert model_fingerprint(str(_model_folder(tmp_path / "two", weights, transformers_version="5.0"))) == one
    changed_weights = weights[:-1] + b"\x00"  # a fine-tune: same shapes, other values
    assert model_fingerprint(str(_model_folder(tmp_path / "tuned", changed_weights))) != one
    assert model_fingerprint(str(_model_folder(tmp_path / "wider", weights, hidden_size=128))) != one
    other_tokens = _model_folder(tmp_path / "tokens", weights)
    (other_tokens / "tokenizer.json").write_text('{"vocab": {"b": 0}}')
    assert model_fingerprint(str(other_tokens)) != one
    assert model_fingerprint("Qwen/Qwen2.5-0.5B", SHA) == f"hub:Qwen/Qwen2.5-0.5B@{SHA}"
    assert model_fingerprint("Qwen/Qwen2.5-0.5B") == "hub:Qwen/Qwen2.5-0.5B@main"


def test_a_run_refuses_a_fleet_of_another_base_model_and_names_the_field(tmp_path, caplog):
    from core.models import check_same_base_model, model_fingerprint

    folder = str(_model_folder(tmp_path / "model"))
    check_same_base_model(model_fingerprint(folder), folder, None, "http://fleet")
    with pytest.raises(SystemExit, match=r"model.name_or_path: the fleet at http://fleet serves another base model"):
        check_same_base_model("files:" + "0" * 64, folder, None, "http://fleet")
    with pytest.raises(SystemExit, match="another base model"):
        check_same_base_model(f"hub:Qwen/Qwen2.5-0.5B@{SHA}", "Qwen/Qwen2.5-0.5B", "f" * 40, "http://fleet")
    with pytest.raises(SystemExit, match="does not say which base model"):
        check_same_base_model(None, folder, None, "http://fleet")
    # A hub name there, a folder here: not comparable without the hub, so a warning and no refusal.
    check_same_base_model(f"hub:Qwen/Qwen2.5-0.5B@{SHA}", folder, None, "http://fleet")
    assert "cannot check that the fleet at http://fleet serves this run's base model" in caplog.text
