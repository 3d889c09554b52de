"""What turns the server's outputs into a loss and metrics: classification (label words or classes) and generation.

Tasks import neither data/ nor models/: the data builders use them to encode labels, the model builders to attach
the head, and the server calls them.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Task(Protocol):
    """Loss and evaluation on the server's outputs."""

    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """Mean loss over the batch (ℓ of one client's batch)."""

    def sample_counts(self, labels: Tensor) -> Tensor:
        """(B,) float: the count of each sample's loss (``sample_losses``' counts), from the labels alone, so the server
        knows each client's weight before any forward."""

    def sample_losses(self, outputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample (loss sum, count), float32 (B,) each: ``loss`` of a batch is sums.sum() / counts.sum(), so a
        batch split into pieces (micro-batches, server ranks) is weighted exactly."""

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        """Summable statistics of one evaluation batch."""

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        """Metrics (at least ``eval_accuracy`` and ``eval_loss``) from summed statistics."""
