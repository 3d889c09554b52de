"""ZO-SFL (paper App. B.3): SplitFed with the two-point SPSA estimator on both sides instead of backprop.

One client step of client m (local epochs E = 1, FedAvg of θc and of the server copies θs_m after each round, as
in SFL): with z = (u, v) ~ N(0, I) regenerated from the step's seed on both sides (MeZO's seed trick),
  client:  z₊ = f_c(x; θc + μu),  z₋ = f_c(x; θc − μu)            — two activation uploads per step
  server:  ℓ± = ℓ(f_s(z±; θs_m ± μv), y),  g = (ℓ₊ − ℓ₋) / (2μ)   — the SPSA projected gradient of the whole model
  both:    θc ← opt(θc, g·u),  θs_m ← opt(θs_m, g·v)              — one float32 scalar g goes down, never λ
Perturbations use the project's seeded, write-free scheme (``zo.perturb_mode``), the exact counterpart of MeZO's
in-place ±μz (same memory: one module's perturbed copy at a time; θ is never modified, so nothing drifts).
The client's forwards run in ``zo.compute_dtype`` and z± go up in the server's dtype. With half-precision weights
that upload rounds z₊ − z₋ whatever the client computed in: at μ = 1e-3 in bfloat16 the relative error of λᵀ(z₊ − z₋)
is of order 1, with float32 forwards or bfloat16 ones (measured in results/scale/zo_precision.md), so a half-precision
run is refused below zo.mu = 1e-2 (``ZOConfig.precision_problem``). HO-SFL's client projects its float32 difference
itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms import AlgorithmSpec, register
from hosfl_dist.algorithms.base import MethodConfig
from hosfl_dist.algorithms.compute import ServerCompute
from hosfl_dist.algorithms.exchange import ExchangeServer, ExchangeWorker, server_seed, step_seed
from hosfl_dist.core.estimators import build_estimator
from hosfl_dist.core.optim import TensorwiseOptimizer
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.models.precision import client_precision
from hosfl_dist.models.vision import running_stat_updates
from hosfl_dist.transport.wire import DOWNLINK_MODEL, DOWNLINK_SCALARS_SEEDS, UPLINK_ACTIVATIONS, UPLINK_MODEL, wire


class ZOSFLServer(ExchangeServer):
    first_order = False

    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        self.estimator = build_estimator(cfg.zo)  # v, the server's slice of z, drawn as the client draws u

    def new_server_optimizer(self, params: list[nn.Parameter]) -> Any:
        return TensorwiseOptimizer(self.cfg.server.optim, params)

    def loss_on(self, act: Activation, labels: Tensor) -> float:
        """ℓ(f_s(z; θs currently bound), y) without a graph; a non-finite loss stops the run."""
        with torch.no_grad():
            out = server_forward(self.model, {k: v.to(self.device) for k, v in act.items()})
            loss = self.task.loss(out, labels.to(self.device)).item()
        if not math.isfinite(loss):
            self.nonfinite(self.rounds_done, "of the round", "loss")
        return loss

    @wire(
        args={"act_plus": UPLINK_ACTIVATIONS, "act_minus": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS},
        result={"g": DOWNLINK_SCALARS_SEEDS},
    )
    def submit(
        self, t: int, client: int, step: int, act_plus: Activation, act_minus: Activation, labels: Tensor
    ) -> dict[str, Tensor]:
        copy = self.copy_for(t, client)
        self.admit(t, client, act_plus, labels)
        self.admit(t, client, act_minus, labels)
        seed = server_seed(step_seed(self.cfg.seed, t, client, step))  # v: the server's slice of z
        est = self.estimator
        # batch-statistics BatchNorm: both probes normalise with their batch; the first alone updates the statistics
        with self.bound_copy(copy), running_stat_updates(self.model, 1):
            lp, lm = est.pair(self.slots, seed, lambda sign: self.loss_on(act_plus if sign > 0 else act_minus, labels))
            g = est.pair_coefficient(lp, lm)  # (ℓ₊ − ℓ₋) / (2μ)
            est.step(copy.opt, copy.params, [seed], [g])  # θs_m ← opt(θs_m, g·v)
            self.record_loss([(lp + lm) / 2])
        return {"g": torch.tensor(g, dtype=torch.float32)}


class ZOSFLWorker(ExchangeWorker):
    """Clients that only run forwards: two perturbed ones per step, then a seeded update with the returned g."""

    server_class = ZOSFLServer

    first_order = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.precision = client_precision(self.cfg.model, self.cfg.zo, self.split, uploads_both=True)  # μ floor
        self.estimator = build_estimator(self.cfg.zo)

    def upload_forward(self, x: Any) -> Activation:
        """f_c(x) at the bound (perturbed) θc, computed in ``zo.compute_dtype``, in the dtype the server accepts."""
        with self.precision.computing(self.module, self.slots):
            return self.precision.upload(self.client_forward(x))

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        est = self.estimator
        opt = TensorwiseOptimizer(self.cfg.clients.optim, params)
        for j in range(steps):
            x, y = self.data.next_batch(client)
            seed = step_seed(self.cfg.seed, t, client, j)
            act_plus, act_minus = est.pair(self.slots, seed, lambda sign, x=x: self.upload_forward(x))
            g = self.server.submit(t=t, client=client, step=j, act_plus=act_plus, act_minus=act_minus, labels=y)["g"]
            del act_plus, act_minus  # sent: the update needs only the scalar
            est.step(opt, params, [seed], [float(g)])  # θc ← opt(θc, g·u)


ZO_SFL_TRAFFIC = frozenset({UPLINK_ACTIVATIONS, DOWNLINK_SCALARS_SEEDS, UPLINK_MODEL, DOWNLINK_MODEL})
register(
    AlgorithmSpec(
        name="zo_sfl",
        server=ZOSFLServer,
        worker=ZOSFLWorker,
        zeroth_order_client=True,
        uploads_perturbed_pair=True,
        traffic=ZO_SFL_TRAFFIC,
        server_parts=("server", "client"),
        drops_clients=True,
        zo_estimator=True,
    )
)
