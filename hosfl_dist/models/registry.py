"""The registry that ``model.name`` selects from: the package's models (small_cnn, conv_mlp, resnet18, hf) and a
plug-in's.

A model of the ``vision`` family is any pair of torch modules (f_c, f_s) over tensor inputs with a classifier's
outputs: its :class:`ModelSpec` says how to build the pair for a cut, and which cuts leave each side a part. The
``hf`` family is the split decoder LM of :mod:`hosfl_dist.models.lm` (``model.source`` names the checkpoint). A
plug-in (``job.plugins``, ``--plugin``) registers its own with :func:`register_model`; the config check, both
runtimes and the export's restore then build it like the package's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hosfl_dist.core.registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from hosfl_dist.config import Config, ModelConfig

MODEL_FAMILIES = ("vision", "hf")
"""vision: (f_c, f_s) over tensors, classification; hf: a Hugging Face decoder LM (text tasks)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """``model.name``."""
    build: Callable[[Config, dict[str, Any], bool], tuple[nn.Module, nn.Module]] | None
    """(config, data info, zeroth_order_client) -> (f_c, f_s) cut at ``split.cut``. The data info holds
    ``num_classes`` and ``input_shape`` (one sample's); ``zeroth_order_client``: the method's client estimates
    gradients from forwards (no dropout, no autograd on f_c). Called with torch's global generator seeded from
    ``job.seed``, so the weights are the same in every process. None for the hf family (:mod:`hosfl_dist.models.lm`)."""
    cuts: tuple[int, int] = (1, 1)
    """The ``split.cut`` values (lowest, highest) that leave both sides a part (vision family)."""
    family: str = "vision"
    """One of :data:`MODEL_FAMILIES`: which tasks it takes (``data.name`` of the same family) and which methods."""
    whole: Callable[[ModelConfig, dict[str, Any]], nn.Module] | None = None
    """The uncut model with trainable BatchNorm, for centralised pretraining (None: it cannot be pretrained)."""

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise ValueError(f"model {self.name!r}: family {self.family!r} is not one of {list(MODEL_FAMILIES)}")
        if self.family == "vision" and (self.build is None or not 1 <= self.cuts[0] <= self.cuts[1]):
            raise ValueError(f"model {self.name!r}: a vision model needs build and cuts (lowest, highest) >= 1")


_MODELS: Registry[ModelSpec] = Registry("model", "model.name")


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` under ``spec.name`` (ValueError for a name taken by another model)."""
    return _MODELS.add(spec.name, spec)


def model_names() -> list[str]:
    """Every registered ``model.name``, the package's and the imported plug-ins'."""
    return _MODELS.names()


def get_model(name: str) -> ModelSpec:
    """The spec registered under ``name``; ConfigError listing the names otherwise."""
    return _MODELS.get_or_refuse(name)
