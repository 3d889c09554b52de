"""The server's compute, one runtime component: forward/backward over a round's rows and the step of θs, on one rank
or over a server group of S ranks (``server.ranks``), each holding an FSDP2 shard of θs.

A server (:mod:`hosfl_dist.algorithms`) receives a :class:`GroupCompute` and calls it as straight-line code
(:class:`~hosfl_dist.algorithms.compute.ServerCompute`): check the uploads → :meth:`GroupCompute.forward_backward`
(λ_m and ℓ_m) → decide who the step is over → :meth:`GroupCompute.step` → answer. Every server rank runs the same
server code on the same uploads (rank 0 announces each call to the others: :mod:`hosfl_dist.runtime.server_group`),
so each rank computes the same plan, runs its own share of the rows and takes part in the same collectives.

A round brings K uploads (z_m, y_m). The objective is Σ_m ℓ_m with ℓ_m the mean loss of client m's batch, so
λ_m = ∂ℓ_m/∂z_m and θs steps with the mean gradient (1/K) Σ_m ∇ℓ_m. Every sample i of client m contributes
``sum_i / C_m`` (its loss sum over the client's count C_m, from :meth:`Task.sample_losses`), so any cut of the rows
into pieces gives the same objective:

- **data parallel** (S > 1): the rows, in client-id order, are split into S contiguous shares of about equal tokens;
  every rank runs its share through its FSDP2 shard of θs; the λ rows are gathered to rank 0, which answers the
  clients, and every rank receives the loss parts and the finiteness flags, so all decide alike. FSDP's
  reduce-scatter *averages* the shares' gradients, so :meth:`GroupCompute.step` multiplies them by S to get their
  sum (exact for S a power of two: gloo has no pre-multiplied sum to set a divide factor of 1);
- **micro-batches** (``server.micro_batch_tokens``): a share is run in pieces of whole samples, at most that many
  tokens each (rows × sequence length; samples for vision models), gradients accumulating, so the autograd graph
  alive at any moment is one piece's.

Every rank runs the same number of passes (FSDP2's all-gathers and reduce-scatters must line up): a rank with fewer
pieces runs padding passes of one row with weight 0, which add exact zeros. Rows of clients with differently shaped
uploads (text batches trimmed to their own length) are never merged into one pass, nor are the rows of different
clients when the server normalises with batch statistics (``model.freeze_bn=code|client|none``: each client's batch is
its own pass, as in the authors' loop over the sampled clients). Otherwise, without micro-batches and with one server
rank, the pass is the round's single merged forward/backward.

The gradient contract lives here alone: after :meth:`GroupCompute.forward_backward` each rank's gradients are its
shard of Σ_m ∇ℓ_m (averaged over the ranks by FSDP); :meth:`GroupCompute.step` rescales by S, divides by the number
of clients kept and steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hosfl_dist.algorithms.compute import Passes, Upload
from hosfl_dist.config import ServerConfig
from hosfl_dist.core.optim import build_torch_optimizer, set_lr
from hosfl_dist.models import server_forward
from hosfl_dist.models.vision import uses_batch_stats

Segment = tuple[int, int, int]
"""(client, first row, end row) of one client's upload."""


@dataclass
class Share:
    """What one server rank runs: its pieces (each a list of segments, ``padding`` for a weight-0 pass) and the
    rows they need."""

    pieces: list[list[Segment]]
    padding: list[bool]
    uploads: dict[int, Upload]
    """Client -> the rows of its upload this rank needs (row numbers in ``pieces`` count from the upload's start)."""
    counts: dict[int, float]
    offsets: dict[int, int] = field(default_factory=dict)
    """Client -> the first row of ``uploads[client]`` within the client's whole upload."""


Plan = list[tuple[list[list[Segment]], list[bool]]]


