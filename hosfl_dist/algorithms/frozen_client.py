"""HO-SFL with the client frozen: the server-only reference (``algorithm.name=frozen_client``).

What the zeroth-order client adds to HO-SFL is the difference between HO-SFL and this method: the clients keep θc^0
(the pretrained part, its LoRA adapters as initialised) and only forward; the server trains f_s exactly as HO-SFL's
does. Round t, for the sampled clients a worker hosts:
  plan       S_t, the seeded draw HO-SFL makes (``RoundPlan``), and who of it counts (docs/participation.md): a
             client that drops after its upload has sent all it sends, so it counts like one that delivers
  client     z_m = f_c(x_m; θc^0) goes up with y_m, computed as HO-SFL's z is (no dropout, ``zo.compute_dtype``,
             sent in the server's dtype)                                                          (Eq. 1)
  server     HO-SFL's step (:class:`~hosfl_dist.algorithms.hosfl.BackpropServer`): the K activations gathered into
             one forward/backward with θs^t, θs steps once with the mean gradient; this closes the round  (Eq. 11)
  answer     nothing the client uses: λ is not sent, and a worker waits for the (empty) answers only so that the
             round is stepped before its next one starts and an error on the server reaches it

No perturbed forwards, no scalars, no seeds, no catch-up history: the training traffic is the uplink activations
alone. Each client batch is drawn as HO-SFL draws it, so the server's trajectory (losses, θs, evaluations) is HO-SFL's
with a client learning rate of 0, bit for bit (tests/test_frozen_client.py). A config HO-SFL accepts, this method
accepts, and the other way round: it is registered as a zeroth-order client (the same client forward, the same
checks of ``zo.mu`` against a half-precision client) even though it never perturbs θc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms import AlgorithmSpec, register
from hosfl_dist.algorithms.base import MethodConfig, WorkerBase
from hosfl_dist.algorithms.hosfl import BackpropServer
from hosfl_dist.algorithms.compute import ServerCompute
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.params import slot_tensors, trainable_slots
from hosfl_dist.models import Activation, SplitModel
from hosfl_dist.models.precision import client_precision
from hosfl_dist.transport.wire import UPLINK_ACTIVATIONS, wire


class FrozenClientServer(BackpropServer):
    """HO-SFL's server step, answering nothing; it keeps θc^0 to check the clients' digests and for export."""

    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        self.client_params = [p.detach().clone() for p in slot_tensors(trainable_slots(split.client))]  # θc^0

    @wire(
        args={"act": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS},
        gather=True,
        closes_round=True,
        arrives=True,
    )
    def submit(self, t: int, batch: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Round t's (z_m, y_m) of the K sampled clients: :meth:`BackpropServer.submit`, whose step closes the
        round. No λ: each client gets an empty answer ({"skip": True} if its upload was left out)."""
        full = super().submit(t, batch)
        return {m: {"skip": True} if a.get("skip") else {} for m, a in full.items()}

    def expected_client_digest(self, t: int) -> str:
        return tensors_digest(self.client_params)

    def client_params_at(self, t: int) -> list[Tensor]:
        """θc^0, at every round."""
        return list(self.client_params)


class FrozenClientWorker(WorkerBase):
    """A client worker whose clients forward f_c at θc^0 and send z; nothing comes back that changes them."""

    server_class = FrozenClientServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.precision = client_precision(self.cfg.model, self.cfg.zo, self.split)  # HO-SFL's client forward
        self.params = self.current_params()  # θc^0, the module's own tensors: nothing writes them

    def client_forward_frozen(self, x: Any) -> Activation:
        """z = f_c(x; θc^0) as HO-SFL's client computes it: no autograd graph, in ``zo.compute_dtype``."""
        with torch.no_grad(), self.precision.computing(self.module, self.slots):
            return self.client_forward(x)

    def run_round(self, t: int) -> int:
        view = self.rounds.open(t)  # a client dropped after its upload has done all it does: it counts
        self.begin(view)
        pending, drawn = [], {}
        for m in view.clients:
            if view.live:  # an upload that arrives too late is not this round's: its batch is put back
                drawn[m] = self.data.state_dict([m])
            x, y = self.data.next_batch(m)
            act = self.precision.upload(self.client_forward_frozen(x))
            pending.append((m, self.server.submit.send(t=t, client=m, act=act, labels=y)))
        for m, answer in pending:  # empty, once the round is stepped (a server error surfaces here)
            if answer.wait().get("late"):
                self.data.load_state_dict(drawn[m])
        closed = self.rounds.close(t)
        # none in a skipped round: nothing was sent
        n = closed.samples if closed.samples is not None else len(closed.counted) * self.cfg.clients.batch_size
        self.processed += n
        return n

    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        return self.params

    def sync_all(self, t: int) -> None:
        """Nothing to bring up to date: θc is θc^0 at every round."""

    def sync_all_words(self, t: int) -> str:
        return "nothing to bring up to date (the client part stays at θc^0)"

    def client_digest(self) -> str:
        return tensors_digest(self.params)


register(
    AlgorithmSpec(
        name="frozen_client",
        server=FrozenClientServer,
        worker=FrozenClientWorker,
        zeroth_order_client=True,  # HO-SFL's client part: no dropout, no autograd graph, the same z
        traffic=frozenset({UPLINK_ACTIVATIONS}),
        skips_nonfinite=True,
        lr_schedules=True,
        drops_clients=True,
    )
)
