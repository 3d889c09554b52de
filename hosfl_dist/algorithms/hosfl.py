"""HO-SFL (Algorithms 1-3): server backprop + client zeroth-order projection with dimension-free aggregation.

Round t, for each sampled client m (a worker runs this for the clients it hosts):
  1. ClientSync: fetch the (seeds, v̄) history since the replica's round and replay it (Algorithm 3);
  2. z_m = f_c(x_m; θc^t), sent with y_m;                                          (Eq. 1)
  3. the server batches the K activations into one forward/backward with θs^t, steps θs once with the mean
     gradient, and returns λ_m = ∂ℓ_m/∂z_m;                                          (Eq. 11)
  4. v_{m,p} = λ_mᵀ(f_c(x_m; θc^t + μu_p) − z_m), p = 1..P                          (Eq. 13)
  5. v̄_p = mean over the K clients (only P scalars per client travel);             (Eq. 14)
  6. every replica rebuilds ĝ_c = 1/(Pμ) Σ_p v̄_p u_p from the seeds and steps its optimizer. (Eq. 15-16)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.futures import Future

from hosfl_dist.algorithms.base import EVAL_CLIENT, Replica, RoundBatch, ServerBase, WorkerBase, register
from hosfl_dist.comm import (
    CONTROL,
    DOWNLINK_GRADIENTS,
    DOWNLINK_SCALARS_SEEDS,
    EVAL,
    UPLINK_ACTIVATIONS,
    UPLINK_SCALARS,
    wire,
)
from hosfl_dist.config import Config
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.optim import TensorwiseOptimizer, build_torch_optimizer, tensors_digest
from hosfl_dist.zo import Projector, perturbed, reconstruct, round_seeds, scalar_coefficients


class SeedScalarHistory:
    """(s_p^τ, v̄_p^τ) for τ = offset..; rows below the oldest replica that may still replay them are dropped.

    Memory is P·12 bytes per round kept; the server trims to min over all clients of their round t'_m, so the
    worst case (a client never sampled) is P·12·T bytes for the whole run, e.g. 6 MB for P=5 and 100k rounds.
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


class HOSFLServer(ServerBase):
    def __init__(self, cfg: Config, split: SplitModel) -> None:
        super().__init__(cfg, split)
        self.opt = build_torch_optimizer(cfg.server.optim, self.model.parameters())
        self.P = cfg.zo.num_perturbations
        self.history = SeedScalarHistory(self.P)
        # t'_m of Algorithm 1: the round each replica is current at (the evaluation replica included).
        self.client_round = dict.fromkeys([*range(cfg.clients.total), EVAL_CLIENT], 0)
        self.rounds_done = 0

    def seeds_of(self, t: int) -> Tensor:
        return torch.tensor(round_seeds(self.cfg.job.seed, t, self.P), dtype=torch.long)

    @wire(
        args={"since": CONTROL},
        result={
            "seeds": DOWNLINK_SCALARS_SEEDS,
            "hist_seeds": DOWNLINK_SCALARS_SEEDS,
            "hist_scalars": DOWNLINK_SCALARS_SEEDS,
        },
    )
    def sync(self, t: int, client: int, since: int) -> dict[str, Tensor]:
        """ClientSync + seed broadcast: the round-t seeds and the history a replica at ``since`` must replay."""
        hist_seeds, hist_scalars = self.history.window(since, t)
        with self.lock:
            self.client_round[client] = t
        return {"seeds": self.seeds_of(t), "hist_seeds": hist_seeds, "hist_scalars": hist_scalars}

    @wire(args={"since": CONTROL}, result={"hist_seeds": EVAL, "hist_scalars": EVAL})
    def eval_sync(self, t: int, since: int, client: int = EVAL_CLIENT) -> dict[str, Tensor]:
        """History for the evaluation replica, or for the end-of-run check that every replica agrees.

        Counted as evaluation traffic: it is monitoring, not part of training.
        """
        hist_seeds, hist_scalars = self.history.window(since, t)
        with self.lock:
            self.client_round[client] = t
        self._trim()
        return {"hist_seeds": hist_seeds, "hist_scalars": hist_scalars}

    @wire(args={"act": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS}, result={"lam": DOWNLINK_GRADIENTS})
    def submit(self, t: int, client: int, act: Activation, labels: Tensor) -> Future:
        """(z_m, y_m) in; a future of {"lam": λ_m} that completes once round t's K activations are processed."""
        return self._gather(t, client, act, labels, self._forward_backward)

    def _forward_backward(self, t: int, batch: RoundBatch) -> None:
        if t != self.rounds_done:
            raise RuntimeError(f"server received round {t} while at round {self.rounds_done}: rounds must not mix")
        clients = sorted(batch.items)
        acts = [{k: v.to(self.device) for k, v in batch.items[m][0].items()} for m in clients]
        labels = [batch.items[m][1].to(self.device) for m in clients]
        zs = [a["z"].detach().requires_grad_(True) for a in acts]
        self.opt.zero_grad(set_to_none=True)
        losses = []
        if _batchable(acts):  # one forward/backward for the whole round (GPU efficiency), exact for frozen-BN models
            merged = {k: torch.cat([z if k == "z" else a[k] for a, z in zip(acts, zs)]) for k in acts[0]}
            out = server_forward(self.model, merged)
            total = out.new_zeros(())
            start = 0
            for z, y in zip(zs, labels):
                n = z.shape[0]
                loss_m = self.task.loss(out[start : start + n], y)
                total = total + loss_m
                losses.append(loss_m.item())
                start += n
            total.backward()
        else:
            for a, z, y in zip(acts, zs, labels):
                loss_m = self.task.loss(server_forward(self.model, {**a, "z": z}), y)
                loss_m.backward()
                losses.append(loss_m.item())
        k = len(clients)
        for p in self.model.parameters():  # θs^{t+1} = θs^t − η · (1/K) Σ_m g_{s,m}
            if p.grad is not None:
                p.grad.div_(k)
        self.opt.step()
        self.rounds_done += 1
        self.record_loss(losses)
        for m, z in zip(clients, zs):  # λ_m = ∂ℓ_m/∂z_m: the client's own loss, not divided by K
            batch.items[m][2].set_result({"lam": z.grad.detach()})

    @wire(args={"scalars": CONTROL})
    def finish_round(self, t: int, scalars: Tensor, sampled: Tensor) -> None:
        """Record v̄^t for catch-up; the sampled clients are now current at t+1."""
        self.history.append(t, self.seeds_of(t), scalars.detach().float().cpu())
        with self.lock:
            for m in sampled.tolist():
                self.client_round[m] = t + 1
        self._trim()

    def _trim(self) -> None:
        with self.lock:
            self.history.trim(min(self.client_round.values()))


