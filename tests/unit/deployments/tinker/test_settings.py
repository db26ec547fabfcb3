"""The Tinker service's limits are its fleet's: the context length, the largest LoRA rank, the completions per request,
and the vocabulary of the model the fleet serves."""

import json

from core.config import FleetConfig
from deployments.tinker.settings import TinkerSettings


def test_the_services_limits_are_the_fleets_and_its_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 300}))
    fleet = FleetConfig.model_validate(
        {"model": {"max_model_len": 512}, "fleet": {"max_lora_rank": 16, "max_sequences_per_request": 64}}
    )
    settings = TinkerSettings.of_fleet(
        fleet, "http://127.0.0.1:1", "tiny", str(tmp_path), cache_dir="/tmp", max_models=3
    )
    assert (settings.max_context, settings.vocab_size, settings.max_lora_rank, settings.max_samples) == (
        512,
        300,
        16,
        64,
    )
    assert settings.max_models == 3


def test_a_hub_model_is_named_by_its_hub_id_for_the_sdks_tokenizer_and_the_tiny_one_by_its_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))

    def settings(name):
        fleet = FleetConfig.model_validate({"model": {"name_or_path": name}})
        return TinkerSettings.of_fleet(fleet, "http://127.0.0.1:1", name, str(tmp_path), cache_dir="/tmp")

    assert settings("Qwen/Qwen3-0.6B").tokenizer_id == "Qwen/Qwen3-0.6B"
    assert settings("tiny").tokenizer_id is None  # its folder (model_path), built on the fleet's machine


def test_the_services_limits_are_the_fleets_tinker_section_and_a_flag_overrides_one(tmp_path):
    """One config system: the fleet's YAML (or `--set tinker.max_models=...`) sets the service's limits."""
    from core.config import load_fleet_config

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    fleet = load_fleet_config(None, ["tinker.max_models=7", "tinker.session_idle_s=30"])
    settings = TinkerSettings.of_fleet(fleet, "http://127.0.0.1:1", "tiny", str(tmp_path), cache_dir="/tmp")
    assert (settings.max_models, settings.session_idle_s, settings.learners) == (7, 30.0, 1)
    flagged = TinkerSettings.of_fleet(
        fleet, "http://127.0.0.1:1", "tiny", str(tmp_path), cache_dir="/tmp", max_models=2
    )
    assert flagged.max_models == 2
