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

CachedStep = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
"""One decoding step with KV caches: (input_ids (B, q), attention_mask (B, T), keep) -> greedy tokens (B,). ``keep``
(None: all) lists the rows of the previous step that go on; both sides drop the others from their caches first."""


def predicted_positions(labels: Tensor) -> Tensor:
    """(B, T) token labels -> (B, T) bool: the positions t whose next label ``labels[t + 1]`` is not ignored, i.e.
    the only positions whose logits the causal LM loss reads."""
    predict = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    predict[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return predict


def next_token_targets(labels: Tensor) -> Tensor:
    """(B, T) token labels -> (N,) long: the label each :func:`predicted_positions` position predicts,
    ``labels[t + 1]``, in row-major order."""
    return labels[:, 1:][labels[:, 1:] != IGNORE_INDEX]


def lm_sample_losses(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample causal LM loss: (sum of the float32 cross-entropies of its labelled tokens, their count), (B,) each.

    ``logits`` are either full (B, T, V), where position t predicts ``labels[t + 1]``, or (N, V) at the
    :func:`predicted_positions` of ``labels`` only, in row-major order (what the server's head computes when it is
    given them); both give the same numbers. (N,) outputs are the token losses themselves, at those positions (what
    the server computes when given :func:`next_token_targets` too: ``server.loss_chunk_tokens``).
    """
    predict = predicted_positions(labels.to(logits.device))  # (B, T)
    if logits.dim() == 3:
        logits = logits[predict]  # (N, V)
    rows = torch.arange(predict.shape[0], device=logits.device).unsqueeze(1).expand_as(predict)
    if logits.dim() == 1:
        ce = logits.float()  # (N,) token losses already
    else:
        ce = F.cross_entropy(logits.float(), next_token_targets(labels.to(logits.device)), reduction="none")  # (N,)
    sums = torch.zeros(predict.shape[0], dtype=torch.float32, device=logits.device).index_add(0, rows[predict], ce)
    return sums, predict.sum(dim=1).float()


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Causal LM loss: position t predicts ``labels[t + 1]``; mean over the labelled (not -100) tokens, in float32,
    i.e. ``sums.sum() / counts.sum()`` of :func:`lm_sample_losses` (full or selected logits).

    A batch without labelled tokens gives 0 (still attached to the graph).
    """
    sums, counts = lm_sample_losses(logits, labels)
    return sums.sum() / counts.sum().clamp_min(1.0)  # no labelled token: 0 / 1, without a host sync to ask


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
        loss_chunk_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.loss_chunk_tokens = loss_chunk_tokens
        """``server.loss_chunk_tokens``: above 0 the server's training forward is given the targets and returns
        token losses computed in chunks (:func:`~hosfl_dist.models.hf_split.chunked_token_losses`)."""
        self.padding_side = padding_side
        self.max_positions = max_positions
        self.max_new_tokens = max_new_tokens
        self.eos_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)

    # -- training (server) -------------------------------------------------------------------------------------
    def server_inputs(self, labels: Tensor) -> dict[str, Tensor]:
        """Side inputs of f_s that the server computes from the labels: ``{"predict": (B, T) bool}``, the positions
        whose logits the loss reads (the answer's), so the head computes (N, V) logits, not (B, T, V); with
        ``loss_chunk_tokens`` also ``"targets"`` (N,), so that f_s returns the N token losses, chunk by chunk."""
        if self.loss_chunk_tokens:
            return {"predict": predicted_positions(labels), "targets": next_token_targets(labels)}
        return {"predict": predicted_positions(labels)}

    def sample_counts(self, labels: Tensor) -> Tensor:
        """Labelled tokens of each sample (the tokens its loss is a mean over), float32 (B,)."""
        return predicted_positions(labels).sum(1).float()

    def sample_losses(self, outputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample (sum of token losses, labelled tokens), float32 (B,); outputs full or selected logits."""
        return lm_sample_losses(outputs, labels)

    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        return lm_loss(outputs, labels)  # (B, T, V) or selected (N, V) logits, (B, T) labels, -100 off the answer

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        """Teacher-forced loss sums on token labels (B, T) (the generation path reports F1/EM instead)."""
        sums, counts = lm_sample_losses(outputs, labels)
        return {"loss_sum": sums.sum().item(), "tokens": counts.sum().item()}

    def next_token_inputs(self, attention_mask: Tensor, length: int) -> dict[str, Tensor]:
        """What the server adds to an activation whose z covers the last ``length`` of the mask's T positions, so
        that its head runs at each row's last real token only: ``{"predict": (B, length) bool}``, one per row."""
        cols = torch.arange(attention_mask.shape[1] - length, attention_mask.shape[1], device=attention_mask.device)
        predict = cols.unsqueeze(0) == last_real_index(attention_mask).unsqueeze(1)  # (B, length)
        if not bool(predict.any(dim=1).all()):
            raise ValueError(f"a row's last real token is not among the {length} positions sent")
        return {"predict": predict}

    def next_token(self, outputs: Tensor, attention_mask: Tensor) -> Tensor:
        """Greedy next token of each row, (B,): the argmax of (B, V) logits at the rows' last real tokens (see
        :meth:`next_token_inputs`), or of full (B, T, V) logits at the last real token."""
        if outputs.dim() == 3:
            rows = torch.arange(outputs.shape[0], device=outputs.device)
            outputs = outputs[rows, last_real_index(attention_mask).to(outputs.device)]
        return outputs.argmax(-1)

    # -- evaluation (worker side: runs the loop; server side: scores) -------------------------------------------
    def generate(
        self,
        x: dict[str, Tensor],
        client_forward: Callable[[dict[str, Tensor]], dict[str, Tensor]],
        next_token: Callable[[dict[str, Tensor]], Tensor],
    ) -> Tensor:
        """Greedy continuation of each prompt: client forward on the growing sequences -> server -> next token.

        No KV cache: each step re-runs the whole sequence (the reference of :meth:`generate_cached`). Rows stop at
        EOS or a stop string and leave the batch; at most ``max_new_tokens`` (and the model's position limit).
        Returns the new tokens, (B, n) long, -1 after each row's end.
        """
        ids, mask = x["input_ids"], x["attention_mask"]
        seqs = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        new: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for _ in range(self.max_new_tokens):
            active = [i for i in active if self._room(len(seqs[i]) + len(new[i]))]
            if not active:
                break
            batch = self._pad([seqs[i] + new[i] for i in active], self.padding_side)
            tokens = next_token(client_forward(batch)).tolist()
            active = [i for i, tok in zip(active, tokens) if self._extend(new[i], int(tok))]
        return _stack(new)

    def generate_cached(self, x: dict[str, Tensor], step: CachedStep) -> Tensor:
        """:meth:`generate` with KV caches on both sides: ``step`` gets the prompts first, then each row's newest
        token only (B, 1), with the mask extended by one column, and the rows that go on.

        The prompts are laid out left-padded whatever ``padding_side`` (every row's newest token in the last column,
        so one (B, 1) step serves all rows). RoPE models count positions over the padding too, so a row's positions
        here differ from the no-cache path's by a constant shift (under right padding, or once rows have left its
        re-padded batch); rotary attention depends on position differences only, so both paths compute the same
        function (OPT's positions follow the mask and are equal) and give the same tokens unless float rounding
        flips a near tie. Finished rows are dropped by index on both sides (``keep``), so client and server caches
        stay row-aligned.
        """
        ids, mask = x["input_ids"], x["attention_mask"]
        seqs = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        new: list[list[int]] = [[] for _ in seqs]
        active = [i for i, s in enumerate(seqs) if self._room(len(s))]
        if not active or self.max_new_tokens <= 0:
            return _stack(new)
        batch = self._pad([seqs[i] for i in active], "left")
        inputs, mask, keep = batch["input_ids"], batch["attention_mask"], None
        for n in range(1, self.max_new_tokens + 1):
            tokens = step(inputs, mask, keep).tolist()
            go_on = [
                j
                for j, (i, tok) in enumerate(zip(active, tokens))
                if self._extend(new[i], int(tok)) and self._room(len(seqs[i]) + n)
            ]
            if not go_on or n == self.max_new_tokens:
                break
            keep = None if len(go_on) == len(active) else torch.tensor(go_on, dtype=torch.long)
            rows = torch.tensor(go_on, dtype=torch.long)
            inputs = torch.tensor([[tokens[j]] for j in go_on], dtype=torch.long)  # (B', 1)
            mask = torch.cat([mask[rows], torch.ones(len(go_on), 1, dtype=mask.dtype)], dim=1)  # (B', T + n)
            active = [active[j] for j in go_on]
        return _stack(new)

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

    def _pad(self, seqs: list[list[int]], side: str) -> dict[str, Tensor]:
        return pad_sequences(seqs, self.pad_id, side)

    def _room(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens can take one more (the model's position limit)."""
        return self.max_positions is None or length < self.max_positions

    def _extend(self, new: list[int], token: int) -> bool:
        """Append a generated token to a row; whether the row goes on (no EOS, no stop string yet)."""
        new.append(token)
        return token != self.eos_id and not self._stopped(new)

    def _stopped(self, new: list[int]) -> bool:
        text = self.tokenizer.decode(new, skip_special_tokens=False)
        return any(stop in text for stop in DEFAULT_STOP_STRINGS)


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, side: str) -> dict[str, Tensor]:
    """Token id lists -> ``input_ids`` and ``attention_mask`` (N, longest), padded with ``pad_id`` on ``side``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, cols] = torch.tensor(list(s), dtype=torch.long)
        mask[i, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _stack(new: list[list[int]]) -> Tensor:
    """Generated tokens per row -> (B, n) long, -1 after each row's end."""
    out = torch.full((len(new), max((len(n) for n in new), default=0)), -1, dtype=torch.long)
    for i, n in enumerate(new):
        out[i, : len(n)] = torch.tensor(n, dtype=torch.long)
    return out


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