def plan(uploads: dict[int, Upload], ranks: int, micro_batch_tokens: int, per_client: bool = False) -> Plan:
    """Per rank: (pieces, padding flags). Rows in client-id order, contiguous shares of ≈ equal tokens, pieces of at
    most ``micro_batch_tokens`` tokens (0: no limit) that never mix upload shapes — and, when the uploads are not all
    of one shape or ``per_client`` is set (a server whose outputs depend on the batch), never mix clients (one pass
    per client, as the unsplit round does)."""
    clients = sorted(uploads)
    # rows of several clients share a pass only when every upload has one shape and the server's outputs do not
    # depend on which rows share it
    mix_clients = len({uploads[m].shape_key for m in clients}) <= 1 and not per_client
    rows = [(m, r) for m in clients for r in range(uploads[m].rows)]
    tokens = [uploads[m].tokens_per_row for m, _ in rows]
    # shares end at client boundaries when there are at least as many clients as ranks (each λ_m, and the sum of
    # the shares' gradients, then come out as one rank's pass would give them), else at row boundaries
    cuts = [i for i in range(1, len(rows)) if rows[i][0] != rows[i - 1][0]] if len(clients) >= ranks else None
    total = sum(tokens)
    bounds, acc, r = [0], 0, 0
    for k in range(1, ranks):  # the first row of share k: where the cumulative tokens pass k/S of the total
        while r < len(rows) and acc + tokens[r] / 2 <= total * k / ranks:
            acc += tokens[r]
            r += 1
        if cuts is not None:  # the nearest client boundary not before the previous share's end
            r = min((c for c in cuts if c >= bounds[-1] and c > 0), key=lambda c: abs(c - r), default=len(rows))
            acc = sum(tokens[:r])
        bounds.append(r)
    bounds.append(len(rows))
    shares = []
    for k in range(ranks):
        pieces: list[list[Segment]] = []
        current: list[Segment] = []
        used = 0
        for m, i in rows[bounds[k] : bounds[k + 1]]:
            t = uploads[m].tokens_per_row
            last = current[-1] if current else None
            fits = not micro_batch_tokens or used + t <= micro_batch_tokens
            same = last is not None and (uploads[last[0]].shape_key == uploads[m].shape_key)
            merge = same and (mix_clients or last[0] == m)
            if current and (not fits or not merge):
                pieces.append(current)
                current, used = [], 0
                last = None
            if last is not None and last[0] == m and last[2] == i:
                current[-1] = (m, last[1], i + 1)
            else:
                current.append((m, i, i + 1))
            used += t
        if current:
            pieces.append(current)
        shares.append((pieces, [False] * len(pieces)))
    most = max(len(p) for p, _ in shares)
    first = (clients[0], 0, 1) if clients else None
    for pieces, padding in shares:  # equal pass counts on every rank: weight-0 passes of one row
        while len(pieces) < most:
            pieces.append([pieces[0][0][:2] + (pieces[0][0][1] + 1,)] if pieces else [first])
            padding.append(True)
    return shares


def make_shares(
    uploads: dict[int, Upload], counts: dict[int, float], ranks: int, micro_batch_tokens: int, per_client: bool = False
) -> list[Share]:
    """The :func:`plan` with each rank's rows sliced out of the uploads."""
    out = []
    for pieces, padding in plan(uploads, ranks, micro_batch_tokens, per_client):
        lo: dict[int, int] = {}
        hi: dict[int, int] = {}
        for piece in pieces:
            for m, a, b in piece:
                lo[m], hi[m] = min(lo.get(m, a), a), max(hi.get(m, b), b)
        sliced = {
            m: Upload({k: v[lo[m] : hi[m]] for k, v in uploads[m].act.items()}, uploads[m].labels[lo[m] : hi[m]])
            for m in lo
        }
        local = [[(m, a - lo[m], b - lo[m]) for m, a, b in piece] for piece in pieces]
        out.append(Share(local, padding, sliced, counts, dict(lo)))
    return out


@dataclass
class ShareResult:
    lams: list[tuple[int, int, Tensor]]
    """(client, first row within the client's upload, λ rows)."""
    losses: dict[int, float]
    """Client -> the sum of its finite loss parts on this rank (its ℓ_m when all its rows are here)."""
    nonfinite: list[int]
    """Clients with a non-finite loss part on this rank (left out of the backward)."""


def run_share(model: nn.Module, task: Any, share: Share, device: torch.device) -> ShareResult:
    """Forward/backward of one rank's pieces; gradients accumulate in ``model``'s parameters."""
    lams: list[tuple[int, int, Tensor]] = []
    losses: dict[int, float] = {}
    nonfinite: list[int] = []
    server_inputs = getattr(task, "server_inputs", None)
    for piece, padding in zip(share.pieces, share.padding):
        zs, acts, labels = [], [], []
        for m, a, b in piece:
            up = share.uploads[m]
            act = {k: v[a:b].to(device) for k, v in up.act.items()}
            z = act["z"].detach().requires_grad_(True)
            zs.append(z)
            acts.append({**act, "z": z})
            labels.append(up.labels[a:b].to(device))
        merged = acts[0] if len(acts) == 1 else {k: torch.cat([x[k] for x in acts]) for k in acts[0]}
        y = labels[0] if len(labels) == 1 else torch.cat(labels)
        if server_inputs is not None:
            merged = {**merged, **server_inputs(y)}
        out = server_forward(model, merged)
        sums, _ = task.sample_losses(out, y)
        total: Tensor | None = None
        start = 0
        for m, a, b in piece:
            part = sums[start : start + b - a].sum() / share.counts[m]
            start += b - a
            if padding:
                continue
            if not bool(torch.isfinite(part)):
                nonfinite.append(m)
                continue
            total = part if total is None else total + part
            losses[m] = losses.get(m, 0.0) + part.item()
        if total is None:  # a padding pass, or every part non-finite: still a backward, so FSDP's collectives line up
            total = out.sum() * 0.0
        total.backward()
        if not padding:
            for (m, a, _), z in zip(piece, zs):
                if m not in nonfinite:
                    lams.append((m, share.offsets.get(m, 0) + a, z.grad.detach()))
    return ShareResult(lams, losses, nonfinite)