def _batchable(acts: Sequence[Activation]) -> bool:
    first = acts[0]
    return all(a.keys() == first.keys() and all(a[k].shape[1:] == first[k].shape[1:] for k in a) for a in acts)


class HOSFLWorker(WorkerBase):
    """A client worker: hosts logical clients, their replicas and data; never back-propagates."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.P, self.mu = cfg.zo.num_perturbations, cfg.zo.mu
        self.rng_device = cfg.zo.rng_device
        self.perturb_mode = cfg.zo.perturb_mode
        self.K = cfg.clients.per_round
        self.per_client = cfg.clients.replicas == "per_client"
        ids = sorted(self.hosted) + ([EVAL_CLIENT] if self.collective.is_leader else [])
        # t'_m as this worker knows it (the server keeps its own copy for trimming).
        self.client_round = dict.fromkeys(ids, 0)
        if self.per_client:
            self.replicas = {m: self._new_replica() for m in ids}
        else:
            shared = self._new_replica()
            self.replicas = dict.fromkeys(ids, shared)
        self.bind(self.replicas[ids[0]].params if ids else self.fresh_params(requires_grad=False))

    def _new_replica(self) -> Replica:
        params = self.fresh_params(requires_grad=False)  # clients never build an autograd graph
        return Replica(params, TensorwiseOptimizer(self.cfg.clients.optim, params))

    # -- Algorithm 2 / 3 -----------------------------------------------------------------------------------------
    def apply_update(self, rep: Replica, seeds: Sequence[int], scalars: Tensor) -> None:
        """θc ← opt(θc, ĝ_c) with ĝ_c = 1/(Pμ) Σ_p v̄_p u_p regenerated tensor by tensor."""
        coeffs = scalar_coefficients(scalars, self.mu)
        rep.opt.step(rep.params, lambda i, p: reconstruct(p, i, seeds, coeffs, self.rng_device))
        rep.round += 1

    def replay(self, rep: Replica, hist_seeds: Tensor, hist_scalars: Tensor) -> None:
        """ClientSync (Algorithm 3): apply the missed rounds in order through the same optimizer."""
        for seeds, scalars in zip(hist_seeds.tolist(), hist_scalars):
            self.apply_update(rep, seeds, scalars)

    def perturbed_forward(self, x: Any, seed: int) -> Tensor:
        """z̃_p = f_c(x; θc + μu_p) (Eq. 12), without writing to θc and without an autograd graph."""
        with torch.no_grad(), perturbed(self.slots, seed, self.mu, self.rng_device, self.perturb_mode):
            return self.client_forward(x)["z"]

    def zo_activations(self, x: Any, seeds: Sequence[int]) -> list[Tensor]:
        """The P perturbed activations at once: latency hiding runs them before λ arrives (§3.4)."""
        return [self.perturbed_forward(x, s) for s in seeds]

    def zo_scalars(self, x: Any, seeds: Sequence[int], proj: Projector, z_tilde: list[Tensor] | None) -> Tensor:
        """v_p for p = 1..P (Eq. 13) as float32, the P scalars that go on the wire.

        With latency hiding the precomputed z̃ are projected; otherwise each perturbed forward is projected as soon
        as it is computed, so one z̃ is alive at a time (the client's peak stays at inference + |λ|).
        """
        if z_tilde is None:
            vals = [proj(self.perturbed_forward(x, s)) for s in seeds]
        else:
            vals = [proj(zt) for zt in z_tilde]
        return torch.stack(vals).float()

    def run_round(self, t: int) -> int:
        sampled = self.transport.call("plan", t=t)["sampled"]
        mine = [m for m in sampled.tolist() if m in self.hosted]
        jobs = []
        for m in mine:  # Phase 1: sync and forward
            rep = self.replicas[m]
            got = self.transport.call("sync", t=t, client=m, since=self.client_round[m])
            if self.per_client:
                self.replay(rep, got["hist_seeds"], got["hist_scalars"])
            self.client_round[m] = t
            seeds = got["seeds"].tolist()
            x, y = self.data.next_batch(m)
            self.bind(rep.params)
            with torch.no_grad():
                act = self.client_forward(x)
            fut = self.transport.call_async("submit", t=t, client=m, act=act, labels=y)
            z = act["z"]
            del act
            # Latency hiding (§3.4): the P perturbed forwards need only θc^t and the seeds, not λ.
            z_tilde = self.zo_activations(x, seeds) if self.cfg.zo.overlap else None
            jobs.append((m, rep, x, z, fut, z_tilde, seeds))
            del z, z_tilde

        rows = torch.zeros(self.K, self.P, dtype=torch.float32)
        slot = {m: i for i, m in enumerate(sampled.tolist())}
        while jobs:  # Phase 3: scalars, client by client; each job's z and z̃ are freed once projected
            m, rep, x, z, fut, z_tilde, seeds = jobs.pop(0)
            proj = Projector(fut.wait()["lam"].to(z.device), z)
            del z  # only λ and the z̃ being projected stay alive
            self.bind(rep.params)
            v = self.zo_scalars(x, seeds, proj, z_tilde)
            del z_tilde, proj
            rows[slot[m]] = v
            self.meter.add(UPLINK_SCALARS, v.numel() * v.element_size())
        # Phase 4: aggregation. Each row has one contributor and zeros elsewhere, so the sum is exact and the mean
        # below does not depend on how clients are spread over workers.
        rows = self.collective.all_reduce_sum(rows)
        vbar = (rows.double().sum(0) / self.K).float()  # v̄_p (Eq. 14)
        for _ in mine:
            self.meter.add(DOWNLINK_SCALARS_SEEDS, vbar.numel() * vbar.element_size())
        if self.collective.is_leader:
            self.transport.call("finish_round", t=t, scalars=vbar, sampled=sampled)
        seeds_t = round_seeds(self.cfg.job.seed, t, self.P)
        if self.per_client:
            for m in mine:
                self.apply_update(self.replicas[m], seeds_t, vbar)
        elif self.replicas:
            self.apply_update(next(iter(self.replicas.values())), seeds_t, vbar)  # the shared replica stays current
        for m in mine:
            self.client_round[m] = t + 1
        return len(sampled) * self.cfg.clients.batch_size

    # -- evaluation and identity ---------------------------------------------------------------------------------
    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        rep = self.replicas[EVAL_CLIENT]
        got = self.transport.call("eval_sync", t=t, since=self.client_round[EVAL_CLIENT])
        if self.per_client:
            self.replay(rep, got["hist_seeds"], got["hist_scalars"])
        self.client_round[EVAL_CLIENT] = t
        return rep.params

    def sync_all(self, t: int) -> None:
        """Bring every hosted replica to round t through Algorithm 3 (end of run), so digests are comparable."""
        for m in sorted(self.hosted):
            got = self.transport.call("eval_sync", t=t, since=self.client_round[m], client=m)
            if self.per_client:
                self.replay(self.replicas[m], got["hist_seeds"], got["hist_scalars"])
            self.client_round[m] = t

    def client_digest(self) -> str:
        """SHA-256 of θc and the optimizer state, identical on every up-to-date replica."""
        digests = {tensors_digest([*r.params, *r.opt.state_tensors()]) for r in self.replicas.values()}
        if len(digests) != 1:
            raise RuntimeError(f"client replicas of this worker diverged: {sorted(digests)}")
        return digests.pop()


register("hosfl", HOSFLServer, HOSFLWorker)
