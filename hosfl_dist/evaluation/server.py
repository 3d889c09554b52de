"""The server's side of evaluation: the evaluation calls and their statistics (see :mod:`hosfl_dist.evaluation`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.errors import ProtocolError
from hosfl_dist.models import Activation, server_forward
from hosfl_dist.transport.wire import EVAL, wire


@dataclass
class _EvalCache:
    """The server's KV cache of one evaluation batch: the worker's key, the cache, and what it holds."""

    key: Hashable
    kv: Any
    rows: int
    columns: int = 0


class EvalServer:
    """Runs evaluation activations through f_s (the algorithm server's module, between rounds) and sums the task's
    statistics until a metrics row pops them."""

    def __init__(self, model: nn.Module, task: Any) -> None:
        self.model = model
        self.task = task
        self.device = next(model.parameters()).device
        self._stats: dict[str, float] = {}
        self._cache: _EvalCache | None = None
        """The KV cache of f_s's blocks for the evaluation batch being decoded (at most one lives)."""

    def _forward(self, act: Activation, past_key_values: Any = None) -> Tensor:
        act = {k: v.to(self.device) for k, v in act.items()}
        with torch.no_grad():
            was = self.model.training
            if was:  # a decoding step is short: walking every module to switch modes is worth skipping
                self.model.eval()
            if past_key_values is None:
                out = server_forward(self.model, act)
            else:  # through the module's own forward, where an FSDP-sharded root gathers its parameters
                out = self.model(act, past_key_values=past_key_values)
            if was:
                self.model.train()
        return out

    def _add(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self._stats[k] = self._stats.get(k, 0.0) + v

    @wire(args={"act": EVAL, "labels": EVAL})
    def eval_batch(self, act: Activation, labels: Tensor) -> None:
        self._add(self.task.eval_stats(self._forward(act), labels.to(self.device)))

    # Generation tasks (SQuAD): the worker drives greedy decoding through the split with eval_next_token, then
    # sends the generated tokens and the gold labels to be scored with eval_generated.
    @wire(args={"act": EVAL, "keep": EVAL}, result={"token": EVAL})
    def eval_next_token(
        self, act: Activation, cache: Hashable | None = None, keep: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The greedy next token (B,) of each row of an evaluation activation; the head runs at one position a row.

        Without ``cache`` the activation holds whole sequences. With ``cache`` (the worker's id of an evaluation
        batch) f_s reuses past keys and values: a call whose z covers the whole mask (the prompts, (B, T, D)) starts
        that batch's cache, replacing any other; each later call sends only the newest token's z (B, 1, D) and the
        mask extended by one column, after the rows of the previous call not in ``keep`` were dropped (the worker
        drops the same rows from its own cache).
        """
        mask, length = act["attention_mask"].to(self.device), act["z"].shape[1]
        kv = None if cache is None else self._kv(cache, act["z"].shape[0], length, mask.shape[1], keep)
        out = self._forward({**act, **self.task.next_token_inputs(mask, length)}, kv)  # (B, V)
        return {"token": self.task.next_token(out, mask).cpu()}

    def _kv(self, key: Hashable, rows: int, length: int, columns: int, keep: Tensor | None) -> Any:
        """The cache an eval_next_token call continues (or starts, for prompts), checked against what it holds."""
        if length == columns:  # prompts: a new batch
            self._cache = _EvalCache(key, self.model.new_cache(), rows)
        held = self._cache
        if held is None or held.key != key:
            raise ProtocolError(f"evaluation batch {key!r}: a decoding step without its prompts (the server holds "
                                f"the cache of {None if held is None else held.key!r})")  # fmt: skip
        if keep is not None:
            if keep.dim() != 1 or not bool(((keep >= 0) & (keep < held.rows)).all()):
                raise ProtocolError(f"evaluation batch {key!r}: keep {keep.tolist()} is not a list of its rows")
            held.kv.batch_select_indices(keep.to(self.device))
            held.rows = len(keep)
        if rows != held.rows or columns != held.columns + length:
            raise ProtocolError(f"evaluation batch {key!r}: a step of {rows} rows and {columns} positions, the cache "
                                f"holds {held.rows} rows and {held.columns} positions")  # fmt: skip
        held.columns = columns
        return held.kv

    @wire(args={"tokens": EVAL, "labels": EVAL})
    def eval_generated(self, tokens: Tensor, labels: Tensor) -> None:
        self._cache = None  # the batch is decoded
        self._add(self.task.generation_stats(tokens, labels))

    def pop_metrics(self) -> dict[str, float]:
        """The task's metrics over what was evaluated since the last call."""
        self._cache = None
        stats, self._stats = self._stats, {}
        return self.task.finalize(stats)
