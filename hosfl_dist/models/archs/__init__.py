"""The paper's model architectures without their weights: each model's published Hugging Face ``config.json``.

Scaling studies and memory tests need the real shapes (36 blocks of width 4096 for Qwen3-8B, a 262k vocabulary for
Gemma-3-270M) on machines that cannot reach the hub; ``model.source=arch:<name>`` builds one of these with random
weights. Each ``<name>.json`` next to this module is the model's config.json as published on the hub, less the keys
no transformers version reads; README.md says where each came from and what parameter count it gives.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from hosfl_dist.errors import ConfigError, did_you_mean

ARCH_NAMES: list[str] = sorted(
    entry.name.removesuffix(".json") for entry in resources.files(__name__).iterdir() if entry.name.endswith(".json")
)
"""The architectures shipped with the package (the JSON files here), e.g. ``qwen3-8b``, ``gemma-3-270m``."""


def arch_fields(name: str) -> dict[str, Any]:
    """A fresh copy of architecture `name`'s config.json fields (ConfigError naming the known names otherwise).

    For callers that change a field before building, e.g. a shallower model of the same family for a scaling
    study; note that Gemma-3's ``layer_types`` must keep one entry per block.
    """
    if name not in ARCH_NAMES:
        raise ConfigError(f"unknown architecture {name!r}; choose one of {', '.join(ARCH_NAMES)}"
                          + did_you_mean(name, ARCH_NAMES))
    return json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8"))


def arch_config(name: str) -> PretrainedConfig:
    """The transformers config of architecture `name`, as ``from_pretrained`` would read it from the hub.

    Build the model with ``AutoModelForCausalLM.from_config`` (under ``torch.device("meta")`` for shapes alone).
    """
    fields = arch_fields(name)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
