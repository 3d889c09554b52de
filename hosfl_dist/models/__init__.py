"""Split models: a client part f_c, a server part f_s, and the task that turns server outputs into loss and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.config import Config
from hosfl_dist.core.seeding import Stream, stream_seed
from hosfl_dist.errors import ConfigError
from hosfl_dist.tasks import Task
from hosfl_dist.tasks.classification import ClassificationTask

Activation = dict[str, Tensor]
"""What the client sends the server: ``"z"`` is f_c's output (λ is ∂ℓ/∂z); other keys are side inputs the server
needs (e.g. attention masks), counted as uplink activation traffic too."""


@dataclass
class SplitModel:
    client: nn.Module
    server: nn.Module
    task: Task

    def client_forward(self, inputs: Any) -> Activation:
        return as_activation(self.client(**inputs) if isinstance(inputs, dict) else self.client(inputs))

    def keep(self, parts: tuple[str, ...]) -> SplitModel:
        """Drop the parts a role does not hold ("client", "server"), so their memory is freed."""
        for part in ("client", "server"):
            if part not in parts:
                setattr(self, part, None)
        return self


def as_activation(out: Tensor | Activation) -> Activation:
    return out if isinstance(out, dict) else {"z": out}


def server_forward(server: nn.Module, act: Activation) -> Tensor:
    """f_s on an activation: vision servers take z; servers with side inputs take the whole dict."""
    return server(act["z"]) if len(act) == 1 else server(act)


def build_split_model(cfg: Config, data_info: dict[str, Any], zeroth_order_client: bool | None = None) -> SplitModel:
    """Build f_c and f_s with weights that depend only on ``job.seed`` (identical in every process).

    ``zeroth_order_client`` (default: what the registry says of ``algorithm.name``) keeps an LM client part free of
    dropout.
    """
    if cfg.model.name == "hf":  # split decoder LM + LoRA + task head (hosfl_dist.models.lm)
        from hosfl_dist.models import lm

        if zeroth_order_client is None:
            from hosfl_dist.algorithms import get_algorithm

            zeroth_order_client = get_algorithm(cfg.algorithm.name).zeroth_order_client
        return lm.build(cfg, data_info, zeroth_order_client)
    from hosfl_dist.models import vision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(cfg.job.seed, Stream.VISION_INIT))
        if cfg.model.name == "resnet18":
            client, server = vision.resnet18_split(
                data_info["num_classes"],
                data_info["input_shape"][0],
                cfg.split.cut,
                cfg.model.freeze_bn,
                cfg.model.pretrained,
            )
        elif cfg.model.name == "small_cnn":
            if cfg.model.pretrained:
                raise ConfigError("model.pretrained is not supported for small_cnn")
            client, server = vision.small_cnn_split(
                data_info["num_classes"], data_info["input_shape"], cfg.split.cut, cfg.model.width
            )
        else:
            raise ConfigError(f"unknown model.name {cfg.model.name!r}")
    device = torch.device(cfg.job.device)
    return SplitModel(client.to(device), server.to(device), ClassificationTask())
