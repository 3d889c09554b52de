"""Classification: cross-entropy and accuracy over class scores; for LMs the scores are the label words' logits at
the last real token of each prompt (MeZO's prompt-based classification)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


class ClassificationTask:
    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(outputs, labels)

    def sample_counts(self, labels: Tensor) -> Tensor:
        """What each sample's loss is a mean over: one prediction."""
        return torch.ones(labels.shape[0])

    def sample_losses(self, outputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample (loss sum, count) in float32: the cross-entropy of each sample, count 1."""
        sums = F.cross_entropy(outputs.float(), labels, reduction="none")
        return sums, torch.ones_like(sums)

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        return {
            "loss_sum": F.cross_entropy(outputs, labels, reduction="sum").item(),
            "correct": (outputs.argmax(-1) == labels).sum().item(),
            "count": float(labels.numel()),
        }

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        n = max(stats.get("count", 0.0), 1.0)
        return {"eval_accuracy": stats.get("correct", 0.0) / n, "eval_loss": stats.get("loss_sum", 0.0) / n}


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
