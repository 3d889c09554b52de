"""A config tree as plain data and as the YAML that loads back into it (config.yaml of a run)."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from hosfl_dist.config.schema import Config


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
