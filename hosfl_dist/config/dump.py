"""A config tree as plain data and as the YAML that loads back into it (config.yaml of a run)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hosfl_dist.config.schema import Config
from hosfl_dist.safe_yaml import dump


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return dump(config_to_dict(cfg))  # quotes a name such as 1e3 or 0o17, which YAML 1.2 reads as a number
