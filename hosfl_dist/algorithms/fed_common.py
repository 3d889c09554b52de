"""What the baselines share: methods that exchange client models (SFL, SplitLoRA, FSL-SAGE, ZO-SFL, MU-SplitFed).

Unlike HO-SFL, these methods aggregate θc by shipping it. A round t of any of them is:
  1. every sampled client m downloads the global θc^t (downlink model) — the SplitFed "fed server" role is played
     by the server object, which keeps θc^t beside θs^t;
  2. it trains locally for its number of steps (E local epochs, or one step for MU-SplitFed), talking to the server
     in the method's own way; the server answers each request at once (no round barrier: clients train their
     local epochs one after another in one process, so a barrier per step would deadlock);
  3. it uploads θc_m (uplink model) with its weight n_m (samples processed this round);
  4. once the K uploads of round t arrived, the server sets
         θ^{t+1} = θ^t + η_g · Σ_m w_m (θ_m − θ^t),   w_m = n_m / Σ_m n_m,
     for θc and for the per-client server copies θs_m (η_g = 1: FedAvg; MU-SplitFed: its global lr), in client-id
     order, so the result does not depend on arrival order or on how clients are spread over workers.

Only trainable tensors (``requires_grad``) travel: all of θc for vision models, the LoRA adapters for SplitLoRA.

Zeroth-order helpers for ZO-SFL and MU-SplitFed (two-point SPSA with seeded perturbations) live here too.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.futures import Future

from hosfl_dist.algorithms.base import ServerBase, WorkerBase
from hosfl_dist.comm import DOWNLINK_MODEL, EVAL, UPLINK_MODEL, wire
from hosfl_dist.config import Config, ZOConfig
from hosfl_dist.models import Activation, SplitModel
from hosfl_dist.optim import TensorwiseOptimizer, tensors_digest
from hosfl_dist.zo import mix_seed, perturbed, reconstruct, trainable_slots

Slots = Sequence[tuple[nn.Module, str]]
T = TypeVar("T")


# -- pure parts ----------------------------------------------------------------------------------------------------
def bind_slots(slots: Slots, params: Sequence[Tensor]) -> None:
    """Point a module's trainable slots at ``params`` (no copy)."""
    for (mod, name), p in zip(slots, params, strict=True):
        mod._parameters[name] = p


@contextlib.contextmanager
def bound(slots: Slots, params: Sequence[Tensor]) -> Iterator[None]:
    """Run a block with ``params`` in the slots, then put the previous tensors back."""
    saved = [mod._parameters[name] for mod, name in slots]
    bind_slots(slots, params)
    try:
        yield
    finally:
        bind_slots(slots, saved)


def slot_tensors(slots: Slots) -> list[Tensor]:
    return [mod._parameters[name] for mod, name in slots]


def clone_params(
    tensors: Sequence[Tensor], requires_grad: bool, device: torch.device | None = None
) -> list[nn.Parameter]:
    return [nn.Parameter(t.detach().to(device).clone(), requires_grad=requires_grad) for t in tensors]


def aggregate(
    base: Sequence[Tensor], models: Sequence[Sequence[Tensor]], weights: Sequence[float], global_lr: float = 1.0
) -> list[Tensor]:
    """θ + η_g · Σ_m w_m (θ_m − θ) with w_m = weights_m / Σ weights, accumulated in the given order.

    η_g = 1 returns the plain weighted average Σ_m w_m θ_m (FedAvg), computed directly rather than through θ.
    """
    if not models:
        raise ValueError("aggregate needs at least one model")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregation weights must sum to a positive number, got {list(weights)}")
    out = []
    for i, b in enumerate(base):
        avg = torch.zeros_like(b)
        for model, w in zip(models, weights, strict=True):
            avg.add_(model[i].to(b.device), alpha=w / total)
        out.append(avg if global_lr == 1.0 else b + global_lr * (avg - b))
    return out


def step_seed(run_seed: int, round_idx: int, client: int, step: int) -> int:
    """Seed of the perturbation z of one client step (MeZO's seed trick: both sides regenerate z, nobody ships it)."""
    return mix_seed(run_seed, 0x250F, round_idx, client, step)


def server_seed(seed: int, k: int = 0) -> int:
    """Seed of the server-side part of a perturbation (its own stream, independent of the client's tensors)."""
    return mix_seed(seed, 0x5E4, k)


