"""Optimizers.

Server and first-order clients use ``torch.optim``. Zeroth-order clients use :class:`TensorwiseOptimizer`, which
updates one tensor at a time from a gradient slice that the caller regenerates from seeds, so ĝ_c never exists as a
whole. Its arithmetic is a fixed sequence of in-place ops: two replicas fed the same (seeds, scalars) history end
bit-identical, whether they applied it live or replayed it later (Algorithm 3), optimizer state included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from hosfl_dist.config import OptimConfig
from hosfl_dist.core import foreach
from hosfl_dist.core.params import groups


def lr_at(cfg: OptimConfig, step: int, total: int) -> float:
    """The learning rate of step ``step`` (0-based) of ``total``: linear warmup over ``cfg.warmup_rounds`` steps,
    then ``cfg.schedule`` from lr down to ``final_lr_ratio``·lr at the last step. A pure function of the step, so a
    replica replaying step τ uses step τ's rate and replay stays bit-exact."""
    if step < cfg.warmup_rounds:
        return cfg.lr * (step + 1) / cfg.warmup_rounds
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total - 1 - cfg.warmup_rounds)
    progress = min(1.0, (step - cfg.warmup_rounds) / span)
    if cfg.schedule == "linear":
        factor = 1.0 - progress
    else:  # cosine
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.final_lr_ratio + (1.0 - cfg.final_lr_ratio) * factor)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set a torch optimizer's learning rate for its next step."""
    for group in opt.param_groups:
        group["lr"] = lr


OPTIMIZER_IMPLS = ("auto", "for_loop", "foreach", "fused")
"""How a torch optimizer steps its tensors: ``auto`` is torch's own choice (one tensor at a time on the CPU, the
``foreach`` kernels over all tensors on CUDA); the others force one (``fused``: one kernel, CUDA)."""


def build_torch_optimizer(cfg: OptimConfig, params: Iterable[Tensor], impl: str = "auto") -> torch.optim.Optimizer:
    """The server's (and first-order clients') ``torch.optim`` optimizer over the trainable ``params``.

    ``impl="auto"`` (what runs use) leaves the implementation to torch. On the CPU that is the loop over tensors; on
    CUDA the ``foreach`` kernels, which for the 92 LoRA tensors of a Qwen3 server take a fraction of the loop's
    launches (``results/gpu/README.md``). Both runtimes and every server rank build it the same way, so their bits
    agree with each other on one kind of device.
    """
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer impl {impl!r}: expected one of {', '.join(OPTIMIZER_IMPLS)}")
    params = [p for p in params if p.requires_grad]
    kind = {"foreach": None, "fused": None}  # auto: torch's choice
    if impl != "auto":
        kind = {"foreach": impl == "foreach", "fused": impl == "fused"}
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **kind
        )
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kind)


GradsOf = Callable[[list[int], list[Tensor]], list[Tensor]]
"""``grads_of(indices, params)``: the gradient slices of trainable tensors ``indices`` (``params``), in order."""


def client_impl(params: Sequence[Tensor]) -> str:
    """The ``impl`` of a first-order client's optimizer: ``foreach`` (one ``_foreach`` op per step phase instead of
    a Python op per tensor) where torch's foreach step gives its loop's bits, float32 and float64 tensors (on the
    CPU in torch 2.13 bfloat16 momentum and weight decay round differently), else torch's own choice."""
    exact = all(p.dtype in (torch.float32, torch.float64) for p in params)
    return "foreach" if exact and params else "auto"


class TensorwiseOptimizer:
    """AdamW / SGD over a list of tensors, stepping one group of tensors at a time.

    ``step(params, grads_of)`` asks ``grads_of(indices, group)`` for the gradients of each group of
    :func:`~hosfl_dist.core.params.groups` (consecutive tensors of one device and dtype, ~1 MiB together) and
    applies the update in place with one op per group (:mod:`hosfl_dist.core.foreach`: ``torch._foreach_*`` where
    that is the loop's kernel on each tensor, the loop elsewhere), so the numbers are the loop's, bit for bit,
    without a Python op per tensor on the CPU; a gradient of the whole of θc never exists at once. The state (step
    count, moments) lives here, not in the tensors, so a client replica is (tensors, optimizer state, round).
    """

    def __init__(self, cfg: OptimConfig, params: Sequence[Tensor], total_steps: int = 0) -> None:
        self.cfg = cfg
        self.total_steps = total_steps
        """Steps of the run, for the learning-rate schedule (step i's rate is :func:`lr_at` (cfg, i, total))."""
        self.steps = 0
        self.state: list[dict[str, Tensor]] = [{} for _ in params]
        self.lr = cfg.lr

    def step(self, params: Sequence[Tensor], grads_of: GradsOf) -> None:
        self.lr = lr_at(self.cfg, self.steps, self.total_steps) if self.cfg.scheduled else self.cfg.lr
        self.steps += 1
        with torch.no_grad():
            for run in groups(params):
                ps = [params[i] for i in run]
                gs = grads_of(run, ps)
                if self.cfg.name == "adamw":
                    self._adamw(run, ps, gs)
                else:
                    self._sgd(run, ps, gs)

    def _adamw(self, run: list[int], ps: list[Tensor], gs: list[Tensor]) -> None:
        c = self.cfg
        for i, p in zip(run, ps):
            if not self.state[i]:
                self.state[i] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        ms = [self.state[i]["exp_avg"] for i in run]
        vs = [self.state[i]["exp_avg_sq"] for i in run]
        foreach.mul_(ps, 1.0 - self.lr * c.weight_decay)  # decoupled weight decay
        foreach.mul_(ms, c.beta1)
        foreach.add_(ms, gs, alpha=1.0 - c.beta1)
        foreach.mul_(vs, c.beta2)
        foreach.addcmul_(vs, gs, gs, value=1.0 - c.beta2)
        bias1 = 1.0 - c.beta1**self.steps
        bias2 = 1.0 - c.beta2**self.steps
        denom = foreach.sqrt(vs)  # one θ-sized temporary per group
        foreach.div_(denom, math.sqrt(bias2))
        foreach.add_scalar_(denom, c.eps)
        foreach.addcdiv_(ps, ms, denom, value=-self.lr / bias1)

    def _sgd(self, run: list[int], ps: list[Tensor], gs: list[Tensor]) -> None:
        c = self.cfg
        if c.weight_decay:
            gs = foreach.added(gs, ps, alpha=c.weight_decay)
        if c.momentum:
            held = [j for j, i in enumerate(run) if "momentum" in self.state[i]]
            if held:
                bufs = [self.state[run[j]]["momentum"] for j in held]
                foreach.mul_(bufs, c.momentum)
                foreach.add_(bufs, [gs[j] for j in held])
            for i, g in zip(run, gs):  # the first step: the buffer starts as the gradient
                if "momentum" not in self.state[i]:
                    self.state[i]["momentum"] = g.clone()
            gs = [self.state[i]["momentum"] for i in run]
        foreach.add_(ps, gs, alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "state": [{k: t.clone() for k, t in st.items()} for st in self.state]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.state = [{k: t.clone() for k, t in st.items()} for st in state["state"]]

    def state_tensors(self) -> list[Tensor]:
        return [t for st in self.state for _, t in sorted(st.items())]

    def clone(self) -> TensorwiseOptimizer:
        other = TensorwiseOptimizer(self.cfg, self.state, self.total_steps)
        other.steps = self.steps
        other.state = [{k: t.clone() for k, t in st.items()} for st in self.state]
        return other
