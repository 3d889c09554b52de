"""The server's forward/backward over one round's uploads: spread over the server ranks and cut into micro-batches.

This module is the math of that step; moving rows and results between server ranks is the runtime's
(:class:`hosfl_dist.runtime.server_step.ServerStep`). A server whose gathered call is declared ``data_parallel``
returns the round's :class:`RoundWork` from that call (checked and admitted uploads); the executor lays the rows out
with :func:`make_shares`, runs each rank's share with :func:`run_share`, merges the results on rank 0
(:func:`merge_results`) and asks the server to settle, step and answer (:class:`SteppedServer`).

A round brings K uploads (z_m, y_m). The objective is Σ_m ℓ_m with ℓ_m the mean loss of client m's batch, so
λ_m = ∂ℓ_m/∂z_m and θs steps with the mean gradient (1/K) Σ_m ∇ℓ_m. Every sample i of client m contributes
``sum_i / C_m`` (its loss sum over the client's count C_m, from :meth:`Task.sample_losses`), so any cut of the rows
into pieces gives the same objective:

- **data parallel** (``server.ranks`` = S > 1): the rows, in client-id order, are split into S contiguous shares of
  about equal tokens; rank 0 scatters each rank its rows, every rank runs its share through its FSDP2 shard of θs
  and the gradient reduce-scatter *sums* the shares (divide factor 1), the λ rows and loss parts are gathered back to
  rank 0, which answers the clients;
- **micro-batches** (``server.micro_batch_tokens``): a share is run in pieces of whole samples, at most that many
  tokens each (rows × sequence length; samples for vision models), gradients accumulating, so the autograd graph
  alive at any moment is one piece's.

Every rank runs the same number of passes (FSDP2's all-gathers and reduce-scatters must line up): a rank with fewer
pieces runs padding passes of one row with weight 0, which add exact zeros. Rows of clients with differently shaped
uploads (text batches trimmed to their own length) are never merged into one pass, nor are the rows of different
clients when the server normalises with batch statistics (``model.freeze_bn=client|none``: each client's batch is
its own pass, as in the authors' loop over the sampled clients). Otherwise, without micro-batches and with one server
rank, the pass is the round's single merged forward/backward, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hosfl_dist.models import Activation, server_forward

Segment = tuple[int, int, int]
"""(client, first row, end row) of one client's upload."""


@dataclass
class Upload:
    act: Activation
    labels: Tensor

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    @property
    def tokens_per_row(self) -> int:
        z = self.act["z"]
        return z.shape[1] if z.dim() == 3 and "attention_mask" in self.act else 1

    @property
    def shape_key(self) -> tuple:
        return tuple((k, tuple(v.shape[1:])) for k, v in sorted(self.act.items()))


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


@dataclass
class RoundWork:
    """One round's work for the server's data-parallel step (rank 0 only): what ``submit`` admitted."""

    t: int
    clients: list[int]
    """Every client of the round, in id order (each gets an answer)."""
    uploads: dict[int, Upload]
    """The uploads that take part in the step."""
    counts: dict[int, float]
    """Client -> its sample count C_m (each sample's loss is divided by it: ℓ_m is the client's mean loss)."""
    per_client: bool = False
    """One pass per client (the server normalises with batch statistics)."""
    zs: dict[int, Tensor] = field(default_factory=dict)
    """Client -> its uploaded z (the shape and dtype of its answer)."""
    lams: dict[int, Tensor] = field(default_factory=dict)
    """Client -> λ_m, once settled (clients left out have none)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Client -> ℓ_m, once settled."""


class SteppedServer(Protocol):
    """What a server with a ``data_parallel`` call offers the step executor besides that call."""

    model: nn.Module
    task: Any
    device: torch.device

    def zero_grad(self) -> None:
        """Before the round's passes (every rank)."""

    def settle(self, work: RoundWork, merged: Merged, grads_finite: bool) -> int:
        """Rank 0, once every rank's share ran: decide who the step is over (non-finite losses and gradients) and
        keep λ and ℓ in ``work``; the number of clients θs steps over (0: no step)."""

    def step(self, t: int, kept: int) -> None:
        """Every rank, with the gradients summed over the kept clients' losses: step θs."""

    def answers(self, work: RoundWork) -> dict[int, Any]:
        """Rank 0: each client's answer."""


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


Merged = tuple[dict[int, Tensor], dict[int, float], set[int]]
"""(λ_m by client, ℓ_m by client, clients with a non-finite loss part)."""


def merge_results(results: Sequence[ShareResult]) -> Merged:
    """Rank 0: λ_m assembled from its row blocks, ℓ_m summed from its parts, and the clients with a non-finite part."""
    blocks: dict[int, list[tuple[int, Tensor]]] = {}
    losses: dict[int, float] = {}
    bad: set[int] = set()
    for res in results:
        for m, row, lam in res.lams:
            blocks.setdefault(m, []).append((row, lam))
        for m, v in res.losses.items():
            losses[m] = losses.get(m, 0.0) + v
        bad.update(res.nonfinite)
    lams = {}
    for m, parts in blocks.items():
        parts.sort(key=lambda p: p[0])
        lams[m] = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
    for m in bad:
        lams.pop(m, None)
        losses.pop(m, None)
    return lams, losses, bad
