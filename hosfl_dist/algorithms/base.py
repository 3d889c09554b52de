"""What every algorithm is made of: a server and a worker, both state and math only.

- The **server** (rank 0, or in-process) holds θs, its optimizer and whatever history the method needs; its
  methods declared with :func:`~hosfl_dist.transport.wire.wire` are the only client -> server calls. Ordering,
  gathering a round's calls and running one call at a time are the endpoint's job
  (:class:`~hosfl_dist.transport.endpoint.ServerEndpoint`), not the server's.
- The **worker** (a client worker hosting some logical clients) runs a round for its hosted clients through an
  injected :class:`~hosfl_dist.transport.Transport` (to the server) and :class:`~hosfl_dist.transport.Collective`
  (to the other client workers). The same worker code runs in every runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.config import Config
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.params import bind_slots, slot_tensors, trainable_slots
from hosfl_dist.core.seeding import sample_clients
from hosfl_dist.data import FederatedData
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.wire import EVAL, wire

EVAL_CLIENT = -1
"""Id of the evaluation replica kept by the leader client worker."""


def round_plan(cfg: Config, t: int) -> list[int]:
    """S_t: the K clients the server samples for round t. A seeded draw, so the server and every worker compute the
    same set without a message; the server's instructions to the sampled clients (seeds, catch-up) are the traffic."""
    return sample_clients(cfg.job.seed, t, cfg.clients.total, cfg.clients.per_round)


class ServerBase:
    """Parts every server shares: the round's size, evaluation, train-loss bookkeeping."""

    def __init__(self, cfg: Config, split: SplitModel) -> None:
        self.cfg = cfg
        self.model = split.server
        self.task = split.task
        self.device = next(self.model.parameters()).device
        self._loss_sum = 0.0
        self._loss_count = 0
        self._eval_stats: dict[str, float] = {}

    def expected_in_round(self, t: int) -> int:
        """Clients whose gathered calls make up round t."""
        return self.cfg.clients.per_round

    def record_loss(self, losses: Sequence[float]) -> None:
        self._loss_sum += float(sum(losses))
        self._loss_count += len(losses)

    def pop_train_loss(self) -> float | None:
        """Mean client-batch loss since the last call (None if no batch was trained)."""
        if not self._loss_count:
            return None
        out = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = 0.0, 0
        return out

    # -- evaluation ----------------------------------------------------------------------------------------------
    def _eval_forward(self, act: Activation) -> Tensor:
        with torch.no_grad():
            was = self.model.training
            self.model.eval()
            out = server_forward(self.model, {k: v.to(self.device) for k, v in act.items()})
            self.model.train(was)
        return out

    def _add_eval_stats(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self._eval_stats[k] = self._eval_stats.get(k, 0.0) + v

    @wire(args={"act": EVAL, "labels": EVAL})
    def eval_batch(self, act: Activation, labels: Tensor) -> None:
        self._add_eval_stats(self.task.eval_stats(self._eval_forward(act), labels.to(self.device)))

    # Generation tasks (SQuAD): the worker drives greedy decoding through the split with eval_next_token, then
    # sends the generated tokens and the gold labels to be scored with eval_generated.
    @wire(args={"act": EVAL}, result={"token": EVAL})
    def eval_next_token(self, act: Activation) -> dict[str, Tensor]:
        """The greedy next token (B,) of each row of an evaluation activation."""
        out = self._eval_forward(act)
        return {"token": self.task.next_token(out, act["attention_mask"].to(self.device)).cpu()}

    @wire(args={"tokens": EVAL, "labels": EVAL})
    def eval_generated(self, tokens: Tensor, labels: Tensor) -> None:
        self._add_eval_stats(self.task.generation_stats(tokens, labels))

    def pop_eval_metrics(self) -> dict[str, float]:
        stats, self._eval_stats = self._eval_stats, {}
        return self.task.finalize(stats)

    def server_digest(self) -> str:
        return tensors_digest(p for p in self.model.parameters())


class WorkerBase:
    """Parts every client worker shares: hosting logical clients, binding replicas into the client module."""

    def __init__(
        self,
        cfg: Config,
        split: SplitModel,
        data: FederatedData,
        hosted: Sequence[int],
        transport: Transport,
        collective: Collective,
    ) -> None:
        self.cfg = cfg
        self.split = split
        self.module = split.client
        self.data = data
        self.hosted = set(hosted)
        self.transport = transport
        self.collective = collective
        self.slots = trainable_slots(self.module)
        self.processed = 0
        """Samples processed by all clients so far (every worker knows the total)."""

    def plan(self, t: int) -> tuple[list[int], list[int]]:
        """(S_t, the sampled clients this worker hosts)."""
        sampled = round_plan(self.cfg, t)
        return sampled, [m for m in sampled if m in self.hosted]

    def bind(self, params: Sequence[nn.Parameter]) -> None:
        """Point the client module's trainable slots at a replica's tensors (no copy)."""
        bind_slots(self.slots, params)

    def current_params(self) -> list[Tensor]:
        return slot_tensors(self.slots)

    def fresh_params(self, requires_grad: bool = True) -> list[nn.Parameter]:
        """Copies of the trainable tensors as initialised (every replica starts from the same θc^0)."""
        return [nn.Parameter(p.detach().clone(), requires_grad=requires_grad) for p in self.current_params()]

    def client_forward(self, inputs: Any) -> Activation:
        return self.split.client_forward(_to(inputs, self.device))

    @property
    def device(self) -> torch.device:
        return next(iter(self.module.parameters()), torch.zeros(0)).device

    def run_round(self, t: int) -> int:
        """One round for the hosted clients; returns the samples all clients processed in it."""
        raise NotImplementedError

    def evaluate(self, t: int) -> None:
        """Run the held-out split through an up-to-date θc and the server (leader worker only)."""
        self.bind(self.eval_params(t))
        self.module.eval()
        generate = getattr(self.split.task, "generate", None)  # generation tasks decode through the split
        with torch.no_grad():
            for x, y in self.data.eval_batches(self.cfg.train.eval_batch_size):
                if generate is None:
                    self.transport.call("eval_batch", act=self.client_forward(x), labels=y)
                else:
                    step = lambda act: self.transport.call("eval_next_token", act=act)["token"]  # noqa: E731
                    self.transport.call("eval_generated", tokens=generate(x, self.client_forward, step), labels=y)
        self.module.train()

    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        raise NotImplementedError

    def sync_all(self, t: int) -> None:
        """Bring what the worker holds to round t at the end of the run, so that digests are comparable."""
        raise NotImplementedError

    def client_digest(self) -> str:
        raise NotImplementedError


def _to(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return inputs.to(device)
