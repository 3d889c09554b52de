"""FSL-SAGE (Nair et al., ICML 2025): clients train against auxiliary models that estimate the server's gradient.

Round t, for each sampled client m (paper App. B.3: E = 1, server update interval l = 5, alignment interval 1):
  1. download θc^t and, when the server realigned it this round, client m's auxiliary model a_m;
  2. for each local step j: z = f_c(x; θc_m); the client back-propagates the estimate λ̂ = ∂ℓ(a_m(z), y)/∂z through
     f_c and steps θc_m — it never waits for the server. Every l-th step (j = 0, l, 2l, …) it also sends the smashed
     data (z, y) to the server, which sends nothing back;
  3. upload θc_m; after the K uploads the server FedAvgs θc, then updates its single server model θs with each
     smashed batch of the round (in client, step order, so the result does not depend on arrival order) and keeps
     the last ALIGN_MAX_SAMPLES smashed samples of every client as that client's alignment set;
  4. alignment, every ``algorithm.align_interval`` rounds, when client m is next sampled: the server recomputes the
     true λ_i = ∂ℓ_i/∂z_i on m's alignment set with the current θs and fits a_m to them by gradient matching,
     min ‖∂ℓ(a_m(z_i))/∂z_i − λ_i‖² (ALIGN_EPOCHS epochs, batches of ALIGN_BATCH), then sends a_m down.
The auxiliary model (paper, ResNet-18) is the first server-side block followed by a classifier: here a copy of the
server's first block as initialised, global average pooling and a fresh linear layer. Auxiliary models live on the
server per client and only travel down; they are not averaged. The alignment-set size, epochs and batch are those
of the FSL-SAGE reference code; the auxiliary optimizer is ``server.optim``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hosfl_dist.algorithms import AlgorithmSpec, register
from hosfl_dist.algorithms.exchange import ExchangeServer, ExchangeWorker, detached
from hosfl_dist.algorithms.base import MethodConfig
from hosfl_dist.algorithms.compute import ServerCompute
from hosfl_dist.core.optim import build_torch_optimizer, client_impl
from hosfl_dist.core.params import bound, clone_params, slot_tensors, trainable_slots
from hosfl_dist.core.seeding import Stream, generator, stream_seed
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.models.vision import ResNetServer, SmallCNNServer, running_stat_updates
from hosfl_dist.transport import Pending
from hosfl_dist.transport.wire import DOWNLINK_MODEL, UPLINK_ACTIVATIONS, UPLINK_MODEL, wire

ALIGN_MAX_SAMPLES = 1000
"""Smashed samples kept per client for alignment (oldest dropped first)."""
ALIGN_EPOCHS = 5
"""Passes over a client's alignment set per alignment."""
ALIGN_BATCH = 100
"""Samples per alignment step (and per chunk when recomputing the true λ)."""


class AuxModel(nn.Module):
    """a_m(z): the first server-side block, global average pooling, a linear classifier."""

    def __init__(self, block: nn.Module, channels: int, num_classes: int) -> None:
        super().__init__()
        self.block = block
        self.head = nn.Linear(channels, num_classes)

    def forward(self, z: Tensor) -> Tensor:  # (B, C, H, W) -> (B, classes)
        h = self.block(z)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def build_aux(split: SplitModel, seed: int) -> AuxModel:
    """The auxiliary model of a vision split, identical in every process for the same seed."""
    server = split.server
    if isinstance(server, ResNetServer):
        block: nn.Module = server.layers[0]
        num_classes = server.fc.out_features
    elif isinstance(server, SmallCNNServer):
        block = server.blocks[0] if len(server.blocks) else nn.Identity()
        num_classes = server.head.out_features
    else:
        raise ConfigError(
            f"algorithm.name=fsl_sage builds its auxiliary model from a vision split (small_cnn, resnet18), "
            f"not {type(server).__name__}"
        )
    if any(isinstance(m, nn.Linear) for m in block.modules()):  # conv_mlp: z is a vector, nothing to pool
        raise ConfigError("algorithm.name=fsl_sage builds its auxiliary model from a convolutional activation; this "
                          "split's server part begins with a fully connected layer (model.name=conv_mlp): use "
                          "small_cnn or resnet18")  # fmt: skip
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    convs = convs or [m for m in split.client.modules() if isinstance(m, nn.Conv2d)]
    block = copy.deepcopy(block)  # its own weights: the server's first block as it is at this moment (θs^0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, Stream.AUX_INIT))
        aux = AuxModel(block, convs[-1].out_channels, num_classes)
    return aux.to(next(server.parameters()).device)


