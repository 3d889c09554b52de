"""SFL (SplitFed v1, Thapa et al. 2022) and SplitLoRA (Lin et al. 2024): first-order split federated learning.

Round t, for each sampled client m (paper App. B.3: SFLv1, local epochs E = 1):
  1. download θc^t;
  2. for each of its E·⌈n_m/B⌉ steps: z = f_c(x; θc_m) goes up with y; the server runs forward + backprop on its
     own copy θs_m of the server model (SFLv1's parallel server side), steps θs_m and returns λ = ∂ℓ/∂z; the
     client back-propagates λ through f_c and steps θc_m;
  3. upload θc_m; after the K uploads the server sets θc^{t+1} = FedAvg(θc_m), θs^{t+1} = FedAvg(θs_m), weighted
     by the samples each client processed.

Local optimizers (client and server copy) are fresh every round, as in the SplitFed reference code: clients keep
no state between participations. SplitLoRA is the same protocol on a model whose only trainable tensors are LoRA
adapters on both sides, so only the adapters are exchanged (`exchange` moves trainable tensors only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms import AlgorithmSpec, register
from hosfl_dist.algorithms.exchange import ExchangeServer, ExchangeWorker, detached
from hosfl_dist.core.optim import build_torch_optimizer, client_impl
from hosfl_dist.models import Activation, server_forward
from hosfl_dist.transport.wire import DOWNLINK_GRADIENTS, DOWNLINK_MODEL, UPLINK_ACTIVATIONS, UPLINK_MODEL, wire


class SFLServer(ExchangeServer):
    def new_server_optimizer(self, params: list[nn.Parameter]) -> Any:
        return build_torch_optimizer(self.cfg.server.optim, params)

    @wire(args={"act": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS}, result={"lam": DOWNLINK_GRADIENTS})
    def submit(self, t: int, client: int, act: Activation, labels: Tensor) -> dict[str, Tensor]:
        """One step of client m: backprop on θs_m, step it, and return λ = ∂ℓ_m/∂z."""
        copy = self.copy_for(t, client)
        self.admit(t, client, act, labels)  # the baselines stop on a non-finite upload (train.on_nonfinite=stop)
        with self.bound_copy(copy):  # train mode: batch-statistics BatchNorm updates θs_m's statistics once a step
            act = {k: v.to(self.device) for k, v in act.items()}
            z = act["z"].detach().requires_grad_(True)
            loss = self.task.loss(server_forward(self.model, {**act, "z": z}), labels.to(self.device))
            if not bool(torch.isfinite(loss)):
                self.nonfinite(t, client, "loss")
            copy.opt.zero_grad(set_to_none=True)
            loss.backward()
            copy.opt.step()
            self.record_loss([loss.item()])
        return {"lam": z.grad.detach()}


class SFLWorker(ExchangeWorker):
    """A client worker whose clients back-propagate through f_c with the server's λ."""

    server_class = SFLServer

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        opt = build_torch_optimizer(self.cfg.clients.optim, params, client_impl(params))
        for _ in range(steps):
            x, y = self.data.next_batch(client)
            act = self.client_forward(x)  # keeps the graph of f_c
            lam = self.server.submit(t=t, client=client, act=detached(act), labels=y)["lam"]
            opt.zero_grad(set_to_none=True)
            act["z"].backward(lam.to(act["z"].device))  # ∂ℓ/∂θc = (∂z/∂θc)ᵀ λ
            opt.step()


SFL_TRAFFIC = frozenset({UPLINK_ACTIVATIONS, DOWNLINK_GRADIENTS, UPLINK_MODEL, DOWNLINK_MODEL})
register(
    AlgorithmSpec(
        name="sfl",
        server=SFLServer,
        worker=SFLWorker,
        zeroth_order_client=False,
        traffic=SFL_TRAFFIC,
        server_parts=("server", "client"),
        drops_clients=True,
    )
)
register(
    AlgorithmSpec(
        name="splitlora",
        server=SFLServer,
        worker=SFLWorker,
        zeroth_order_client=False,
        traffic=SFL_TRAFFIC,
        server_parts=("server", "client"),
        drops_clients=True,
        families=("hf",),
        needs_lora=True,
    )
)
