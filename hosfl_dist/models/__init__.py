"""Split models: a client part f_c, a server part f_s, and the task that turns server outputs into loss and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError
from hosfl_dist.zo import mix_seed

Activation = dict[str, Tensor]
"""What the client sends the server: ``"z"`` is f_c's output (λ is ∂ℓ/∂z); other keys are side inputs the server
needs (e.g. attention masks), counted as uplink activation traffic too."""


class Task(Protocol):
    """Loss and evaluation on the server's outputs."""

    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """Mean loss over the batch (ℓ of one client's batch)."""

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        """Summable statistics of one evaluation batch."""

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        """Metrics (at least ``eval_accuracy`` and ``eval_loss``) from summed statistics."""


class ClassificationTask:
    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(outputs, labels)

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        return {
            "loss_sum": F.cross_entropy(outputs, labels, reduction="sum").item(),
            "correct": (outputs.argmax(-1) == labels).sum().item(),
            "count": float(labels.numel()),
        }

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        n = max(stats.get("count", 0.0), 1.0)
        return {"eval_accuracy": stats.get("correct", 0.0) / n, "eval_loss": stats.get("loss_sum", 0.0) / n}


@dataclass
class SplitModel:
    client: nn.Module
    server: nn.Module
    task: Task

    def client_forward(self, inputs: Any) -> Activation:
        return as_activation(self.client(**inputs) if isinstance(inputs, dict) else self.client(inputs))


def as_activation(out: Tensor | Activation) -> Activation:
    return out if isinstance(out, dict) else {"z": out}


def server_forward(server: nn.Module, act: Activation) -> Tensor:
    """f_s on an activation: vision servers take z; servers with side inputs take the whole dict."""
    return server(act["z"]) if len(act) == 1 else server(act)


def build_split_model(cfg: Config, data_info: dict[str, Any]) -> SplitModel:
    """Build f_c and f_s with weights that depend only on ``job.seed`` (identical in every process)."""
    if cfg.model.name == "hf":  # split decoder LM + LoRA + task head (hosfl_dist.models.lm)
        from hosfl_dist.models import lm

        return lm.build(cfg, data_info)
    from hosfl_dist.models import vision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(cfg.job.seed, 0x0DE1))
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