class FSLSageServer(ExchangeServer):
    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        super().__init__(cfg, split, compute)
        # One server model updated in place by every smashed batch, as in FSL-SAGE (no per-client copies).
        self.opt = build_torch_optimizer(cfg.server.optim, self.model.parameters())
        self.aux = build_aux(split, cfg.seed)
        self.aux_slots = trainable_slots(self.aux)
        self.aux_init = [p.detach().clone() for p in slot_tensors(self.aux_slots)]
        self.aux_models: dict[int, tuple[list[nn.Parameter], Any]] = {}
        self.smashed: dict[tuple[int, int], tuple[Activation, Tensor]] = {}
        self.align_sets: dict[int, tuple[Tensor, Tensor]] = {}
        self._before_align: dict[int, tuple[list[Tensor], dict[str, Any]]] = {}
        """Each client's a_m before this round's alignment (a live round that takes the client out restores it)."""
        self._aligned_first: dict[int, int] = {}

    @wire(args={"act": UPLINK_ACTIVATIONS, "labels": UPLINK_ACTIVATIONS})
    def submit(self, t: int, client: int, step: int, act: Activation, labels: Tensor) -> None:
        """Smashed data (z, y) of client m's step j; kept for the end of the round, nothing is returned."""
        self.check_round(t)
        self.check_sampled(t, client, "smashed data")
        self.admit(t, client, act, labels)
        self.smashed[(client, step)] = ({k: v.detach().to(self.device) for k, v in act.items()}, labels.to(self.device))

    def end_round(self, t: int) -> None:
        self._before_align.clear()
        losses = []
        for (m, _), (act, y) in sorted(self.smashed.items()):
            self.opt.zero_grad(set_to_none=True)
            loss = self.task.loss(server_forward(self.model, act), y)
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
            self._remember(m, act["z"], y)
        self.smashed.clear()
        self.record_loss(losses)

    def resume_payload(self, clients: Sequence[int], leader: bool) -> dict[str, Any]:
        """The auxiliary model a_m each of ``clients`` received last (a live run's clients that move take it along)."""
        kept = [m for m in clients if m in self.aux_models]
        return {"aux": {m: [p.detach().clone() for p in self.aux_models[m][0]] for m in kept}}

    def forget(self, t: int, clients: list[int]) -> None:
        """Their smashed data of round t is not trained on: the round goes on as if they had not uploaded."""
        super().forget(t, clients)
        for key in [k for k in self.smashed if k[0] in clients]:
            del self.smashed[key]
        for m in clients:  # nor was its auxiliary model aligned for it
            if m in self._before_align:
                params, state = self._before_align.pop(m)
                with torch.no_grad():
                    for p, v in zip(self.aux_models[m][0], params):
                        p.copy_(v)
                self.aux_models[m][1].load_state_dict(state)
            elif m in self.aux_models and self._aligned_first.get(m) == t:
                del self.aux_models[m]

    @property
    def optimizer(self) -> Any:
        return self.opt

    def state_dict(self) -> dict[str, Any]:
        aux = {m: {"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}
               for m, (params, opt) in self.aux_models.items()}  # fmt: skip
        return {**super().state_dict(), "aux": aux, "align": dict(self.align_sets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.aux_models = {}
        for m, st in state["aux"].items():
            params = clone_params(st["params"], True)
            opt = build_torch_optimizer(self.cfg.server.optim, params)
            opt.load_state_dict(st["opt"])
            self.aux_models[m] = (params, opt)
        self.align_sets = dict(state["align"])

    def _remember(self, client: int, z: Tensor, y: Tensor) -> None:
        if client in self.align_sets:
            z0, y0 = self.align_sets[client]
            z, y = torch.cat([z0, z]), torch.cat([y0, y])
        self.align_sets[client] = (z[-ALIGN_MAX_SAMPLES:], y[-ALIGN_MAX_SAMPLES:])

    def download_payload(self, t: int, client: int) -> dict[str, Any]:
        out = super().download_payload(t, client)
        if t % self.cfg.algorithm.align_interval == 0 and client in self.align_sets:
            if client in self.aux_models:  # as it was before this round's alignment (forget puts it back)
                params, opt = self.aux_models[client]
                self._before_align[client] = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
            out["aux"] = [p.detach().clone() for p in self.align(t, client)]
        return out

    def true_gradients(self, z: Tensor, y: Tensor) -> Tensor:
        """λ_i = ∂ℓ_i/∂z_i for every stored sample under the current θs (each row its own sample's loss).

        With batch-statistics BatchNorm (``model.freeze_bn=code|client|none``) a chunk of ALIGN_BATCH rows is the batch,
        and these forwards leave the running statistics to the training steps."""
        out = []
        with running_stat_updates(self.model, 0):
            for zc, yc in zip(z.split(ALIGN_BATCH), y.split(ALIGN_BATCH)):
                zc = zc.detach().requires_grad_(True)
                loss = self.task.loss(server_forward(self.model, {"z": zc}), yc) * len(yc)  # Σ_i ℓ_i
                out.append(torch.autograd.grad(loss, zc)[0])
        return torch.cat(out)

    def align(self, t: int, client: int) -> list[nn.Parameter]:
        """Fit a_m to the server's λ on client m's alignment set (gradient matching); returns a_m's tensors."""
        if client not in self.aux_models:
            self._aligned_first[client] = t
            params = clone_params(self.aux_init, True)
            self.aux_models[client] = (params, build_torch_optimizer(self.cfg.server.optim, params))
        params, opt = self.aux_models[client]
        z, y = self.align_sets[client]
        target = self.true_gradients(z, y)
        gen = generator(self.cfg.seed, Stream.ALIGNMENT, t, client)
        with bound(self.aux_slots, params):
            for _ in range(ALIGN_EPOCHS):
                for idx in torch.randperm(len(y), generator=gen).to(z.device).split(ALIGN_BATCH):
                    zb = z[idx].detach().requires_grad_(True)
                    loss = self.task.loss(self.aux(zb), y[idx]) * len(idx)
                    (pred,) = torch.autograd.grad(loss, zb, create_graph=True)  # ∂ℓ(a_m(z_i))/∂z_i
                    opt.zero_grad(set_to_none=True)
                    F.mse_loss(pred, target[idx], reduction="sum").backward()
                    opt.step()
        return params


class FSLSageWorker(ExchangeWorker):
    """Clients that back-propagate the auxiliary model's gradient estimate and only send smashed data now and then."""

    server_class = FSLSageServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aux = build_aux(self.split, self.cfg.seed).to(self.device)
        self.aux_slots = trainable_slots(self.aux)
        self.aux_init = [p.detach().requires_grad_(False) for p in slot_tensors(self.aux_slots)]
        self.aux_params: dict[int, list[nn.Parameter]] = {}  # the last a_m each hosted client received

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "aux": {m: [p.detach().clone() for p in ps] for m, ps in self.aux_params.items()},
        }

    def load_state_dict(self, state: dict[str, Any], from_server: dict[str, Any]) -> None:
        super().load_state_dict(state, from_server)
        self.aux_params = {m: clone_params(ps, False, self.device) for m, ps in state["aux"].items()}

    def adopt(self, clients: dict[int, int], from_server: dict[str, Any]) -> None:
        super().adopt(clients, from_server)
        for m in clients:
            if m in from_server.get("aux", {}):
                self.aux_params[m] = clone_params(from_server["aux"][m], False, self.device)

    def release(self, clients: Sequence[int]) -> None:
        super().release(clients)
        for m in clients:
            self.aux_params.pop(m, None)

    def train_client(self, t: int, client: int, params: list[nn.Parameter], steps: int, got: dict[str, Any]) -> None:
        if "aux" in got:
            self.aux_params[client] = clone_params(got["aux"], False, self.device)
        interval = self.cfg.algorithm.server_update_interval
        opt = build_torch_optimizer(self.cfg.clients.optim, params, client_impl(params))
        sent: list[Pending] = []
        with bound(self.aux_slots, self.aux_params.get(client, self.aux_init)):
            for j in range(steps):
                x, y = self.data.next_batch(client)
                act = self.client_forward(x)
                z_in = act["z"].detach().requires_grad_(True)
                loss = self.split.task.loss(self.aux(z_in), y.to(z_in.device))
                (lam_hat,) = torch.autograd.grad(loss, z_in)  # λ̂ = ∂ℓ(a_m(z), y)/∂z, the server's λ estimated
                opt.zero_grad(set_to_none=True)
                act["z"].backward(lam_hat)
                opt.step()
                if j % interval == 0:  # smashed data for the server's update; nothing to wait for
                    sent.append(self.server.submit.send(t=t, client=client, step=j, act=detached(act), labels=y))
        for fut in sent:  # delivered before the model upload that may close the round
            fut.wait()


register(
    AlgorithmSpec(
        name="fsl_sage",
        server=FSLSageServer,
        worker=FSLSageWorker,
        zeroth_order_client=False,
        traffic=frozenset({UPLINK_ACTIVATIONS, UPLINK_MODEL, DOWNLINK_MODEL}),
        worker_parts=("client", "server"),  # the auxiliary model starts from f_s's first block
        server_parts=("server", "client"),
        drops_clients=True,
        families=("vision",),  # the paper's setting: the auxiliary model is a vision block
    )
)