def spsa_pair(slots: Slots, seed: int, mu: float, zo: ZOConfig, fn: Callable[[int], T]) -> tuple[T, T]:
    """(fn(+1) at θ + μz, fn(−1) at θ − μz), z regenerated from ``seed``; θ itself is never written."""
    with torch.no_grad():
        with perturbed(slots, seed, mu, zo.rng_device, zo.perturb_mode):
            plus = fn(+1)
        with perturbed(slots, seed, -mu, zo.rng_device, zo.perturb_mode):
            minus = fn(-1)
    return plus, minus


def zo_step(opt: TensorwiseOptimizer, params: Sequence[Tensor], seed: int, g: float, rng_device: str) -> None:
    """θ ← opt(θ, ĝ) with ĝ = g · z, z regenerated tensor by tensor from ``seed``."""
    opt.step(params, lambda i, p: reconstruct(p, i, [seed], [g], rng_device))


def detached(act: Activation) -> Activation:
    return {k: v.detach() for k, v in act.items()}


# -- server --------------------------------------------------------------------------------------------------------
@dataclass
class ServerCopy:
    """θs_m: the server-side model of one client during a round (SplitFed v1), and its local optimizer."""

    params: list[nn.Parameter]
    opt: Any


class ExchangeServer(ServerBase):
    """Keeps θc^t and θs^t, per-client copies of θs during a round, and aggregates both when a round's K clients
    have uploaded. Subclasses add the per-step request (``submit``) of their method.
    """

    first_order = True
    """Whether per-client server copies need autograd (first-order server) or not (zeroth-order server)."""

    def __init__(self, cfg: Config, split: SplitModel) -> None:
        super().__init__(cfg, split)
        self.compute = threading.RLock()  # one request at a time binds its copy into the server module
        self.slots = trainable_slots(self.model)
        # θs^t: the module's own tensors (the slots hold a client's copy while one of its requests runs).
        self.server_model = slot_tensors(self.slots)
        self.global_lr = 1.0
        self.client_model = clone_params(slot_tensors(trainable_slots(split.client)), False, self.device)  # θc^t
        self.copies: dict[int, ServerCopy] = {}
        self.uploads: dict[int, tuple[list[Tensor], float]] = {}
        self.rounds_done = 0
        self._round_futures: dict[int, Future] = {-1: _done(None)}

    # -- round bookkeeping -------------------------------------------------------------------------------------
    def _round_future(self, r: int) -> Future:
        """Completes once round r is aggregated; rounds long closed (their future dropped) are simply done."""
        with self.lock:
            if r < self.rounds_done and r not in self._round_futures:
                return _done(None)
            return self._round_futures.setdefault(r, Future())

    def after_round(self, r: int, fn: Callable[[], T]) -> Future:
        """A future of ``fn()`` run once round ``r`` has been aggregated (at once if it already was)."""

        out: Future = Future()  # a torch.futures.Future, which transports recognise (Future.then returns a C type)

        def run(f: Future) -> None:
            try:
                f.wait()
                out.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                out.set_exception(exc)

        self._round_future(r).add_done_callback(run)
        return out

    def check_round(self, t: int) -> None:
        if t != self.rounds_done:
            raise RuntimeError(f"server received round {t} while at round {self.rounds_done}: rounds must not mix")

    def copy_for(self, t: int, client: int) -> ServerCopy:
        """θs_m for round t, created from θs^t at the client's first request of the round."""
        with self.lock:
            self.check_round(t)
            copy = self.copies.get(client)
            if copy is None:
                params = clone_params(self.server_model, self.first_order)
                copy = self.copies[client] = ServerCopy(params, self.new_server_optimizer(params))
            return copy

    def new_server_optimizer(self, params: list[nn.Parameter]) -> Any:
        raise NotImplementedError

    # -- model exchange ----------------------------------------------------------------------------------------
    @wire(result={"params": DOWNLINK_MODEL, "aux": DOWNLINK_MODEL})
    def download(self, t: int, client: int) -> Future:
        """θc^t for a client of round t (waits until round t−1 is aggregated)."""
        return self.after_round(t - 1, lambda: self.download_payload(t, client))

    def download_payload(self, t: int, client: int) -> dict[str, Any]:
        return {"params": self.client_model_copy()}

    def client_model_copy(self) -> list[Tensor]:
        with self.compute:
            return [p.detach().clone() for p in self.client_model]

    @wire(args={"params": UPLINK_MODEL})
    def upload(self, t: int, client: int, params: list[Tensor], weight: float) -> None:
        """θc_m after the client's local training, with its aggregation weight n_m; the K-th upload aggregates."""
        with self.lock:
            self.check_round(t)
            if client in self.uploads:
                raise RuntimeError(f"client {client} uploaded twice in round {t}")
            self.uploads[client] = ([p.detach() for p in params], float(weight))
            ready = len(self.uploads) == self.expected_in_round(t)
        if ready:
            with self.compute:
                self._aggregate(t)
            with self.lock:
                fut = self._round_futures.setdefault(t, Future())
                self._round_futures.pop(t - 1, None)
            fut.set_result(None)

    def _aggregate(self, t: int) -> None:
        clients = sorted(self.uploads)
        weights = [self.uploads[m][1] for m in clients]
        new_c = aggregate(self.client_model, [self.uploads[m][0] for m in clients], weights, self.global_lr)
        with torch.no_grad():
            for p, v in zip(self.client_model, new_c):
                p.copy_(v)
            if self.copies:
                if set(self.copies) != set(clients):
                    raise RuntimeError(f"round {t}: server copies {sorted(self.copies)} != uploads {clients}")
                new_s = aggregate(self.server_model, [self.copies[m].params for m in clients], weights, self.global_lr)
                for p, v in zip(self.server_model, new_s):
                    p.copy_(v)
        self.end_round(t)
        with self.lock:
            self.uploads.clear()
            self.copies.clear()
            self.rounds_done = t + 1

    def end_round(self, t: int) -> None:
        """Hook run under the compute lock after a round's aggregation, before the next round may start."""

    # -- evaluation ---------------------------------------------------------------------------------------------
    @wire(result={"params": EVAL})
    def eval_model(self, t: int) -> Future:
        """θc^t for the evaluation replica or the end-of-run check (monitoring, not training traffic)."""
        return self.after_round(t - 1, lambda: {"params": self.client_model_copy()})

    @wire(args={"act": EVAL, "labels": EVAL})
    def eval_batch(self, act: Activation, labels: Tensor) -> None:
        with self.compute:  # never while a request has a client copy bound into the module
            ServerBase.eval_batch(self, act, labels)


