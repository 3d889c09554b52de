"""Generation (SQuAD): causal LM loss on the answer tokens in training; greedy decoding through the split in
evaluation, scored with SQuAD F1 / exact match."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from hosfl_dist.tasks.classification import last_real_index
from hosfl_dist.tasks.squad_metric import DEFAULT_STOP_STRINGS, extract_answer, squad_exact_match, squad_f1

IGNORE_INDEX = -100
"""Label of the positions that :func:`lm_loss` skips (prompt and padding)."""
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_NEW_TOKENS = 32
"""Cap of greedily generated SQuAD answer tokens."""


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Causal LM loss: position t predicts ``labels[t + 1]``; mean over the labelled (not -100) tokens, in float32.

    A batch without labelled tokens gives 0 (still attached to the graph).
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])  # (B*(T-1), V)
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)  # (B*(T-1),)
    keep = shift_labels != IGNORE_INDEX
    if not bool(keep.any()):
        return logits.sum() * 0.0
    return F.cross_entropy(shift_logits[keep].float(), shift_labels[keep])  # float32 on the answer rows only


class GenerationTask:
    """SQuAD: causal LM loss on the answer tokens; evaluation by greedy generation through the split.

    Evaluation labels are the gold answers as zero-padded UTF-8 bytes, (N, A, L) uint8 (see :func:`encode_answers`),
    so they travel as a tensor like any label. Metrics are fractions in [0, 1]: ``eval_f1``, ``eval_exact_match``,
    and ``eval_accuracy`` = ``eval_f1`` (the paper's SQuAD score).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        padding_side: str,
        max_positions: int | None,
        max_new_tokens: int = MAX_NEW_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.padding_side = padding_side
        self.max_positions = max_positions
        self.max_new_tokens = max_new_tokens
        self.eos_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)

    # -- training (server) -------------------------------------------------------------------------------------
    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        return lm_loss(outputs, labels)  # (B, T, V) logits, (B, T) labels with IGNORE_INDEX off the answer

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        """Teacher-forced loss sums on token labels (B, T) (the generation path reports F1/EM instead)."""
        n = int((labels[:, 1:] != IGNORE_INDEX).sum())
        return {"loss_sum": lm_loss(outputs, labels).item() * n, "tokens": float(n)}

    def next_token(self, outputs: Tensor, attention_mask: Tensor) -> Tensor:
        """Greedy next token of each row: argmax of the logits at its last real token, (B,)."""
        rows = torch.arange(outputs.shape[0], device=outputs.device)
        return outputs[rows, last_real_index(attention_mask).to(outputs.device)].argmax(-1)

    # -- evaluation (worker side: runs the loop; server side: scores) -------------------------------------------
    def generate(
        self,
        x: dict[str, Tensor],
        client_forward: Callable[[dict[str, Tensor]], dict[str, Tensor]],
        next_token: Callable[[dict[str, Tensor]], Tensor],
    ) -> Tensor:
        """Greedy continuation of each prompt: client forward on the growing sequences -> server -> next token.

        No KV cache: each step re-runs the whole sequence (f_c must see all of it). Rows stop at EOS or a stop
        string and leave the batch; at most ``max_new_tokens`` (and the model's position limit). Returns the new
        tokens, (B, n) long, -1 after each row's end.
        """
        ids, mask = x["input_ids"], x["attention_mask"]
        seqs = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        new: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for _ in range(self.max_new_tokens):
            if self.max_positions is not None:
                active = [i for i in active if len(seqs[i]) + len(new[i]) < self.max_positions]
            if not active:
                break
            batch = self._pad([seqs[i] + new[i] for i in active])
            tokens = next_token(client_forward(batch)).tolist()
            still = []
            for i, tok in zip(active, tokens):
                new[i].append(int(tok))
                if tok != self.eos_id and not self._stopped(new[i]):
                    still.append(i)
            active = still
        out = torch.full((len(seqs), max((len(n) for n in new), default=0)), -1, dtype=torch.long)
        for i, n in enumerate(new):
            out[i, : len(n)] = torch.tensor(n, dtype=torch.long)
        return out

    def generation_stats(self, tokens: Tensor, labels: Tensor) -> dict[str, float]:
        """Summed SQuAD F1 / EM of generated ``tokens`` (B, n) against gold answers ``labels`` (B, A, L) bytes."""
        f1 = em = 0.0
        for row, gold in zip(tokens.tolist(), decode_answers(labels)):
            text = self.tokenizer.decode([t for t in row if t >= 0], skip_special_tokens=True)
            pred = extract_answer(text)
            f1 += squad_f1(pred, gold)
            em += squad_exact_match(pred, gold)
        return {"f1_sum": f1, "em_sum": em, "count": float(len(tokens))}

    def finalize(self, stats: dict[str, float]) -> dict[str, float | None]:
        n = max(stats.get("count", 0.0), 1.0)
        f1, em = stats.get("f1_sum", 0.0) / n, stats.get("em_sum", 0.0) / n
        tokens = stats.get("tokens", 0.0)
        loss = stats["loss_sum"] / tokens if tokens else None  # only when token labels were evaluated
        return {"eval_accuracy": f1, "eval_loss": loss, "eval_f1": f1, "eval_exact_match": em}

    def _pad(self, seqs: list[list[int]]) -> dict[str, Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            cols = slice(0, len(s)) if self.padding_side == "right" else slice(width - len(s), width)
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def _stopped(self, new: list[int]) -> bool:
        text = self.tokenizer.decode(new, skip_special_tokens=False)
        return any(stop in text for stop in DEFAULT_STOP_STRINGS)


def encode_answers(answers: Sequence[Sequence[str]]) -> Tensor:
    """Gold answer lists -> (N, A, L) uint8: answer j of example i as UTF-8 bytes, zero-padded."""
    raw = [[a.encode("utf-8") for a in ans] for ans in answers]
    n_ans = max((len(r) for r in raw), default=0)
    width = max((len(b) for r in raw for b in r), default=0)
    out = torch.zeros((len(raw), n_ans, width), dtype=torch.uint8)
    for i, r in enumerate(raw):
        for j, b in enumerate(r):
            out[i, j, : len(b)] = torch.tensor(list(b), dtype=torch.uint8)
    return out


def decode_answers(labels: Tensor) -> list[list[str]]:
    """Inverse of :func:`encode_answers` (empty slots dropped)."""
    out = []
    for ex in labels.to(torch.uint8).tolist():
        answers = [bytes(b for b in a if b).decode("utf-8", errors="replace") for a in ex]
        out.append([a for a in answers if a])
    return out
