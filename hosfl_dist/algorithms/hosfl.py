"""HO-SFL (Algorithms 1-3): server backprop + client zeroth-order projection with dimension-free aggregation.

Round t, as the code below runs it (a worker runs the client side for the sampled clients it hosts):
  plan       S_t = the K clients of a seeded draw (``RoundPlan``: server and workers compute the same set), and which
             of them count and deliver (``clients.dropout``, ``clients.over_select``: docs/participation.md); a round
             with fewer uploads than ``server.min_clients`` is skipped: nothing is sent, nothing steps
  sync       each sampled client m receives the round's seeds s^t and the (seeds, v̄) history since its replica's
             round t'_m, and replays it (ClientSync, Algorithm 3). The request is prefetched as soon as round
             t−1's scalars are aggregated and is answered once round t−1 is closed (``after_previous_round``), so
             it is not a round trip on the critical path
  client     z_m = f_c(x_m; θc^t) goes up with y_m                                              (Eq. 1)
  server     the K activations are gathered into one forward/backward with θs^t (one pass per client when the
             server normalises with batch statistics, model.freeze_bn=code|client|none); θs steps once with the mean
             gradient and each client gets λ_m = ∂ℓ_m/∂z_m back (``submit``, gathered; the runtime's compute
             runs the passes on one rank or over the server ranks)                               (Eq. 11)
  client     v_{m,p} = λ_mᵀ(f_c(x_m; θc^t + μu_p) − z_m), p = 1..P; with latency hiding (zo.overlap) the
             P perturbed forwards of each client whose λ_m is still away run once every z_m has gone up  (Eq. 12-13)
             (zo.batch_clients: the worker's clients in one pass, their z in one forward and each seed's z̃ in
             one, each client projecting its own rows)
  aggregate  v̄ = mean over the clients that deliver of their P scalars (:func:`mean_over_clients`), among the
             client workers: P scalars per client up, v̄ down                                   (Eq. 14)
  close      the leader posts v̄ (``finish_round``; nobody waits for it) and the server appends it to the history
  update     every replica that delivered rebuilds ĝ_c = 1/(Pμ) Σ_p v̄_p u_p from the seeds and steps its optimizer
             (Eq. 15-16); a client that dropped stays at its round and catches up later by replay (Algorithm 3)
A round in which no client delivers its scalars (or a skipped one) is a row of NaN in the history: no client step,
on any replica, live or replaying (:func:`apply_update`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms import AlgorithmSpec, register
from hosfl_dist.algorithms.base import EVAL_CLIENT, MethodConfig, ServerBase, WorkerBase
from hosfl_dist.algorithms.rounds import RoundView
from hosfl_dist.algorithms.compute import ServerCompute, Upload
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.optim import TensorwiseOptimizer, lr_at
from hosfl_dist.core.params import slot_tensors, trainable_slots
from hosfl_dist.core.seeding import round_seeds
from hosfl_dist.core.estimators import ZOEstimator, build_estimator
from hosfl_dist.core.zo import NoiseCache, Projector
from hosfl_dist.errors import ConfigError, NonFiniteError, ProtocolError, first_line
from hosfl_dist.models import Activation, SplitModel
from hosfl_dist.models.compiled import CompiledForward
from hosfl_dist.models.precision import client_precision
from hosfl_dist.models.vision import mixes_batch_rows
from hosfl_dist.transport.wire import (
    CONTROL,
    DOWNLINK_GRADIENTS,
    DOWNLINK_SCALARS_SEEDS,
    EVAL,
    UPLINK_ACTIVATIONS,
    UPLINK_SCALARS,
    Exchange,
    wire,
)

SCALARS = Exchange("scalars", up=UPLINK_SCALARS, down=DOWNLINK_SCALARS_SEEDS)
"""The dimension-free aggregation: each sampled client sends its P scalars and receives v̄."""

logger = logging.getLogger(__name__)


def mean_over_clients(rows: Tensor) -> Tensor:
    """v̄_p = (1/K) Σ_m v_{m,p} (Eq. 14): (K, P) -> (P,), summed in float64, returned as the float32 that travels.

    A row of NaN is a client left out of the round (``train.on_nonfinite=skip``): the mean is over the others
    (zeros when none is left).
    """
    kept = rows[torch.isfinite(rows).all(1)]
    return (kept.double().sum(0) / max(len(kept), 1)).float()


def cat_inputs(xs: Sequence[Any]) -> Any:
    """Client batches (tensors, or dicts of tensors) as one, rows in the given order; None where they do not stack
    (a field's shape past the rows differs: text batches trimmed to their longest prompt)."""
    first = xs[0]
    if isinstance(first, dict):
        if any(set(x) != set(first) or any(x[k].shape[1:] != first[k].shape[1:] for k in first) for x in xs):
            return None
        return {k: torch.cat([x[k] for x in xs]) for k in first}
    if any(x.shape[1:] != first.shape[1:] for x in xs):
        return None
    return torch.cat(list(xs))


def rows_of(x: Any) -> int:
    """The rows (samples) of a client batch."""
    return len(next(iter(x.values())) if isinstance(x, dict) else x)


def _take_uploads(t: int, jobs: Sequence[ClientJob]) -> list[dict[str, Any]]:
    """The round's submit calls from the jobs' uploads, which the jobs let go of."""
    uploads = []
    for job in jobs:
        uploads.append({"t": t, "client": job.client, "act": job.upload, "labels": job.labels})
        job.upload = job.labels = None
    return uploads


class SeedScalarHistory:
    """(s_p^τ, v̄_p^τ) for τ = offset..; rows below the oldest replica that may still replay them are dropped.

    Memory is P·12 bytes per round kept; the server trims to min over all clients of their round t'_m, so the
    worst case (a client never sampled) is P·12·T bytes for the whole run, e.g. 5.7 MiB for P=5 and 100k rounds.
    """

    def __init__(self, num_perturbations: int) -> None:
        self.P = num_perturbations
        self.offset = 0
        self.seeds: list[Tensor] = []
        self.scalars: list[Tensor] = []

    @property
    def end(self) -> int:
        return self.offset + len(self.seeds)

    def append(self, round_idx: int, seeds: Tensor, scalars: Tensor) -> None:
        if round_idx != self.end:
            raise RuntimeError(f"history expects round {self.end}, got {round_idx}")
        self.seeds.append(seeds)
        self.scalars.append(scalars)

    def window(self, since: int, until: int) -> tuple[Tensor, Tensor]:
        if since < self.offset:
            raise RuntimeError(f"history was trimmed to round {self.offset}; a replica at round {since} cannot replay")
        lo, hi = since - self.offset, until - self.offset
        if hi <= lo:
            empty = torch.zeros(0, self.P)
            return empty.long(), empty.float()
        return torch.stack(self.seeds[lo:hi]), torch.stack(self.scalars[lo:hi])

    def trim(self, keep_from: int) -> None:
        drop = min(max(0, keep_from - self.offset), len(self.seeds))
        del self.seeds[:drop], self.scalars[:drop]
        self.offset += drop


@dataclass
class Replica:
    """One client's copy of θc (its trainable tensors), its optimizer state and the round it is current at."""

    params: list[nn.Parameter]
    opt: TensorwiseOptimizer
    round: int = 0

    def copy(self) -> Replica:
        params = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in self.params]
        opt = TensorwiseOptimizer(self.opt.cfg, params, self.opt.total_steps)
        opt.load_state_dict(self.opt.state_dict())
        return Replica(params, opt, self.round)

    def digest(self) -> str:
        return tensors_digest([*self.params, *self.opt.state_tensors()])


