"""Configs: a run's (`RunConfig`) and a fleet's (`FleetConfig`), pydantic models with a one-line description on
every field, read from YAML with `--set` overrides.

- `core.config.sections`: what both share (model, LoRA, task, router, bucket);
- `core.config.run`: a run, the checks that cross its sections, and the fleet it brings along when it joins none
  (`RunConfig.own_fleet`); its sections by concern: `core.config.envs` (the environment's kinds),
  `core.config.objectives` (each objective with its settings), `core.config.training` (the optimizer and the
  sampling every objective shares), `core.config.teacher`, `core.config.tasks` (a run's checks of its task),
  `core.config.judges` (the judges a run rewards with);
- `core.config.deprecated`: old keys read for one more release, each moved with one line naming the new key;
- `core.config.fleet`: a fleet, as `serve_config.yaml` names it and the ingress and replicas read it;
- `core.config.loading`: YAML, overrides, errors.
"""

from core.config.envs import EnvConfig
from core.config.evaluation import EvalConfig, EvalSet
from core.config.fleet import FleetConfig, FleetSettings, slots_needed
from core.config.loading import (
    DEFAULT_CONFIG,
    DEFAULT_FLEET_CONFIG,
    ConfigError,
    add_config_args,
    config_errors_exit,
    config_from_args,
    load_config,
    load_fleet_config,
)
from core.config.objectives import ObjectiveConfig
from core.config.run import JoinConfig, LearnerConfig, LoggingConfig, RolloutConfig, RunConfig
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
from core.config.training import SamplingConfig, TrainConfig

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
    "EvalConfig",
    "EvalSet",
    "FleetConfig",
    "FleetSettings",
    "JoinConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "RolloutConfig",
    "RouterConfig",
    "RunConfig",
    "SamplingConfig",
    "Section",
    "SpotConfig",
    "TaskConfig",
    "NO_REASONING_GYM",
    "TinyModelConfig",
    "ToolWarmupConfig",
    "TrainConfig",
    "add_config_args",
    "config_errors_exit",
    "config_from_args",
    "load_config",
    "load_fleet_config",
    "slots_needed",
    "vllm_rank_for",
]
