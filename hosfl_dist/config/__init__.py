"""The typed configuration tree: defaults < YAML file < dotted command-line overrides.

- :mod:`.schema`: the sections (one dataclass each, every field with a one-line docstring) and the checks each
  section makes of itself;
- :mod:`.load`: strict loading: an unknown key, a value of the wrong type or out of range raises
  :class:`~hosfl_dist.errors.ConfigError` naming the key, the section and the value, so a typo never silently
  falls back to a default;
- :mod:`.dump`: a tree as plain data and as YAML;
- :mod:`.environment`: the environment variables the package reads, each with what its value must be.

What needs two sections or a registry (methods, models, tasks) is checked above the registries, where a run's config
is built (:mod:`hosfl_dist.runtime.checks`). This package imports nothing of hosfl_dist but its errors and YAML reader.
"""

from hosfl_dist.config.dump import config_to_dict, dump_config
from hosfl_dist.config.load import build_config, build_section, load_config
from hosfl_dist.config.schema import (
    DEVICE,
    FLOAT32_MAX,
    IFNAME,
    INT64,
    LOGGERS,
    MAX_EVALUATIONS,
    MAX_LORA_RANK,
    MAX_PERTURBATIONS,
    MAX_THREADS,
    MAX_WIDTH,
    MIN_MU,
    NAME,
    NAME_MAX,
    PATH_MAX,
    TEXT_KEYS,
    AlgorithmConfig,
    CheckpointConfig,
    ClientsConfig,
    CommConfig,
    Config,
    DataConfig,
    EarlyStoppingConfig,
    FieldError,
    JobConfig,
    LinkConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ServerConfig,
    SplitConfig,
    TrainConfig,
    ZOConfig,
    check,
    link_delay_s,
)

__all__ = [
    "DEVICE",
    "FLOAT32_MAX",
    "IFNAME",
    "INT64",
    "LOGGERS",
    "MAX_EVALUATIONS",
    "MAX_LORA_RANK",
    "MAX_PERTURBATIONS",
    "MAX_THREADS",
    "MAX_WIDTH",
    "MIN_MU",
    "NAME",
    "NAME_MAX",
    "PATH_MAX",
    "TEXT_KEYS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClientsConfig",
    "CommConfig",
    "Config",
    "DataConfig",
    "EarlyStoppingConfig",
    "FieldError",
    "JobConfig",
    "LinkConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ServerConfig",
    "SplitConfig",
    "TrainConfig",
    "ZOConfig",
    "build_config",
    "build_section",
    "check",
    "config_to_dict",
    "dump_config",
    "link_delay_s",
    "load_config",
]