@dataclass
class ClientJob:
    """One sampled client's part of a round on its worker, from its forward to its projection."""

    client: int
    replica: Replica
    x: Any
    """The client's batch (inputs)."""
    z: Tensor | None
    """z_m in the client's compute dtype (the projection's reference), dropped once projected."""
    labels: Tensor | None = None
    """y_m, until it goes up."""
    upload: Any = None
    """What goes up for z_m (the activation in the server's dtype), until it does."""
    answer: Any = None
    """The server's answer on its way (λ_m)."""
    z_tilde: list[Tensor] | None = None
    """The P perturbed activations, when they ran before λ arrived (latency hiding)."""


def apply_update(
    rep: Replica, seeds: Sequence[int], scalars: Tensor, estimator: ZOEstimator, cache: NoiseCache | None = None
) -> None:
    """θc ← opt(θc, ĝ_c) with ĝ_c = 1/(Pμ) Σ_p v̄_p u_p regenerated group by group (Eq. 15-16: the ``estimator``'s
    coefficients and reconstruction), or taken from the round's ``cache`` of draws where it holds them. A v̄ of NaN
    is a round without a client step (skipped, or no scalars delivered): the replica moves to the next round and its
    optimizer does not step (AdamW would move θc on a zero gradient)."""
    if bool(torch.isnan(scalars).all()):
        rep.round += 1
        return
    estimator.step(rep.opt, rep.params, seeds, estimator.coefficients(scalars), cache)
    rep.round += 1


def replay(rep: Replica, hist_seeds: Tensor, hist_scalars: Tensor, estimator: ZOEstimator) -> None:
    """ClientSync (Algorithm 3): apply missed rounds in order through the same optimizer."""
    for seeds, scalars in zip(hist_seeds.tolist(), hist_scalars):
        apply_update(rep, seeds, scalars, estimator)


