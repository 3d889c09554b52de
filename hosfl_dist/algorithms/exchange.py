"""What the baselines share: methods that exchange client models (SFL, SplitLoRA, FSL-SAGE, ZO-SFL, MU-SplitFed).

Unlike HO-SFL, these methods aggregate θc by shipping it. A round t of any of them is:
  plan       S_t, as in HO-SFL (``RoundPlan``), who of it counts (docs/participation.md), and every counted client's
             number of local steps; a skipped round (fewer uploads than ``server.min_clients``) sends nothing
  download   every sampled client m downloads the global θc^t (downlink model; answered once round t−1 is
             closed) — the SplitFed "fed server" role is played by the server object, which keeps θc^t beside θs^t
  train      it trains locally for its steps (E local epochs, or one step for MU-SplitFed), talking to the server
             in the method's own way; the server answers each request at once (clients of one process train one
             after another, so a barrier per step would deadlock)
  upload     it uploads θc_m (uplink model) with its weight n_m (samples processed this round); the K uploads of
             round t are gathered and
  aggregate  θ^{t+1} = θ^t + η_g · Σ_m w_m (θ_m − θ^t), w_m = n_m / Σ_m n_m (:func:`aggregate`), for θc and for
             the per-client server copies θs_m (η_g = 1: FedAvg; MU-SplitFed: its global lr), in client-id order,
             so the result does not depend on arrival order or on how clients are spread over workers; this closes
             round t. θc is averaged over the clients that delivered; a client that dropped after its upload (its
             requests trained its copy θs_m, its θc_m never arrives) is in θs's average, not in θc's: under the
             emulation its worker sends an empty upload in its place, so that the server can tell its round is over

Only trainable tensors (``requires_grad``) travel: all of θc for vision models, the LoRA adapters for SplitLoRA.
A server part that normalises with batch statistics (``model.freeze_bn=code|client|none``) gives each copy θs_m its
own running statistics too, averaged with the same weights at the round's end, so they do not depend on the order in
which the clients' requests arrive. A first-order client that trains with batch statistics (``model.freeze_bn=code``,
as the authors' code runs SFL) carries its running statistics with θc: downloaded beside it, uploaded beside θc_m
and averaged with the same weights (``stats``; empty for every other client).

The seeds of ZO-SFL's and MU-SplitFed's perturbations live here too; their two-point steps are the run's estimator's
(``zo.estimator``, :class:`~hosfl_dist.core.estimators.ZOEstimator`: ``pair``, ``pair_coefficient``, ``step``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms.base import MethodConfig, ServerBase, WorkerBase
from hosfl_dist.algorithms.rounds import RoundView
from hosfl_dist.algorithms.compute import ServerCompute
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.params import bound, clone_params, slot_tensors, trainable_slots
from hosfl_dist.core.seeding import Stream, stream_seed
from hosfl_dist.errors import ProtocolError
from hosfl_dist.models import Activation, SplitModel
from hosfl_dist.models.vision import bound_running_stats, running_stat_slots
from hosfl_dist.transport import Pending
from hosfl_dist.transport.wire import DOWNLINK_MODEL, EVAL, UPLINK_MODEL, wire


# -- pure parts ----------------------------------------------------------------------------------------------------
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
    return stream_seed(run_seed, Stream.STEP_PERTURBATION, round_idx, client, step)


def server_seed(seed: int, k: int = 0) -> int:
    """Seed of the server-side part of a perturbation (its own stream, independent of the client's tensors)."""
    return stream_seed(seed, Stream.SERVER_PERTURBATION, k)


def detached(act: Activation) -> Activation:
    return {k: v.detach() for k, v in act.items()}


# -- server --------------------------------------------------------------------------------------------------------
@dataclass
class ServerCopy:
    """θs_m: the server-side model of one client during a round (SplitFed v1), and its local optimizer."""

    params: list[nn.Parameter]
    opt: Any
    stats: list[Tensor] = field(default_factory=list)
    """θs_m's BatchNorm running statistics (batch-statistics BatchNorm only; empty otherwise)."""


class ExchangeServer(ServerBase):
    """Keeps θc^t and θs^t, per-client copies of θs during a round, and aggregates both when a round's K clients
    have uploaded. Subclasses add the per-step request (``submit``) of their method.
    """

    first_order = True
    """Whether per-client server copies need autograd (first-order server) or not (zeroth-order server)."""

    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        self.slots = trainable_slots(self.model)
        # θs^t: the module's own tensors (the slots hold a client's copy while one of its requests runs).
        self.server_model = slot_tensors(self.slots)
        # θs^t's running statistics (model.freeze_bn=code|client|none): each copy updates its own, averaged like θs_m
        self.stat_slots = running_stat_slots(self.model)
        self.server_stats = [mod._buffers[name] for mod, name in self.stat_slots]
        self.global_lr = 1.0
        self.client_model = clone_params(slot_tensors(trainable_slots(split.client)), False, self.device)  # θc^t
        # θc^t's BatchNorm running statistics (a first-order client under model.freeze_bn=code; empty otherwise)
        self.client_stats = [mod._buffers[name].detach().clone() for mod, name in running_stat_slots(split.client)]
        self.copies: dict[int, ServerCopy] = {}
        self.rounds_done = 0
        self._drawn: dict[int, int] = {}
        """Each counted client's batches in the last round aggregated (from its upload's weight)."""

    def check_round(self, t: int) -> None:
        self.enter_round(t)

    def copy_for(self, t: int, client: int) -> ServerCopy:
        """θs_m for round t, created from θs^t at the client's first request of the round."""
        self.check_round(t)
        self.check_sampled(t, client, "a request")
        copy = self.copies.get(client)
        if copy is None:
            params = clone_params(self.server_model, self.first_order)
            stats = [s.detach().clone() for s in self.server_stats]
            copy = self.copies[client] = ServerCopy(params, self.new_server_optimizer(params), stats)
        return copy

    @contextlib.contextmanager
    def bound_copy(self, copy: ServerCopy) -> Iterator[None]:
        """Run a block with θs_m (its tensors and running statistics) in the server module."""
        with bound(self.slots, copy.params), bound_running_stats(self.stat_slots, copy.stats):
            yield

    def new_server_optimizer(self, params: list[nn.Parameter]) -> Any:
        raise NotImplementedError

    # -- model exchange ----------------------------------------------------------------------------------------
    @wire(
        result={"params": DOWNLINK_MODEL, "stats": DOWNLINK_MODEL, "aux": DOWNLINK_MODEL},
        after_previous_round=True,
        arrives=True,
    )
    def download(self, t: int, client: int) -> dict[str, Any]:
        """θc^t (and its running statistics) for a client of round t."""
        self.check_round(t)
        self.check_sampled(t, client, "download")
        return self.download_payload(t, client)

    def download_payload(self, t: int, client: int) -> dict[str, Any]:
        return {"params": self.client_model_copy(), "stats": self.client_stats_copy()}

    def client_model_copy(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.client_model]

    def client_stats_copy(self) -> list[Tensor]:
        return [s.detach().clone() for s in self.client_stats]

    @wire(args={"params": UPLINK_MODEL, "stats": UPLINK_MODEL}, gather=True, closes_round=True)
    def upload(self, t: int, batch: dict[int, dict[str, Any]]) -> None:
        """θc_m of the round's K clients after their local training (and its running statistics), each with its
        aggregation weight n_m; a client that dropped after its upload sends no model (empty lists)."""
        self.check_round(t)
        round_t, clients = self.round_plan.round(t), sorted(batch)
        if clients != list(round_t.counted):
            sampled, counted = list(round_t.sampled), list(round_t.counted)
            raise ProtocolError(f"round {t}: models from clients {clients}, sampled {sampled}"
                                + ("" if counted == sampled else f", counted {counted}"))  # fmt: skip
        delivered = list(round_t.delivered)
        for m in clients:
            if m not in delivered and (batch[m]["params"] or batch[m]["stats"]):
                raise ProtocolError(f"round {t}: client {m} dropped after its upload but sent a model")
        for m in delivered:
            if not all(bool(torch.isfinite(p).all()) for p in batch[m]["params"]):
                self.nonfinite(t, m, "client model")
            stats = batch[m]["stats"]
            if len(stats) != len(self.client_stats) or any(
                not isinstance(s, Tensor) or s.shape != r.shape for s, r in zip(stats, self.client_stats)
            ):
                raise ProtocolError(f"round {t}: client {m} sent {len(stats)} running statistics, expected "
                                    f"{len(self.client_stats)} of θc's shapes")  # fmt: skip
            if not all(bool(torch.isfinite(s).all()) for s in stats):
                self.nonfinite(t, m, "client running statistics")
        weights = [float(batch[m]["weight"]) for m in clients]
        self._drawn = {m: int(batch[m]["weight"]) // self.cfg.clients.batch_size for m in clients}
        kept = [float(batch[m]["weight"]) for m in delivered]  # θc: over the clients whose model arrived
        with torch.no_grad():
            if delivered:
                new_c = aggregate(self.client_model, [batch[m]["params"] for m in delivered], kept, self.global_lr)
                for p, v in zip(self.client_model, new_c):
                    p.copy_(v)
            if self.client_stats and delivered:  # the running statistics θc_m's batches gave, with the same weights
                new_stats = aggregate(self.client_stats, [batch[m]["stats"] for m in delivered], kept, self.global_lr)
                for s, v in zip(self.client_stats, new_stats):
                    s.copy_(v.to(s.device, s.dtype))
            if self.copies:
                if set(self.copies) != set(clients):
                    raise RuntimeError(f"round {t}: server copies {sorted(self.copies)} != uploads {clients}")
                new_s = aggregate(self.server_model, [self.copies[m].params for m in clients], weights, self.global_lr)
                for p, v in zip(self.server_model, new_s):
                    p.copy_(v)
                if self.stat_slots:  # the same average for the running statistics (their copies' own updates)
                    stats = [self.copies[m].stats for m in clients]
                    for s, v in zip(self.server_stats, aggregate(self.server_stats, stats, weights, self.global_lr)):
                        s.copy_(v)
        self.end_round(t)
        self.copies.clear()
        self.rounds_done = t + 1

    def end_round(self, t: int) -> None:
        """Hook run after a round's aggregation, before the next round may start."""

    def round_samples(self, t: int) -> int:
        """The samples of round t's counted clients' local steps (what their uploads weigh)."""
        return sum(self.batches_used(t).values()) * self.cfg.clients.batch_size

    def batches_used(self, t: int) -> dict[int, int]:
        """Each counted client's local steps in round t (one batch each), as its upload's weight says."""
        if t != self.rounds_done - 1:
            raise ValueError(f"the server knows the batches of round {self.rounds_done - 1}, not of round {t}")
        return dict(self._drawn)

    def forget(self, t: int, clients: list[int]) -> None:
        """Their copies θs_m are not averaged: the round goes on as if they had not uploaded."""
        for m in clients:
            self.copies.pop(m, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "client_model": [p.detach().clone() for p in self.client_model],
            "client_stats": self.client_stats_copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for p, v in zip(self.client_model, state["client_model"], strict=True):
                p.copy_(v)
            for s, v in zip(self.client_stats, state.get("client_stats", []), strict=True):
                s.copy_(v)

    def expected_client_digest(self, t: int) -> str:
        return tensors_digest([*self.client_model, *self.client_stats])  # what every worker fetched at the end

    def client_params_at(self, t: int) -> list[Tensor]:
        """θc^t, which the server keeps (it aggregates the uploads into it); only the current round's (or a skipped
        round's after it: θc did not change)."""
        if not self.rounds_done <= t <= self.open_round(self.rounds_done):
            raise ValueError(f"the server holds θc of round {self.rounds_done}, not of round {t}")
        return [p.detach() for p in self.client_model]

    def client_stats_at(self, t: int) -> list[Tensor]:
        """θc^t's running statistics (empty unless a first-order client trains them), as :meth:`client_params_at`."""
        self.client_params_at(t)
        return [s.detach() for s in self.client_stats]

    # -- evaluation ---------------------------------------------------------------------------------------------
    @wire(result={"params": EVAL, "stats": EVAL}, after_previous_round=True)
    def eval_model(self, t: int) -> dict[str, Any]:
        """θc^t (and its running statistics) for the evaluation replica or the end-of-run check (monitoring, not
        training traffic)."""
        return {"params": self.client_model_copy(), "stats": self.client_stats_copy()}


# -- worker --------------------------------------------------------------------------------------------------------
class ExchangeWorker(WorkerBase):
    """Runs rounds for the hosted clients: download θc, ``train_client`` (the method), upload θc_m."""

    server_class = ExchangeServer

    first_order = True
    """Whether the client back-propagates (its downloaded θc then needs autograd)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.B = self.cfg.clients.batch_size
        self.final_params: list[Tensor] | None = None
        self.stat_buffers = [mod._buffers[name] for mod, name in running_stat_slots(self.module)]
        """The client module's BatchNorm running statistics (a first-order client under model.freeze_bn=code)."""

    def local_steps(self, client: int) -> int:
        """Client steps in one round: E local epochs over the client's shard (paper: E = 1)."""
        return self.cfg.algorithm.local_epochs * self.data.stream(client).steps_per_epoch()

    def round_steps(self, view: RoundView) -> dict[int, int]:
        """Steps of the round's clients: of every counted client where the round is planned (known to every worker,
        and a round-start barrier), of this worker's own where it is decided live (the server counts the others).

        Each client's steps are capped so that the round does not run past ``train.budget_samples`` by more than
        one batch per client: the last round is shortened evenly over the round's K clients rather than overshooting
        the budget.
        """
        remaining = max(0, self.cfg.train.budget_samples - self.processed)
        cap = max(1, math.ceil(math.ceil(remaining / self.B) / self.cfg.clients.per_round))
        if view.live:
            return {m: min(self.local_steps(m), cap) for m in view.clients}
        counted = list(self.round_plan.round(view.t).counted)
        steps = torch.zeros(len(counted), dtype=torch.int64)
        for i, m in enumerate(counted):
            if m in view.clients:
                steps[i] = min(self.local_steps(m), cap)
        # Workers know only their own clients' shards; the sum over workers gives every worker the same counts, and
        # the collective makes sure no worker starts round t while the leader still evaluates θ^t.
        return dict(zip(counted, self.collective.coordinate(steps).tolist()))

    def run_round(self, t: int) -> int:
        view = self.rounds.open(t)
        self.begin(view)
        if view.skipped:  # fewer uploads than server.min_clients: nothing is sent, the server passes the round
            return 0
        steps = self.round_steps(view)
        uploads: list[Pending] = []
        # a live round counts the first clients to arrive: every client's download leaves at once (one after the
        # other, the first would wait for the others' arrival); a planned round's download one by one
        asked = self.server.download.send_many([{"t": t, "client": m} for m in view.clients]) if view.live else None
        for i, m in enumerate(view.clients):
            got = asked[i].wait() if asked is not None else self.server.download(t=t, client=m)
            if got.get("late"):  # not counted: it draws nothing
                continue
            params = clone_params(got["params"], self.first_order, self.device)
            self.bind(params)
            self.load_stats(got["stats"])  # θc^t's running statistics: this client's batches update them
            self.train_client(t, m, params, steps[m], got)
            weight = steps[m] * self.B
            if view.delivers(m):
                stats = [s.detach().clone() for s in self.stat_buffers]
                uploads.append(self.server.upload.send(t=t, client=m, params=[p.detach() for p in params],
                                                       stats=stats, weight=weight))  # fmt: skip
            else:  # dropped after its upload: θc_m never arrives (the empty upload stands for the server's noticing)
                uploads.append(self.server.upload.send(t=t, client=m, params=[], stats=[], weight=weight))
        for fut in uploads:  # answered once the round's K uploads are aggregated (errors surface here)
            fut.wait()
        closed = self.rounds.close(t)
        n = closed.samples if closed.samples is not None else sum(steps.values()) * self.B
        self.processed += n
        return n

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- evaluation and identity ---------------------------------------------------------------------------------
    def load_stats(self, stats: Sequence[Tensor]) -> None:
        """Copy running statistics into the client module's BatchNorm layers (none: nothing to do)."""
        if len(stats) != len(self.stat_buffers):
            raise ProtocolError(f"the server sent {len(stats)} running statistics, the client part has "
                                f"{len(self.stat_buffers)}")  # fmt: skip
        with torch.no_grad():
            for buf, s in zip(self.stat_buffers, stats):
                buf.copy_(s)

    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        got = self.server.eval_model(t=t)
        self.load_stats(got["stats"])  # evaluation normalises with θc^t's running statistics
        return clone_params(got["params"], False, self.device)

    def sync_all(self, t: int) -> None:
        """Fetch θc^t at the end of the run: every worker digests the same global client model."""
        self.final_params = [*self.eval_params(t), *(s.detach().clone() for s in self.stat_buffers)]

    def sync_all_words(self, t: int) -> str:
        return f"fetching the global client model θc of round {t} (no replicas to bring up to date)"

    def client_digest(self) -> str:
        if self.final_params is None:
            raise RuntimeError("client_digest before sync_all")
        return tensors_digest(self.final_params)
