"""The leader client worker's side of evaluation (see :mod:`hosfl_dist.evaluation`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.transport.stub import ServerStub


class Evaluator:
    """Runs the held-out split through the worker's up-to-date θc and the server (leader worker only)."""

    def __init__(self, worker: Any, kv_cache: bool = True) -> None:
        self.worker = worker
        self.server = ServerStub(EvalServer, worker.transport)
        """The evaluation server's calls."""
        self.kv_cache = kv_cache
        """Generation tasks: greedy decoding keeps KV caches on both sides of the split (False: each step re-runs
        the whole sequences, the reference path the generation benchmark times against it)."""

    def evaluate(self, t: int) -> None:
        """Evaluate θc of round t (:meth:`WorkerBase.eval_params`) on every held-out batch."""
        w = self.worker
        w.bind(w.eval_params(t))
        w.module.eval()
        generation = hasattr(w.split.task, "generate")  # generation tasks decode through the split
        with torch.no_grad():
            for i, (x, y) in enumerate(w.data.eval_batches(w.cfg.train.eval_batch_size)):
                if not generation:
                    self.server.eval_batch(act=w.client_forward(x), labels=y)
                else:
                    self.server.eval_generated(tokens=self.generate(x, key=(t, i)), labels=y)
        w.module.train()

    def generate(self, x: dict[str, Tensor], key: Hashable) -> Tensor:
        """Greedy continuations (B, n) of a batch of prompts through f_c and the server (-1 after a row's end).

        With :attr:`kv_cache` and a decoder-LM client, f_c runs each new token only, on a cache this worker keeps for
        the batch, and the server keeps the matching cache of f_s under ``key``.
        """
        w = self.worker
        task = w.split.task
        client = _decoder_client(w.module) if self.kv_cache else None
        if client is None:
            step = lambda act: self.server.eval_next_token(act=act)["token"]  # noqa: E731
            return task.generate(x, w.client_forward, step)
        kv = client.new_cache()

        def cached_step(input_ids: Tensor, attention_mask: Tensor, keep: Tensor | None) -> Tensor:
            if keep is not None:
                kv.batch_select_indices(keep.to(w.device))
            act = client(input_ids.to(w.device), attention_mask.to(w.device), past_key_values=kv)
            return self.server.eval_next_token(act=act, cache=key, keep=keep)["token"]

        return task.generate_cached(x, cached_step)


def _decoder_client(module: nn.Module) -> nn.Module | None:
    """The split decoder LM's f_c inside a client module (None for other models): cached decoding calls it with a
    KV cache, past wrappers such as ZeroOrderClient that only forward the two inputs."""
    from hosfl_dist.models.hf_split import HFClient  # transformers only for LMs

    return next((m for m in module.modules() if isinstance(m, HFClient)), None)