class GroupCompute:
    """The server's compute over ``model`` (f_s, or this rank's FSDP2 shard of it) for ``task``, on one rank
    (``group`` None) or over the server group (see the module docstring). ``server`` is the config's server section
    (θs's optimizer, ``micro_batch_tokens``)."""

    def __init__(self, model: nn.Module, task: Any, server: ServerConfig, group: dist.ProcessGroup | None = None):
        self.model = model
        self.task = task
        self.optim = server.optim
        self.micro_batch_tokens = server.micro_batch_tokens
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1
        self.device = next(model.parameters()).device
        # Batch-statistics BatchNorm (model.freeze_bn=code|client|none): client m's λ_m must come from its own batch's
        # statistics, so each client gets its own pass (running statistics updated K times, in client-id order).
        self.per_client = uses_batch_stats(model)
        self._pending = False

    @cached_property
    def optimizer(self) -> Any:
        """θs's torch optimizer over this rank's parameters (after sharding), built on first use."""
        return build_torch_optimizer(self.optim, self.model.parameters())

    def forward_backward(self, uploads: dict[int, Upload], counts: dict[int, float]) -> Passes:
        """The round's passes over this rank's share of the rows; the same :class:`Passes` on every rank (λ on rank
        0). Gradients of θs afterwards: Σ_m ∇ℓ_m over the clients with a finite loss (averaged over the ranks)."""
        self.optimizer.zero_grad(set_to_none=True)
        shares = make_shares(uploads, counts, self.size, self.micro_batch_tokens, self.per_client)
        result = run_share(self.model, self.task, shares[self.rank], self.device)
        grads_finite = all(bool(torch.isfinite(g).all()) for g in _local_grads(self.model))
        lam_finite: dict[int, bool] = {}
        for m, _, lam in result.lams:
            lam_finite[m] = lam_finite.get(m, True) and bool(torch.isfinite(lam).all())
        found = (result.losses, result.nonfinite, grads_finite, lam_finite)
        if self.group is None:
            everyone, lam_parts = [found], [result.lams]
        else:
            everyone = [None] * self.size
            dist.all_gather_object(everyone, found, group=self.group)
            lam_parts = self._gather([(m, row, lam.cpu()) for m, row, lam in result.lams])
        losses: dict[int, float] = {}
        bad: set[int] = set()
        finite = True
        lam_ok: dict[int, bool] = {}
        for part_losses, part_bad, part_finite, part_lams in everyone:
            for m, v in part_losses.items():
                losses[m] = losses.get(m, 0.0) + v
            bad.update(part_bad)
            finite = finite and part_finite
            for m, ok in part_lams.items():
                lam_ok[m] = lam_ok.get(m, True) and ok
        for m in bad:
            losses.pop(m, None)
        finite = finite and all(ok for m, ok in lam_ok.items() if m not in bad)
        self._pending = True
        return Passes(losses, bad, finite, _assemble(lam_parts, bad))

    def step(self, kept: int, lr: float | None = None) -> None:
        """θs ← opt(θs, (1/kept) Σ_m ∇ℓ_m) at ``lr`` (None: the optimizer's own); ``kept`` = 0: no step."""
        if not self._pending:
            raise RuntimeError("GroupCompute.step without a forward_backward before it")
        self._pending = False
        if not kept:
            return
        if self.size > 1:  # FSDP averaged the ranks' shares: their sum (exact for S a power of two)
            for g in _local_grads(self.model):
                g.mul_(self.size)
        for p in self.model.parameters():  # the mean over the clients kept
            if p.grad is not None:
                p.grad.div_(kept)
        if lr is not None:
            set_lr(self.optimizer, lr)
        self.optimizer.step()

    def _gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order, on rank 0 (an empty list elsewhere)."""
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(item, out, group=self.group, group_dst=0)
        return out or []


def _assemble(parts: list[list[tuple[int, int, Tensor]]], bad: set[int]) -> dict[int, Tensor]:
    """λ_m from its row blocks (each (client, first row, rows)), for the clients not in ``bad``."""
    blocks: dict[int, list[tuple[int, Tensor]]] = {}
    for part in parts:
        for m, row, lam in part:
            blocks.setdefault(m, []).append((row, lam))
    lams = {}
    for m, pieces in blocks.items():
        if m in bad:
            continue
        pieces.sort(key=lambda p: p[0])
        lams[m] = pieces[0][1] if len(pieces) == 1 else torch.cat([p[1] for p in pieces])
    return lams


def _local_grads(model: nn.Module) -> list[Tensor]:
    """This rank's gradients (its FSDP2 shard's local tensors)."""
    out = []
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out
