"""MU-SplitFed (Liang et al., NeurIPS 2025): zeroth-order SplitFed with unbalanced updates, τ server steps per
client step.

The HO-SFL paper (App. B.3, B.4, Table 5) fixes τ = 2, plain SGD (client lr 0.005, server lr 0.01), a global lr
η_g = 0.3, and, through its traffic table, how the method communicates: per client step three activation uploads,
one scalar down, no gradient down, and the full client model up and down (aggregation every step). What is
implemented, round t (one client step per sampled client, like HO-SFL's rounds):
  1. client m downloads θc^t; draws u from the step seed; uploads z = f_c(x; θc^t) and z± = f_c(x; θc^t ± μu);
  2. the server starts θs_m from θs^t and makes τ two-point zeroth-order steps on the unperturbed z:
         g_k = [ℓ(f_s(z; θs_m + μv_k)) − ℓ(f_s(z; θs_m − μv_k))] / (2μ),   θs_m ← θs_m − η_s g_k v_k,  k = 1..τ;
  3. it then evaluates the client's perturbation with the updated θs_m and returns one scalar
         δ = [ℓ(f_s(z₊; θs_m)) − ℓ(f_s(z₋; θs_m))] / (2μ);
  4. the client steps θc_m = θc^t − η_c δ u and uploads θc_m;
  5. after the K uploads: θ^{t+1} = θ^t + η_g · (1/K) Σ_m (θ_m − θ^t), for θc and θs alike.
Where the paper is silent we chose: the client's scalar uses θs after its τ updates (step 3); the global lr
applies to both sides; the optimizers are those of ``clients.optim`` / ``server.optim`` (configs set plain SGD).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms import AlgorithmSpec, register
from hosfl_dist.algorithms.exchange import server_seed, step_seed
from hosfl_dist.algorithms.zo_sfl import ZO_SFL_TRAFFIC, ZOSFLServer, ZOSFLWorker
from hosfl_dist.algorithms.base import MethodConfig
from hosfl_dist.algorithms.compute import ServerCompute
from hosfl_dist.core.optim import TensorwiseOptimizer
from hosfl_dist.models import Activation, SplitModel
from hosfl_dist.models.vision import running_stat_updates
from hosfl_dist.transport.wire import DOWNLINK_SCALARS_SEEDS, UPLINK_ACTIVATIONS, wire


class MUSplitFedServer(ZOSFLServer):
    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        self.global_lr = cfg.algorithm.global_lr  # η_g
        self.tau = cfg.algorithm.server_steps  # τ

    @wire(
        args={
            "act": UPLINK_ACTIVATIONS,
            "act_plus": UPLINK_ACTIVATIONS,
            "act_minus": UPLINK_ACTIVATIONS,
            "labels": UPLINK_ACTIVATIONS,
        },
        result={"g": DOWNLINK_SCALARS_SEEDS},
    )
    def submit(
        self, t: int, client: int, act: Activation, act_plus: Activation, act_minus: Activation, labels: Tensor
    ) -> dict[str, Tensor]:
        copy = self.copy_for(t, client)
        for a in (act, act_plus, act_minus):
            self.admit(t, client, a, labels)
        seed = step_seed(self.cfg.seed, t, client, 0)
        est = self.estimator
        # batch-statistics BatchNorm: every probe normalises with its batch; the step's first alone updates statistics
        with self.bound_copy(copy), running_stat_updates(self.model, 1):
            for k in range(self.tau):  # the unbalanced updates: τ server steps for this one client step
                sk = server_seed(seed, k)
                lp, lm = est.pair(self.slots, sk, lambda sign: self.loss_on(act, labels))
                est.step(copy.opt, copy.params, [sk], [est.pair_coefficient(lp, lm)])  # θs_m ← θs_m − η_s g_k v_k
                if k == 0:
                    self.record_loss([(lp + lm) / 2])
            delta = est.pair_coefficient(self.loss_on(act_plus, labels), self.loss_on(act_minus, labels))
        return {"g": torch.tensor(delta, dtype=torch.float32)}


class MUSplitFedWorker(ZOSFLWorker):
    """ZO-SFL's client (its forwards' precision included) with MU-SplitFed's step: three uploads, one scalar."""

    server_class = MUSplitFedServer

    def local_steps(self, client: int) -> int:
        return 1  # clients aggregate after every step

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        est = self.estimator
        x, y = self.data.next_batch(client)
        seed = step_seed(self.cfg.seed, t, client, 0)
        with torch.no_grad():
            act = self.upload_forward(x)
        act_plus, act_minus = est.pair(self.slots, seed, lambda sign: self.upload_forward(x))
        delta = self.server.submit(t=t, client=client, act=act, act_plus=act_plus, act_minus=act_minus, labels=y)["g"]
        del act, act_plus, act_minus  # sent: the update needs only the scalar
        est.step(TensorwiseOptimizer(self.cfg.clients.optim, params), params, [seed], [float(delta)])


register(
    AlgorithmSpec(
        name="mu_splitfed",
        server=MUSplitFedServer,
        worker=MUSplitFedWorker,
        zeroth_order_client=True,
        uploads_perturbed_pair=True,
        traffic=ZO_SFL_TRAFFIC,
        server_parts=("server", "client"),
        drops_clients=True,
        zo_estimator=True,
    )
)
