"""What every algorithm is made of, and the registry that ``algorithm.name`` selects from.

An algorithm is a pair:
- a **server** object (lives on rank 0, or in-process): holds θs, its optimizer and whatever history the method
  needs; its public methods are the only client->server calls, each declared with :func:`hosfl_dist.comm.wire`;
- a **worker** object (a client worker hosting some logical clients): runs a round for its hosted clients through
  a :class:`~hosfl_dist.transport.Transport` (to the server) and a :class:`~hosfl_dist.transport.Collective` (to the
  other client workers). The same worker code runs in the in-process engine and under torchrun.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.futures import Future

from hosfl_dist.comm import CONTROL, EVAL, CommMeter, wire
from hosfl_dist.config import Config
from hosfl_dist.data import FederatedData
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.optim import tensors_digest
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.zo import mix_seed, trainable_slots

EVAL_CLIENT = -1
"""Id of the evaluation replica kept by the leader client worker."""


def sample_clients(seed: int, round_idx: int, total: int, per_round: int) -> list[int]:
    """S_t: K of M clients, uniformly without replacement, sorted (the server's draw, reproducible from the seed)."""
    g = torch.Generator().manual_seed(mix_seed(seed, 0x5A3F, round_idx))
    return sorted(torch.randperm(total, generator=g)[:per_round].tolist())


@dataclass
class RoundBatch:
    """Activations of one round gathered on the server before its single forward/backward."""

    items: dict[int, tuple[Activation, Tensor, Future]] = field(default_factory=dict)


class ServerBase:
    """Parts every server shares: client sampling, the round barrier, evaluation, train-loss bookkeeping."""

    def __init__(self, cfg: Config, split: SplitModel) -> None:
        self.cfg = cfg
        self.model = split.server
        self.task = split.task
        self.device = next(self.model.parameters()).device
        self.lock = threading.Lock()
        self._rounds: dict[int, RoundBatch] = {}
        self._loss_sum = 0.0
        self._loss_count = 0
        self._eval_stats: dict[str, float] = {}

    # -- control -------------------------------------------------------------------------------------------------
    @wire(result={"sampled": CONTROL})
    def plan(self, t: int) -> dict[str, Tensor]:
        c = self.cfg.clients
        return {"sampled": torch.tensor(sample_clients(self.cfg.job.seed, t, c.total, c.per_round), dtype=torch.long)}

    def expected_in_round(self, t: int) -> int:
        return self.cfg.clients.per_round

    # -- the round barrier ---------------------------------------------------------------------------------------
    def _gather(
        self, t: int, client: int, act: Activation, labels: Tensor, run: Callable[[int, RoundBatch], None]
    ) -> Future:
        """Hold a client's activation until all clients of round ``t`` arrived, then ``run`` the round once.

        The round is processed in client-id order whatever the arrival order, so results are order-independent.
        """
        fut: Future = Future()
        with self.lock:
            batch = self._rounds.setdefault(t, RoundBatch())
            if client in batch.items:
                raise RuntimeError(f"client {client} submitted twice in round {t}")
            batch.items[client] = (act, labels, fut)
            ready = len(batch.items) == self.expected_in_round(t)
            if ready:
                del self._rounds[t]
        if ready:
            try:
                run(t, batch)
            except Exception as exc:  # fail every waiting client, not only the last one
                for _, _, f in batch.items.values():
                    if not f.done():
                        f.set_exception(exc)
                raise
        return fut

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
    @wire(args={"act": EVAL, "labels": EVAL})
    def eval_batch(self, act: Activation, labels: Tensor) -> None:
        with torch.no_grad():
            was = self.model.training
            self.model.eval()
            out = server_forward(self.model, {k: v.to(self.device) for k, v in act.items()})
            self.model.train(was)
            for k, v in self.task.eval_stats(out, labels.to(self.device)).items():
                self._eval_stats[k] = self._eval_stats.get(k, 0.0) + v

    # Generation tasks (SQuAD): the worker drives greedy decoding through the split with eval_next_token, then
    # sends the generated tokens and the gold labels to be scored with eval_generated.
    @wire(args={"act": EVAL}, result={"token": EVAL})
    def eval_next_token(self, act: Activation) -> dict[str, Tensor]:
        """The greedy next token (B,) of each row of an evaluation activation."""
        with torch.no_grad():
            was = self.model.training
            self.model.eval()
            act = {k: v.to(self.device) for k, v in act.items()}
            out = server_forward(self.model, act)
            self.model.train(was)
            return {"token": self.task.next_token(out, act["attention_mask"]).cpu()}

    @wire(args={"tokens": EVAL, "labels": EVAL})
    def eval_generated(self, tokens: Tensor, labels: Tensor) -> None:
        for k, v in self.task.generation_stats(tokens, labels).items():
            self._eval_stats[k] = self._eval_stats.get(k, 0.0) + v

    def pop_eval_metrics(self) -> dict[str, float]:
        stats, self._eval_stats = self._eval_stats, {}
        return self.task.finalize(stats)

    def server_digest(self) -> str:
        return tensors_digest(p for p in self.model.parameters())


@dataclass
class Replica:
    """One client's copy of θc (its trainable tensors), its optimizer state and the round it is current at."""

    params: list[nn.Parameter]
    opt: Any
    round: int = 0


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
        self.meter: CommMeter = transport.meter
        self.slots = trainable_slots(self.module)

    def bind(self, params: Sequence[nn.Parameter]) -> None:
        """Point the client module's trainable slots at a replica's tensors (no copy)."""
        for (mod, name), p in zip(self.slots, params):
            mod._parameters[name] = p

    def current_params(self) -> list[nn.Parameter]:
        return [mod._parameters[name] for mod, name in self.slots]

    def fresh_params(self, requires_grad: bool = True) -> list[nn.Parameter]:
        """Copies of the trainable tensors as initialised (every replica starts from the same θc^0)."""
        return [nn.Parameter(p.detach().clone(), requires_grad=requires_grad) for p in self.current_params()]

    def client_forward(self, inputs: Any) -> Activation:
        return self.split.client_forward(_to(inputs, self.device))

    @property
    def device(self) -> torch.device:
        return next(iter(self.module.parameters()), torch.zeros(0)).device

    def evaluate(self, t: int) -> None:
        """Run the held-out split through an up-to-date θc and the server (leader worker only)."""
        params = self.eval_params(t)
        self.bind(params)
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

    def client_digest(self) -> str:
        raise NotImplementedError


def _to(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return inputs.to(device)


ALGORITHM_REGISTRY: dict[str, tuple[type, type]] = {}


def register(name: str, server_cls: type, worker_cls: type) -> None:
    ALGORITHM_REGISTRY[name] = (server_cls, worker_cls)


# algorithm.name -> module that registers it on import.
ALGORITHM_MODULES = {
    "hosfl": "hosfl",
    "sfl": "sfl",
    "splitlora": "sfl",
    "fsl_sage": "fsl_sage",
    "zo_sfl": "zo_sfl",
    "mu_splitfed": "mu_splitfed",
}


def get_algorithm(name: str) -> tuple[type, type]:
    """(server class, worker class) registered under ``name``."""
    if name in ALGORITHM_MODULES and name not in ALGORITHM_REGISTRY:
        importlib.import_module(f"hosfl_dist.algorithms.{ALGORITHM_MODULES[name]}")
    if name not in ALGORITHM_REGISTRY:
        raise KeyError(f"unknown algorithm {name!r}; registered: {sorted(ALGORITHM_REGISTRY)}")
    return ALGORITHM_REGISTRY[name]
