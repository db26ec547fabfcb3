"""Configs: a run's (`RunConfig`) and a fleet's (`FleetConfig`), pydantic models with a one-line description on
every field, read from YAML with `--set` overrides.

- `core.config.sections`: what both share (model, LoRA, task, router, bucket);
- `core.config.run`: a run, and the fleet it brings along when it joins none (`RunConfig.own_fleet`);
- `core.config.fleet`: a fleet, as `serve_config.yaml` names it and the ingress and replicas read it;
- `core.config.loading`: YAML, overrides, errors.
"""

from core.config.fleet import FleetConfig, FleetSettings, slots_needed
from core.config.loading import (
    DEFAULT_CONFIG,
    DEFAULT_FLEET_CONFIG,
    ConfigError,
    add_config_args,
    config_from_args,
    load_config,
    load_fleet_config,
)
from core.config.run import (
    EnvConfig,
    GRPOConfig,
    JoinConfig,
    LearnerConfig,
    LoggingConfig,
    ObjectiveConfig,
    RolloutConfig,
    RunConfig,
)
from core.config.sections import (
    CONFIG_DIR,
    HEAD_NODE,
    NO_REASONING_GYM,
    REPO_ROOT,
    VLLM_LORA_RANKS,
    BucketConfig,
    LoraConfig,
    ModelConfig,
    RouterConfig,
    Section,
    SpotConfig,
    TaskConfig,
    TinyModelConfig,
    ToolWarmupConfig,
    vllm_rank_for,
)

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_CONFIG",
    "DEFAULT_FLEET_CONFIG",
    "HEAD_NODE",
    "REPO_ROOT",
    "VLLM_LORA_RANKS",
    "BucketConfig",
    "ConfigError",
    "EnvConfig",
    "FleetConfig",
    "FleetSettings",
    "GRPOConfig",
    "JoinConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "RolloutConfig",
    "RouterConfig",
    "RunConfig",
    "Section",
    "SpotConfig",
    "TaskConfig",
    "NO_REASONING_GYM",
    "TinyModelConfig",
    "ToolWarmupConfig",
    "add_config_args",
    "config_from_args",
    "load_config",
    "load_fleet_config",
    "slots_needed",
    "vllm_rank_for",
]
