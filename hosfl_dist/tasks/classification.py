"""Classification: cross-entropy and accuracy over class scores; for LMs the scores are the label words' logits at
the last real token of each prompt (MeZO's prompt-based classification)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hosfl_dist.core.plugins import plugin_call, refuse


Loss = Callable[[Tensor, Tensor], Tensor]
"""(outputs (B, C), labels (B,)) -> (B,) per-sample loss, differentiable in the outputs (λ = ∂ℓ/∂z flows through it)."""
Score = Callable[[Tensor, Tensor], Tensor]
"""(outputs (B, C), labels (B,)) -> (B,) per-sample score; the metric is its mean over the held-out samples."""


class ClassificationTask:
    """Class scores against int64 labels: ``loss`` (per sample; default cross-entropy) is what the server trains on,
    and evaluation reports ``eval_loss`` (its mean), ``eval_accuracy`` and each of ``metrics`` (name -> per-sample
    score, a mean over the held-out samples), which a plug-in task gives (``TaskSpec.loss``, ``TaskSpec.metrics``).

    A plug-in's loss and metrics are its code: each call's result is checked to be one value per sample (``(B,)``),
    and what they raise is one line naming the plug-in (:mod:`hosfl_dist.core.plugins`); :meth:`check` calls them on a
    made-up batch where a run is built (``--check`` and ``--dry-run`` too)."""

    def __init__(self, loss: Loss | None = None, metrics: Mapping[str, Score] | None = None, task: str = "") -> None:
        self.custom_loss = loss
        """None: cross-entropy, through torch's own reductions (the package's runs stay as they were)."""
        self.metrics = dict(metrics or {})
        self.task = task
        """The task's ``data.name``, for the messages."""

    def _per_sample(self, fn: Callable[[Tensor, Tensor], Tensor], what: str, outputs: Tensor, labels: Tensor) -> Tensor:
        """``fn(outputs, labels)``, a plug-in's loss or metric, checked to give one value per sample."""
        what = f"task {self.task}: {what}(outputs, labels)"
        with plugin_call(fn, what):
            out = fn(outputs, labels)
        if not isinstance(out, Tensor) or out.shape != labels.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise refuse(fn, what, f"gave {got} for outputs {tuple(outputs.shape)} and labels {tuple(labels.shape)}: "
                         f"it must give one value per sample, a tensor of shape {tuple(labels.shape)}")  # fmt: skip
        return out

    def _losses(self, outputs: Tensor, labels: Tensor) -> Tensor:
        assert self.custom_loss is not None
        return self._per_sample(self.custom_loss, "loss", outputs, labels)

    def check(self, num_classes: int) -> None:
        """Call a plug-in's loss and metrics on a made-up batch of ``num_classes`` scores, as training and evaluation
        will: each must give one value per sample, the loss one differentiable in the outputs (λ = ∂ℓ/∂z)."""
        if self.custom_loss is None and not self.metrics:
            return
        batch = 2
        outputs = torch.linspace(-1.0, 1.0, batch * num_classes).reshape(batch, num_classes)  # (B, C)
        labels = torch.arange(batch) % num_classes  # (B,)
        if self.custom_loss is not None:
            losses = self._losses(outputs.clone().requires_grad_(True), labels)
            if not losses.requires_grad:
                raise refuse(self.custom_loss, f"task {self.task}: loss(outputs, labels)", "is not differentiable in "
                             "the outputs (the server trains on it: λ = ∂ℓ/∂z is taken through it)")  # fmt: skip
        with torch.no_grad():
            for name, score in self.metrics.items():
                self._per_sample(score, f"metric {name}", outputs, labels)

    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        if self.custom_loss is None:
            return F.cross_entropy(outputs, labels)
        return self._losses(outputs, labels).mean()  # ℓ of the batch

    def sample_counts(self, labels: Tensor) -> Tensor:
        """What each sample's loss is a mean over: one prediction."""
        return torch.ones(labels.shape[0])

    def sample_losses(self, outputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample (loss sum, count) in float32: the loss of each sample, count 1."""
        if self.custom_loss is None:
            sums = F.cross_entropy(outputs.float(), labels, reduction="none")
        else:
            sums = self._losses(outputs.float(), labels).float()
        return sums, torch.ones_like(sums)

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        stats = {
            "loss_sum": (F.cross_entropy(outputs, labels, reduction="sum") if self.custom_loss is None
                         else self._losses(outputs, labels).sum()).item(),
            "correct": (outputs.argmax(-1) == labels).sum().item(),
            "count": float(labels.numel()),
        }
        for name, score in self.metrics.items():
            stats[f"{name}_sum"] = float(self._per_sample(score, f"metric {name}", outputs, labels).sum().item())
        return stats

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        n = max(stats.get("count", 0.0), 1.0)
        out = {"eval_accuracy": stats.get("correct", 0.0) / n, "eval_loss": stats.get("loss_sum", 0.0) / n}
        out.update({name: stats.get(f"{name}_sum", 0.0) / n for name in self.metrics})
        return out


def last_real_index(attention_mask: Tensor) -> Tensor:
    """(B, T) padding mask -> (B,) position of each row's last real token (either padding side)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.to(positions.dtype) * positions).argmax(dim=1)


def classification_logits(logits: Tensor, attention_mask: Tensor, label_word_ids: Sequence[int]) -> Tensor:
    """(B, T, V) logits -> (B, n_labels): the label words' logits at each row's last real token.

    The last real token is the largest position where ``attention_mask`` is 1, which is ``sum(mask) - 1`` under
    right padding and ``T - 1`` under left padding.
    """
    if logits.dim() != 3 or attention_mask.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and attention_mask {tuple(attention_mask.shape)} do not match")
    last = last_real_index(attention_mask).to(logits.device)  # (B,)
    rows = torch.arange(logits.shape[0], device=logits.device)
    ids = torch.as_tensor(list(label_word_ids), dtype=torch.long, device=logits.device)
    return logits[rows, last][:, ids]  # (B, n_labels)