# ------------------------------------------------------------------------------------------------------ server
class BackpropServer(ServerBase):
    """HO-SFL's server step: θs trained by backprop on each round's K gathered activations, one step per round with
    the mean gradient (Eq. 11), answering each client λ_m. The forward/backward and the step run through the
    runtime's compute (one rank or a server group); the client side's bookkeeping is :class:`HOSFLServer`'s;
    ``frozen_client`` (:mod:`.frozen_client`) runs this step alone."""

    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        self.opt = compute.optimizer
        self.rounds_done = 0

    @property
    def optimizer(self) -> Any:
        return self.opt

    @wire(
        args={"act": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS},
        result={"lam": DOWNLINK_GRADIENTS},
        gather=True,
        arrives=True,
    )
    def submit(self, t: int, batch: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Round t's (z_m, y_m) of the K sampled clients in (the uploads the round counts); θs steps once with the
        mean gradient over the clients kept, and each client gets {"lam": λ_m} back (Eq. 11).

        A client whose upload or loss is non-finite (``train.on_nonfinite=skip``) is left out of the step and gets
        {"lam": 0, "skip": True}; a non-finite gradient or λ leaves the whole round out of θs's step.
        """
        self.enter_round(t)
        clients, counted = sorted(batch), list(self.round_plan.round(t).counted)
        if clients != counted:
            sampled = self.round_plan.sampled(t)
            raise ProtocolError(f"round {t}: activations from clients {clients}, sampled {sampled}"
                                + ("" if counted == sampled else f", counted {counted}"))  # fmt: skip
        admitted = [m for m in clients if self.admit(t, m, batch[m]["act"], batch[m]["labels"])]
        uploads = {m: Upload(batch[m]["act"], batch[m]["labels"]) for m in admitted}
        counts = {m: max(1.0, float(self.task.sample_counts(uploads[m].labels).sum())) for m in admitted}  # no 0/0
        passes = self.compute.forward_backward(uploads, counts)  # λ_m = ∂ℓ_m/∂z_m; grads Σ_m ∇ℓ_m
        for m in sorted(passes.nonfinite):
            self._finite_loss(t, m, torch.tensor(float("nan")))  # stops, or counts the skip
        losses, lams = passes.losses, passes.lams
        if losses and not passes.finite:  # every client of the round is left out, counted once each
            self.nonfinite(t, "all", "server gradient (the round is left out of θs's step)")
            self._skipped += len(losses) - 1
            losses, lams = {}, {}
        scheduled = self.cfg.server.optim.scheduled  # round t's rate (warmup, then the schedule)
        lr = lr_at(self.cfg.server.optim, t, self.round_plan.rounds) if scheduled else None
        self.compute.step(len(losses), lr)  # θs^{t+1} = θs^t − η · (1/kept) Σ_m ∇ℓ_m
        self.rounds_done += 1
        if losses:
            self.record_loss([losses[m] for m in sorted(losses)])
        zs = {m: batch[m]["act"]["z"] for m in clients}  # λ_m in z_m's dtype; a client left out gets zeros and skip
        return {
            m: {"lam": lams[m].to(zs[m].dtype)} if m in lams else {"lam": torch.zeros_like(zs[m]), "skip": True}
            for m in clients
        }

    def _finite_loss(self, t: int, client: int, loss: Tensor) -> bool:
        return bool(torch.isfinite(loss)) or self.nonfinite(t, client, "loss")


class HOSFLServer(BackpropServer):
    """HO-SFL's server: :class:`BackpropServer`'s step, plus the seeds, the (seeds, v̄) history and each replica's
    round (Algorithms 1 and 3)."""

    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        self.P = cfg.zo.num_perturbations
        self.estimator = build_estimator(cfg.zo)  # the base replica replays as every client's does
        self.history = SeedScalarHistory(self.P)
        # t'_m of Algorithm 1: the round each replica is current at (the evaluation replica included).
        self.client_round = dict.fromkeys([*range(cfg.clients.total), EVAL_CLIENT], 0)
        # θc at the round the history starts from, kept current by replaying each row the server trims: workers
        # rebuild replicas from it after a restart, and the server checks the final replicas against it.
        params = [
            nn.Parameter(p.detach().clone(), requires_grad=False) for p in slot_tensors(trainable_slots(split.client))
        ]
        self.base = Replica(params, TensorwiseOptimizer(cfg.clients.optim, params, self.round_plan.rounds))
        self.pass_skipped()

    def pass_skipped(self) -> None:
        """Append a row of NaN (no client step) for each skipped round from where the history ends: the history then
        reaches the next round that steps, as the endpoint's closed rounds do (:meth:`ServerBase.open_round`)."""
        for t in range(self.history.end, self.open_round(self.history.end)):
            self.history.append(t, self.seeds_of(t), torch.full((self.P,), float("nan")))

    def seeds_of(self, t: int) -> Tensor:
        return torch.tensor(round_seeds(self.cfg.seed, t, self.P), dtype=torch.long)

    def _window(self, t: int, client: int, since: int) -> tuple[Tensor, Tensor]:
        """The history rows a replica at round ``since`` replays to reach round t."""
        if client not in self.client_round:
            raise ProtocolError(f"round {t}: unknown client {client}")
        # A replica may be further than the server counts it (a live round's late client replayed to round t before
        # the gate said it was not counted): θc at a round is the same whoever replayed to it. Never behind it, and
        # never past the round asked for.
        if isinstance(since, bool) or not isinstance(since, int) or not self.client_round[client] <= since <= t:
            raise ProtocolError(
                f"round {t}: client {client} reports its replica at round {since!r}, the server has it at "
                f"{self.client_round[client]} (a replica is at that round or later, up to round {t})"
            )
        return self.history.window(since, t)

    def _trim(self) -> None:
        """Drop the rows no replica still needs, replaying them onto the base replica first."""
        keep_from = min(self.client_round.values())
        if keep_from > self.history.offset:
            replay(self.base, *self.history.window(self.history.offset, keep_from), self.estimator)
            self.history.trim(keep_from)

    @wire(
        args={"since": CONTROL},
        result={
            "seeds": DOWNLINK_SCALARS_SEEDS,
            "hist_seeds": DOWNLINK_SCALARS_SEEDS,
            "hist_scalars": DOWNLINK_SCALARS_SEEDS,
        },
        after_previous_round=True,
    )
    def sync(self, t: int, client: int, since: int) -> dict[str, Tensor]:
        """ClientSync + seed broadcast: the round-t seeds and the history a replica at ``since`` must replay."""
        # a live round's sampled clients catch up before the gate counts the first uploads: a late one has too
        self.check_sampled(t, client, "sync", counted=self.round_plan.participation.live is None)
        hist_seeds, hist_scalars = self._window(t, client, since)  # t'_m moves when the round closes
        return {"seeds": self.seeds_of(t), "hist_seeds": hist_seeds, "hist_scalars": hist_scalars}

    @wire(args={"since": CONTROL}, result={"hist_seeds": EVAL, "hist_scalars": EVAL}, after_previous_round=True)
    def eval_sync(self, t: int, since: int, client: int = EVAL_CLIENT) -> dict[str, Tensor]:
        """History for the evaluation replica, or for the end-of-run check that every replica agrees.

        Counted as evaluation traffic: it is monitoring, not part of training.
        """
        hist_seeds, hist_scalars = self._window(t, client, since)
        self.client_round[client] = t
        self._trim()
        return {"hist_seeds": hist_seeds, "hist_scalars": hist_scalars}

    @wire(args={"scalars": CONTROL}, closes_round=True, aggregates="scalars")
    def finish_round(self, t: int, scalars: Tensor) -> None:
        """Record v̄^t for catch-up; the clients that delivered are now current at t+1 (one that dropped after its
        upload at t, where its sync brought it), and round t is closed with the skipped rounds after it. v̄ is NaN
        when no client delivered its scalars (no client step)."""
        if t != self.history.end or t >= self.rounds_done:
            raise ProtocolError(
                f"finish_round for round {t}: the next round to close is {self.history.end} and the server has run "
                f"{self.rounds_done} round(s)"
            )
        if not isinstance(scalars, Tensor) or tuple(scalars.shape) != (self.P,):
            got = tuple(scalars.shape) if isinstance(scalars, Tensor) else type(scalars).__name__
            raise ProtocolError(f"round {t}: v̄ of shape {got}, expected ({self.P},)")
        p = self.round_plan.round(t)
        if p.delivered and not bool(torch.isfinite(scalars).all()):
            raise NonFiniteError(f"round {t}: the aggregated scalars v̄ are not finite")
        if not p.delivered and not bool(torch.isnan(scalars).all()):
            raise ProtocolError(f"round {t}: v̄ of a round whose clients all dropped must be NaN (no client step)")
        self.history.append(t, self.seeds_of(t), scalars.detach().float().cpu())
        for m in p.counted:
            self.client_round[m] = t + 1 if m in p.delivered else t
        self.pass_skipped()
        self._trim()

    # -- checkpoints and the audit -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        h = self.history
        return {
            **super().state_dict(),
            "history": {"offset": h.offset, "seeds": list(h.seeds), "scalars": list(h.scalars)},
            "client_round": dict(self.client_round),
            "base": {
                "params": [p.detach().clone() for p in self.base.params],
                "opt": self.base.opt.state_dict(),
                "round": self.base.round,
            },  # fmt: skip
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        h = state["history"]
        self.history.offset, self.history.seeds, self.history.scalars = (
            h["offset"],
            list(h["seeds"]),
            list(h["scalars"]),
        )
        self.client_round = dict(state["client_round"])
        _load_replica(self.base, state["base"])

    def resume_payload(self, clients: Sequence[int], leader: bool) -> dict[str, Any]:
        """The base replica, the history after it, and the round of each of ``clients`` (and the evaluation
        replica for the leader): enough to rebuild every replica exactly."""
        ids = [*clients, *([EVAL_CLIENT] if leader else [])]
        seeds, scalars = self.history.window(self.history.offset, self.history.end)
        base = {"params": [p.detach().clone() for p in self.base.params], "opt": self.base.opt.state_dict(),
                "round": self.base.round}  # fmt: skip
        return {
            "base": base,
            "hist_seeds": seeds,
            "hist_scalars": scalars,
            "client_round": {m: self.client_round[m] for m in ids},
        }

    def expected_client_digest(self, t: int) -> str:
        return self._replica_at(t).digest()

    def client_params_at(self, t: int) -> list[Tensor]:
        """The base replica brought to round t by the history (Algorithm 3): every client replica's θc there."""
        return [p.detach() for p in self._replica_at(t).params]

    def _replica_at(self, t: int) -> Replica:
        rep = self.base.copy()
        replay(rep, *self.history.window(rep.round, t), self.estimator)
        return rep


def _load_replica(rep: Replica, state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p, v in zip(rep.params, state["params"], strict=True):
            p.copy_(v)
    rep.opt.load_state_dict(state["opt"])
    rep.round = state["round"]


# ------------------------------------------------------------------------------------------------------ worker
class HOSFLWorker(WorkerBase):
    """A client worker: hosts logical clients, their replicas and data; never back-propagates.

    z and every z̃_p are computed in ``zo.compute_dtype`` (float32 over half-precision stored weights by default, see
    :mod:`hosfl_dist.models.precision`); z goes up in the server's dtype and the float32 z is kept for Eq. 13.
    """

    server_class = HOSFLServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.precision = client_precision(cfg.model, cfg.zo, self.split)  # refuses half precision below the μ floor
        self.P, self.mu = cfg.zo.num_perturbations, cfg.zo.mu
        self.rng_device = cfg.zo.rng_device
        self.estimator = build_estimator(cfg.zo)  # draw, perturb, project, coefficients, reconstruct (zo.estimator)
        if self.device.type == "cuda" and self.rng_device == "cpu" and self.is_leader:
            logger.info("zo.rng_device=cpu with clients on CUDA: every perturbation is drawn on the CPU and copied "
                        "to the GPU (on an H200 the ResNet-18 ZO step took 8.9x its P+1 forwards, 2.6x with "
                        "zo.rng_device=cuda, whose stream differs: all replicas of a run must use one)")  # fmt: skip
        self.perturb_mode = cfg.zo.perturb_mode
        self.perturb_batch = cfg.zo.perturb_batch
        self.batch_clients = cfg.zo.batch_clients
        if self.batch_clients and mixes_batch_rows(self.module):
            raise ConfigError(
                "invalid value for zo.batch_clients: true (f_c normalises with batch statistics: a client's z would "
                "depend on the other clients' rows; use zo.batch_clients=false)"
            )
        self._unbatched_told = False
        self.compiled = None if cfg.zo.compile == "off" else self._compiled_forward(cfg.zo.compile)
        self.K = cfg.clients.per_round
        self.per_client = cfg.clients.replicas == "per_client"
        ids = sorted(self.hosted) + ([EVAL_CLIENT] if self.is_leader else [])
        # t'_m as this worker knows it (the server keeps its own copy and checks that both agree).
        self.client_round = dict.fromkeys(ids, 0)
        if self.per_client:
            self.replicas = {m: self._new_replica() for m in ids}
        else:
            shared = self._new_replica()
            self.replicas = dict.fromkeys(ids, shared)
        self.bind(self.replicas[ids[0]].params if ids else self.fresh_params(requires_grad=False))
        self._overlap_told = False
        self.noise: NoiseCache | None = None
        """The round's draws of u (:class:`~hosfl_dist.core.zo.NoiseCache`), while a round runs."""

    def overlap_round(self, jobs: Sequence[ClientJob]) -> bool:
        """Whether this round's perturbed forwards run before λ arrives (``zo.overlap``; ``auto`` looks at what the
        z̃ of this worker's clients would take: P·Σ|z_m|). The first decision, with its cost, is logged."""
        held = self.P * sum(job.z.numel() * job.z.element_size() for job in jobs)
        on = self.cfg.zo.overlap_on(held)
        if not self._overlap_told and jobs:
            self._overlap_told = True
            setting = self.cfg.zo.overlap
            why = f"zo.overlap_memory_mb={self.cfg.zo.overlap_memory_mb:g}" if setting == "auto" else "set"
            logger.info(f"latency hiding (zo.overlap={str(setting).lower()}): {'on' if on else 'off'}; the P={self.P} "
                        f"z̃ of {len(jobs)} client(s) take {held / 2**20:,.3g} MiB while λ is away ({why})")  # fmt: skip
        return on

    def _new_replica(self) -> Replica:
        params = self.fresh_params(requires_grad=False)  # clients never build an autograd graph
        return Replica(params, TensorwiseOptimizer(self.cfg.clients.optim, params, self.round_plan.rounds))

    # -- Algorithm 2 / 3 -----------------------------------------------------------------------------------------
    def apply_update(self, rep: Replica, seeds: Sequence[int], scalars: Tensor) -> None:
        apply_update(rep, seeds, scalars, self.estimator, self.noise)

    def replay(self, rep: Replica, hist_seeds: Tensor, hist_scalars: Tensor) -> None:
        replay(rep, hist_seeds, hist_scalars, self.estimator)

    def zo_forward(self, x: Any) -> Activation:
        """f_c(x) at the bound θc in the client's compute dtype, without an autograd graph (Eq. 1, 12); compiled
        with ``zo.compile``."""
        with torch.no_grad(), self.precision.computing(self.module, self.slots):
            return self.client_forward(x, self.compiled)

    def _compiled_forward(self, mode: str) -> CompiledForward:
        """``zo.compile``: f_c through ``torch.compile``; refused where the forward would swap weights in hooks."""
        if self.precision.compute is not None:
            raise ConfigError(
                f"invalid value for zo.compile: {mode} (the client upcasts its stored weights to "
                f"{str(self.precision.compute).removeprefix('torch.')} one module at a time in hooks, which a "
                "compiled f_c does not run; use zo.compute_dtype=model or zo.compile=off)"
            )
        return CompiledForward(self.module, mode)

    def perturbed_forward(self, x: Any, seed: int) -> Tensor:
        """z̃_p = f_c(x; θc + μu_p) (Eq. 12), without writing to θc."""
        with self.estimator.perturbed(self.slots, seed, cache=self.noise):
            return self.zo_forward(x)["z"]

    def perturbed_batch(self, x: Any, seeds: Sequence[int]) -> Tensor:
        """The z̃_p of ``seeds`` from one batched forward (``zo.perturb_batch``), (len(seeds), *z.shape); a client
        model that cannot run under ``torch.func.vmap`` is a ConfigError naming the key."""
        try:
            return self.estimator.perturbed_batch(lambda: self.zo_forward(x)["z"], self.slots, seeds, self.noise)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError) as exc:
            why = first_line(exc)
            raise ConfigError(
                f"invalid value for zo.perturb_batch: {self.perturb_batch} (this client's forward cannot run batched "
                f"under torch.func.vmap: {why}; use zo.perturb_batch=1)"
            ) from exc

    def _batches(self, seeds: Sequence[int]) -> list[Sequence[int]]:
        k = self.perturb_batch
        return [seeds[i : i + k] for i in range(0, len(seeds), k)]

    def zo_activations(self, x: Any, seeds: Sequence[int]) -> list[Tensor]:
        """The P perturbed activations at once: latency hiding runs them before λ arrives (§3.4)."""
        if self.perturb_batch == 1:
            return [self.perturbed_forward(x, s) for s in seeds]
        return [zt for batch in self._batches(seeds) for zt in self.perturbed_batch(x, batch).unbind(0)]

    def zo_scalars(self, x: Any, seeds: Sequence[int], proj: Projector, z_tilde: list[Tensor] | None) -> Tensor:
        """v_p for p = 1..P (Eq. 13) as float32, the P scalars that go on the wire.

        With latency hiding the precomputed z̃ are projected; otherwise each perturbed forward is projected as soon
        as it is computed, so one z̃ is alive at a time (the client's peak stays at inference + |λ|), or one batch
        of them with ``zo.perturb_batch`` > 1.
        """
        if z_tilde is not None:
            vals = [proj(zt) for zt in z_tilde]
        elif self.perturb_batch == 1:
            vals = [proj(self.perturbed_forward(x, s)) for s in seeds]
        else:
            vals = []
            for batch in self._batches(seeds):
                z_batch = self.perturbed_batch(x, batch)
                vals += [proj(zt) for zt in z_batch]
                del z_batch  # before the next batch is computed
        return torch.stack(vals).float()

    # -- the round -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def round_noise(self) -> Iterator[None]:
        """Keep the round's draws of u from its first perturbed forward to its update (``zo.noise_cache_mb``): the
        clients of a round perturb with the same P seeds and the update draws them again."""
        self.noise = self.estimator.noise_cache(self.cfg.zo.noise_cache_mb * 2**20)  # None for 0: none kept
        try:
            yield
        finally:
            self.noise = None

    def run_round(self, t: int) -> int:
        view = self.rounds.open(t)
        self.begin(view)
        if view.skipped:  # fewer uploads than server.min_clients: nothing is sent, the server passes the round
            return 0
        with self.round_noise():
            return self._run_round(t, view)

    def _run_round(self, t: int, view: RoundView) -> int:
        mine = list(view.clients)
        # each replica's catch-up and the round's seeds (taken from the previous round's prefetch where it was
        # sent); one not sent ahead leaves now where a stale replica must replay before its forward, else with the
        # uploads below (one message), or just before them where the perturbed forwards need the seeds while λ is
        # away (latency hiding: the uploads' answer comes with λ)
        asks = [{"t": t, "client": m, "since": self.client_round[m]} for m in mine]
        stale = self.per_client and any(self.client_round[m] < t for m in mine)
        syncs = dict(zip(mine, self.server.sync.send_many(asks))) if stale else {}
        jobs: list[ClientJob] = []
        drawn: dict[int, Any] = {}
        for m in mine:  # catch-up and batch
            rep = self.replicas[m]
            if self.per_client and self.client_round[m] < t:  # a stale replica replays the history in the answer
                got = syncs[m].wait()  # before its forward; a current one (shared, or sampled last round) needs no
                self.replay(rep, got["hist_seeds"], got["hist_scalars"])  # answer before its perturbed forwards
            self.client_round[m] = t
            if view.live:  # an upload that arrives too late is not this round's: its batch is put back
                drawn[m] = self.data.state_dict([m])
            x, y = self.data.next_batch(m)
            jobs.append(ClientJob(m, rep, x, None, y))
        # every z_m goes up, in one message, before any perturbed forward runs, so the server's step (which needs
        # the round's K uploads) starts as early as this worker can let it
        batched = self.batch_clients and len(jobs) > 1 and self._forward_together(jobs)
        if not batched:
            self._forward_one_by_one(jobs)
        uploads = _take_uploads(t, jobs)  # (no loop variable here keeps the last job, and its z, alive)
        if not stale and self.overlap_round(jobs):
            syncs = dict(zip(mine, self.server.sync.send_many(asks)))
        with self.server.together():
            if not syncs:
                syncs = dict(zip(mine, self.server.sync.send_many(asks)))
            answers = self.server.submit.send_many(uploads)
        for i, answer in enumerate(answers):
            jobs[i].answer = answer  # (no loop variable keeps a job, and with it its z, alive past its projection)
        del uploads, answers
        # the round's seeds, from answers that came back while the forwards ran
        seeds = {m: syncs[m].wait()["seeds"].tolist() for m in mine}

        rows: dict[int, Tensor] = {}
        if batched:
            self._project_together(t, jobs, seeds, rows, view, drawn)
        else:
            self._project_one_by_one(t, jobs, seeds, rows, view, drawn)
        # live rounds: round t+1's syncs leave with the round's end (one message), where a round t+1 surely follows;
        # a client expected to deliver asks from round t+1 on (if it does not deliver, that sync is refused and the
        # next round asks again)
        ahead = self._live_ahead(t, view, rows)
        with self.server.together():
            closing = self.rounds.close_async(t, SCALARS, rows, mean_over_clients, self.P)
            if ahead:
                self.server.sync.prefetch_many(ahead)
        closed = closing.wait()
        vbar = closed.aggregate if closed.aggregate is not None else torch.full((self.P,), float("nan"))
        delivered = closed.delivered
        for m in mine:
            if m in delivered:
                self.client_round[m] = t + 1  # the update below is applied before the next round starts
        n = closed.samples if closed.samples is not None else len(closed.counted) * self.cfg.clients.batch_size
        self.processed += n  # the samples the server stepped with
        with self.server.together():  # one message: the server closes the round, then answers the syncs at once
            if self.is_leader and not closed.by_server:  # the round's report; nobody waits for its answer
                self.server.finish_round.post(t=t, scalars=vbar)
            if not view.live and self.processed < self.cfg.train.budget_samples:  # round t+1's syncs travel while
                asks = [{"t": t + 1, "client": m, "since": self.client_round[m]} for m in self.rounds.ahead(t + 1)]
                self.server.sync.prefetch_many(asks)  # the update runs
        seeds_t = round_seeds(self.cfg.seed, t, self.P)
        if self.per_client:
            for m in mine:
                if m in delivered:  # a client that dropped does not receive v̄: it replays it when next counted
                    self.apply_update(self.replicas[m], seeds_t, vbar)
        elif self.replicas:
            self.apply_update(next(iter(self.replicas.values())), seeds_t, vbar)  # the shared replica stays current
        return n

    def _live_ahead(self, t: int, view: RoundView, rows: dict[int, Tensor]) -> list[dict[str, Any]]:
        """The syncs of round t+1 a live round sends with its end: none where round t may be the run's last (a sync
        the server answered but nobody took would move its replica's round on the server alone)."""
        most = self.cfg.clients.per_round * self.cfg.clients.batch_size  # what round t can process at the most
        if not view.live or self.processed + most >= self.cfg.train.budget_samples:
            return []
        ahead = [m for m in self.rounds.ahead(t + 1) if m in self.hosted]
        return [{"t": t + 1, "client": m, "since": t + 1 if m in rows else self.client_round[m]} for m in ahead]

    def _forward_one_by_one(self, jobs: Sequence[ClientJob]) -> None:
        """z_m = f_c(x_m; θc^t) client by client (Eq. 1): the upload, and z in the compute dtype for Eq. 13."""
        for job in jobs:
            self.bind(job.replica.params)
            act = self.zo_forward(job.x)
            job.upload = self.precision.upload(act)
            job.z = act["z"]  # in the compute dtype: the projection does not see the upload's rounding
            del act

    def _forward_together(self, jobs: Sequence[ClientJob]) -> bool:
        """The z_m of ``jobs`` from one forward of their concatenated batches (``zo.batch_clients``), split back into
        one upload per client; False (nothing done) where their inputs do not stack or an activation field does not
        have their rows first. Every current replica holds θc^t, so the first one's tensors stand for all."""
        x = cat_inputs([job.x for job in jobs])
        if x is None:
            return self._unbatched("their inputs do not stack")
        sizes = [rows_of(job.x) for job in jobs]
        self.bind(jobs[0].replica.params)
        act = self.zo_forward(x)  # (Σ B_m, ...)
        del x
        if any(v.dim() == 0 or v.shape[0] != sum(sizes) for v in act.values()):
            return self._unbatched(f"an activation field does not have the clients' {sum(sizes)} rows first")
        upload = self.precision.upload(act)
        parts = {k: v.split(sizes) for k, v in upload.items()}
        zs = act["z"].split(sizes)
        for i, job in enumerate(jobs):  # copies: a view would carry the whole batch's storage on the wire
            job.upload = {k: p[i].clone() for k, p in parts.items()}
            job.z = zs[i]
        return True

    def _unbatched(self, why: str) -> bool:
        if not self._unbatched_told:
            self._unbatched_told = True
            logger.info(f"zo.batch_clients: a round runs client by client ({why}); later such rounds are not logged")
        return False

    def _project_one_by_one(self, t: int, jobs: list[ClientJob], seeds: dict[int, list[int]],
                            rows: dict[int, Tensor], view: RoundView, drawn: dict[int, Any]) -> None:  # fmt: skip
        """v_m (Eq. 12-13) into ``rows`` client by client; each job's z and z̃ are freed once projected."""
        if self.overlap_round(jobs):
            # Latency hiding (§3.4): the P perturbed forwards need only θc^t and the seeds, not λ. They run while λ
            # is away and are kept until it arrives; a client whose λ is back already is projected as it goes below
            for job in jobs:
                if not job.answer.done() and view.delivers(job.client):
                    self.bind(job.replica.params)
                    job.z_tilde = self.zo_activations(job.x, seeds[job.client])
        while jobs:
            job = jobs.pop(0)
            m, answer = job.client, job.answer.wait()
            if not self._projects(m, answer, view, drawn):
                del job
                continue
            proj = self.estimator.projector(answer["lam"].to(job.z.device), job.z)
            job.z = None  # only λ and the z̃ being projected stay alive
            self.bind(job.replica.params)
            v = self.zo_scalars(job.x, seeds[m], proj, job.z_tilde)
            del job, proj
            self._record(t, m, v, rows)

    def _projects(self, m: int, answer: dict[str, Any], view: RoundView, drawn: dict[int, Any]) -> bool:
        """Whether client m's scalars are computed: not when the server left its upload out (``skip``), when the plan
        drops it after its upload (its scalars never arrive), or when its upload came too late for a live round
        (``late``: its batch is put back, it is not this round's)."""
        if answer.get("late"):
            self.data.load_state_dict(drawn[m])
            return False
        return not answer.get("skip") and view.delivers(m)

    def _project_together(self, t: int, jobs: list[ClientJob], seeds: dict[int, list[int]],
                          rows: dict[int, Tensor], view: RoundView, drawn: dict[int, Any]) -> None:  # fmt: skip
        """v_m (Eq. 12-13) into ``rows`` with the clients in one pass (``zo.batch_clients``): each perturbed forward
        runs on the concatenated batches of the clients that deliver, and client m projects its rows with λ_m.
        Without latency hiding every λ is awaited first, and one z̃ of Σ B_m rows is alive at a time (one batch of
        them with ``zo.perturb_batch`` > 1); with it, the P z̃ of all of them run while λ is away."""
        shared = seeds[jobs[0].client]
        if any(seeds[job.client] != shared for job in jobs):
            raise ProtocolError(f"round {t}: the clients of one worker got different seeds: {seeds}")
        early = None
        if self.overlap_round(jobs):
            ahead = [job for job in jobs if view.delivers(job.client)]
            if ahead and not all(job.answer.done() for job in ahead):
                self.bind(ahead[0].replica.params)
                early = (self.zo_activations(cat_inputs([job.x for job in ahead]), shared),
                           [rows_of(job.x) for job in ahead], [job.client for job in ahead])  # fmt: skip
        projs: dict[int, Projector] = {}
        kept: list[ClientJob] = []
        while jobs:
            job = jobs.pop(0)
            m, answer = job.client, job.answer.wait()
            if not self._projects(m, answer, view, drawn):  # as client by client: left out of the aggregation
                continue
            projs[m] = self.estimator.projector(answer["lam"].to(job.z.device), job.z)
            job.z = None
            kept.append(job)
        if not kept:
            return
        vals: dict[int, list[Tensor]] = {job.client: [] for job in kept}
        if early is not None:
            z_all, sizes, order = early
            del early
            for zt in z_all:  # (Σ B_m, ...) per seed
                for m, part in zip(order, zt.split(sizes)):
                    if m in projs:
                        vals[m].append(projs[m](part))
            del z_all
        else:
            self.bind(kept[0].replica.params)
            x, sizes = cat_inputs([job.x for job in kept]), [rows_of(job.x) for job in kept]
            for batch in self._batches(shared):
                if self.perturb_batch == 1:
                    z_batch = self.perturbed_forward(x, batch[0]).unsqueeze(0)  # (1, Σ B_m, ...)
                else:
                    z_batch = self.perturbed_batch(x, batch)  # (k, Σ B_m, ...)
                for zt in z_batch:
                    for job, part in zip(kept, zt.split(sizes)):
                        vals[job.client].append(projs[job.client](part))
                del z_batch  # before the next batch is computed
        del projs
        for job in kept:
            self._record(t, job.client, torch.stack(vals[job.client]).float(), rows)

    def _record(self, t: int, m: int, v: Tensor, rows: dict[int, Tensor]) -> None:
        if not bool(torch.isfinite(v).all()) and self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(f"round {t}: non-finite scalars v of client {m} (train.on_nonfinite=stop)")
        rows[m] = v  # a non-finite row is left out of the mean (train.on_nonfinite=skip)

    # -- evaluation and identity ---------------------------------------------------------------------------------
    def _catch_up(self, t: int, client: int) -> None:
        got = self.server.eval_sync(t=t, since=self.client_round[client], client=client)
        if self.per_client:
            self.replay(self.replicas[client], got["hist_seeds"], got["hist_scalars"])
        self.client_round[client] = t

    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        self._catch_up(t, EVAL_CLIENT)
        return self.replicas[EVAL_CLIENT].params

    def sync_all(self, t: int) -> None:
        """Bring every hosted replica to round t through Algorithm 3 (end of run), so digests are comparable."""
        for m in sorted(self.hosted):
            self._catch_up(t, m)

    def sync_all_words(self, t: int) -> str:
        if not self.per_client:
            return f"the shared client replica is at round {t} already (clients.replicas=shared)"
        total, n = self.cfg.clients.total, len(self.hosted)
        which = f"the {n} client replicas" if n == total else \
            f"this worker's {n} client replicas (of {total}: each worker brings its own)"  # fmt: skip
        return f"bringing {which} to round {t} by replaying the history (Algorithm 3)"

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "client_round": dict(self.client_round)}

    def load_state_dict(self, state: dict[str, Any], from_server: dict[str, Any]) -> None:
        """Rebuild every replica from the server's base replica by replaying the history to its client's round."""
        super().load_state_dict(state, from_server)
        self.client_round = dict(state["client_round"])
        if self.client_round != from_server["client_round"]:
            raise ProtocolError(f"resume: this worker's rounds {self.client_round} and the server's "
                                f"{from_server['client_round']} differ")  # fmt: skip
        self.replicas = self._rebuilt(list(self.replicas), from_server)
        first = next(iter(self.replicas.values()), None)
        if first is not None:
            self.bind(first.params)

    def _rebuilt(self, ids: list[int], from_server: dict[str, Any]) -> dict[int, Replica]:
        """The replicas of ``ids`` at their clients' rounds (``self.client_round``), from the server's base replica
        and the history after it (Algorithm 3); one replica for all of them with ``clients.replicas=shared``."""
        base = self._new_replica()
        _load_replica(base, from_server["base"])
        seeds, scalars = from_server["hist_seeds"], from_server["hist_scalars"]
        rebuilt: dict[int, Replica] = {}
        for m in ids:
            # a shared replica is always current: at the round the history ends
            target = self.client_round[m] if self.per_client else base.round + len(seeds)
            if self.per_client or not rebuilt:
                rep = base.copy()
                lo, hi = 0, target - base.round
                replay(rep, seeds[lo:hi], scalars[lo:hi], self.estimator)
            rebuilt[m] = rep
        return rebuilt

    def adopt(self, clients: dict[int, int], from_server: dict[str, Any]) -> None:
        """Serve ``clients`` (a live round's new clients of this worker): their streams moved past the batches they
        drew, their replicas rebuilt at their rounds from the server's base replica and history."""
        super().adopt(clients, from_server)
        new = sorted(clients)
        self.client_round.update({m: from_server["client_round"][m] for m in new})
        if self.per_client:
            self.replicas.update(self._rebuilt(new, from_server))
            return
        shared = next(iter(self.replicas.values()), None)
        if shared is None:  # the first clients of a worker keeping one replica: it is the run's current θc
            shared = self._rebuilt(new[:1], from_server)[new[0]]
        self.replicas.update(dict.fromkeys(new, shared))

    def release(self, clients: Sequence[int]) -> None:
        super().release(clients)
        for m in clients:
            self.replicas.pop(m, None)
            self.client_round.pop(m, None)

    def client_digest(self) -> str | None:
        """SHA-256 of θc and the optimizer state, identical on every up-to-date replica (None: this worker holds no
        replica, e.g. a live round's worker that serves no client at the end)."""
        digests = {r.digest() for r in self.replicas.values()}
        if not digests:
            return None
        if len(digests) != 1:
            raise RuntimeError(f"client replicas of this worker diverged: {sorted(digests)}")
        return digests.pop()


register(
    AlgorithmSpec(
        name="hosfl",
        server=HOSFLServer,
        worker=HOSFLWorker,
        zeroth_order_client=True,
        traffic=frozenset({UPLINK_ACTIVATIONS, UPLINK_SCALARS, DOWNLINK_GRADIENTS, DOWNLINK_SCALARS_SEEDS}),
        skips_nonfinite=True,
        lr_schedules=True,
        batches_perturbations=True,
        batches_clients=True,
        compiles_client=True,
        drops_clients=True,
        zo_estimator=True,
    )
)