# -- worker --------------------------------------------------------------------------------------------------------
class ExchangeWorker(WorkerBase):
    """Runs rounds for the hosted clients: download θc, ``train_client`` (the method), upload θc_m."""

    first_order = True
    """Whether the client back-propagates (its downloaded θc then needs autograd)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.B = self.cfg.clients.batch_size
        self.processed = 0
        self.final_params: list[Tensor] | None = None

    def local_steps(self, client: int) -> int:
        """Client steps in one round: E local epochs over the client's shard (paper: E = 1)."""
        return self.cfg.algorithm.local_epochs * self.data.stream(client).steps_per_epoch()

    def round_steps(self, sampled: list[int], mine: list[int]) -> list[int]:
        """Steps of every sampled client this round, known to every worker (and a round-start barrier).

        Each client's steps are capped so that the round does not run past ``train.budget_samples`` by more than
        one batch per client: the last round is shortened evenly rather than overshooting the budget.
        """
        remaining = max(0, self.cfg.train.budget_samples - self.processed)
        cap = max(1, math.ceil(math.ceil(remaining / self.B) / len(sampled)))
        steps = torch.zeros(len(sampled), dtype=torch.int64)
        for i, m in enumerate(sampled):
            if m in self.hosted:
                steps[i] = min(self.local_steps(m), cap)
        # Workers know only their own clients' shards; the sum over workers gives every worker the same counts, and
        # the collective makes sure no worker starts round t while the leader still evaluates θ^t.
        return self.collective.all_reduce_sum(steps).tolist()

    def run_round(self, t: int) -> int:
        sampled = self.transport.call("plan", t=t)["sampled"].tolist()
        mine = [m for m in sampled if m in self.hosted]
        steps = dict(zip(sampled, self.round_steps(sampled, mine)))
        for m in mine:
            got = self.transport.call("download", t=t, client=m)
            params = clone_params(got["params"], self.first_order, self.device)
            self.bind(params)
            self.train_client(t, m, params, steps[m], got)
            self.transport.call("upload", t=t, client=m, params=[p.detach() for p in params], weight=steps[m] * self.B)
        n = sum(steps.values()) * self.B
        self.processed += n
        return n

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- evaluation and identity ---------------------------------------------------------------------------------
    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        return clone_params(self.transport.call("eval_model", t=t)["params"], False, self.device)

    def sync_all(self, t: int) -> None:
        """Fetch θc^t at the end of the run: every worker digests the same global client model."""
        self.final_params = list(self.eval_params(t))

    def client_digest(self) -> str:
        if self.final_params is None:
            raise RuntimeError("client_digest before sync_all")
        return tensors_digest(self.final_params)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
