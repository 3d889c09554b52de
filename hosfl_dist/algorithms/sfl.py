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
adapters on both sides, so only the adapters are exchanged (`fed_common` moves trainable tensors only).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hosfl_dist.algorithms.base import register
from hosfl_dist.algorithms.fed_common import ExchangeServer, ExchangeWorker, bound, detached
from hosfl_dist.comm import DOWNLINK_GRADIENTS, UPLINK_ACTIVATIONS, wire
from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.optim import build_torch_optimizer


class SFLServer(ExchangeServer):
    def new_server_optimizer(self, params: list[nn.Parameter]) -> Any:
        return build_torch_optimizer(self.cfg.server.optim, params)

    @wire(args={"act": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS}, result={"lam": DOWNLINK_GRADIENTS})
    def submit(self, t: int, client: int, act: Activation, labels: Tensor) -> dict[str, Tensor]:
        """One step of client m: backprop on θs_m, step it, and return λ = ∂ℓ_m/∂z."""
        copy = self.copy_for(t, client)
        with self.compute, bound(self.slots, copy.params):
            act = {k: v.to(self.device) for k, v in act.items()}
            z = act["z"].detach().requires_grad_(True)
            loss = self.task.loss(server_forward(self.model, {**act, "z": z}), labels.to(self.device))
            copy.opt.zero_grad(set_to_none=True)
            loss.backward()
            copy.opt.step()
            self.record_loss([loss.item()])
        return {"lam": z.grad.detach()}


class SFLWorker(ExchangeWorker):
    """A client worker whose clients back-propagate through f_c with the server's λ."""

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        opt = build_torch_optimizer(self.cfg.clients.optim, params)
        for _ in range(steps):
            x, y = self.data.next_batch(client)
            act = self.client_forward(x)  # keeps the graph of f_c
            lam = self.transport.call("submit", t=t, client=client, act=detached(act), labels=y)["lam"]
            opt.zero_grad(set_to_none=True)
            act["z"].backward(lam.to(act["z"].device))  # ∂ℓ/∂θc = (∂z/∂θc)ᵀ λ
            opt.step()


def require_lora(split: SplitModel) -> None:
    """SplitLoRA trains LoRA adapters on both sides; anything else is plain SFL and should say so."""
    for side, module in (("client", split.client), ("server", split.server)):
        if not any(p.requires_grad and "lora_" in n for n, p in module.named_parameters()):
            raise ConfigError(
                f"algorithm.name=splitlora needs LoRA adapters on both sides, but the {side} part has none "
                "(model.name=hf with lora.client_targets and lora.server_targets); use algorithm.name=sfl otherwise"
            )


class SplitLoRAServer(SFLServer):
    def __init__(self, cfg: Config, split: SplitModel) -> None:
        require_lora(split)
        super().__init__(cfg, split)


class SplitLoRAWorker(SFLWorker):
    def __init__(self, cfg: Config, split: SplitModel, *args: Any, **kwargs: Any) -> None:
        require_lora(split)
        super().__init__(cfg, split, *args, **kwargs)


register("sfl", SFLServer, SFLWorker)
register("splitlora", SplitLoRAServer, SplitLoRAWorker)
