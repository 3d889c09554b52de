"""The arithmetic of a zeroth-order client whose frozen base weights are stored in half precision.

A ZO client's signal is a difference of two forwards, z̃_p − z ≈ μ·J u_p, of relative size ~μ. bfloat16 keeps 8
significant bits (relative rounding 2^-9), so a bf16 forward rounds z and z̃ by more than they differ at any
usable μ and the scalars v_p = λᵀ(z̃_p − z) are rounding noise (hosfl_dist/measure/zo_precision.py,
results/scale/zo_precision.md: a relative error of order 1 at μ = 1e-3, where float32 forwards are accurate).
:func:`computing_in` runs the forwards in float32 while the weights stay stored as they are: each module's frozen
half-precision tensors are upcast just for its own forward, so the client holds its half-precision weights plus one
module's float32 copy (its activations are float32).
What goes up is cast to the dtype the server accepts (:meth:`ClientPrecision.upload`); the projection uses the
float32 z that the client kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hosfl_dist.config import ModelConfig, ZOConfig
from hosfl_dist.core.params import Slots
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import Activation, SplitModel


def _narrower(t: Tensor | None, dtype: torch.dtype) -> bool:
    return t is not None and t.is_floating_point() and torch.finfo(t.dtype).bits < torch.finfo(dtype).bits


@contextlib.contextmanager
def computing_in(module: nn.Module, dtype: torch.dtype, keep: Slots = ()) -> Iterator[None]:
    """Run ``module``'s forwards in ``dtype`` while its weights stay stored in their narrower dtypes.

    A forward pre-hook on each submodule that owns floating tensors narrower than ``dtype`` swaps them for upcast
    copies and its forward hook swaps the originals back, so one module's upcast copy is alive at a time. An
    embedding's output is cast instead (a lookup of upcast rows equals the upcast lookup, without a vocabulary-sized
    copy); what follows it then computes in ``dtype``. The tensors of ``keep`` (the trainable slots, float32 by
    :func:`~hosfl_dist.models.hf_split.apply_lora`) are left to :func:`~hosfl_dist.core.zo.perturbed`: one narrower
    than ``dtype`` would be perturbed in its own precision, so it is refused.
    """
    kept = {(id(mod), name) for mod, name in keep}
    narrow_kept = [f"{type(mod).__name__}.{name}" for mod, name in keep if _narrower(mod._parameters[name], dtype)]
    if narrow_kept:
        raise ValueError(f"trainable tensor {narrow_kept[0]} is narrower than {dtype}: θ + μu would be rounded")
    saved: dict[int, tuple[dict[str, Tensor], dict[str, Tensor]]] = {}
    owners: dict[int, nn.Module] = {}

    def upcast(mod: nn.Module, args: object) -> None:
        params = {n: p for n, p in mod._parameters.items() if (id(mod), n) not in kept and _narrower(p, dtype)}
        buffers = {n: b for n, b in mod._buffers.items() if _narrower(b, dtype)}
        saved[id(mod)] = (params, buffers)
        for n, p in params.items():
            mod._parameters[n] = p.detach().to(dtype)
        for n, b in buffers.items():
            mod._buffers[n] = b.to(dtype)

    def restore(mod: nn.Module, args: object, out: object) -> None:
        params, buffers = saved.pop(id(mod))
        mod._parameters.update(params)
        mod._buffers.update(buffers)

    def cast_output(mod: nn.Module, args: object, out: Tensor) -> Tensor:
        return out.to(dtype) if _narrower(out, dtype) else out

    handles = []
    for mod in module.modules():
        own = [p for (n, p) in mod._parameters.items() if (id(mod), n) not in kept] + list(mod._buffers.values())
        if not any(_narrower(t, dtype) for t in own):
            continue
        if isinstance(mod, nn.Embedding):
            handles.append(mod.register_forward_hook(cast_output))
        else:
            owners[id(mod)] = mod
            handles.append(mod.register_forward_pre_hook(upcast))
            handles.append(mod.register_forward_hook(restore))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for key, (params, buffers) in saved.items():  # a forward that raised mid-module: put the originals back
            owners[key]._parameters.update(params)
            owners[key]._buffers.update(buffers)


@dataclass(frozen=True)
class ClientPrecision:
    """How a zeroth-order client computes (``zo.compute_dtype`` resolved) and what dtype its uploads travel in."""

    compute: torch.dtype | None
    """dtype of the client's forwards (z and every z̃); None = the dtypes the weights are stored in."""
    wire: dict[str, torch.dtype]
    """Floating upload field -> the dtype the server accepts (its ActivationSpec); a field not named travels as is."""

    def computing(self, module: nn.Module, keep: Slots = ()) -> contextlib.AbstractContextManager[None]:
        """:func:`computing_in` at ``compute`` (nothing when None)."""
        return contextlib.nullcontext() if self.compute is None else computing_in(module, self.compute, keep)

    def upload(self, act: Activation) -> Activation:
        """``act`` with each floating field in the server's dtype (the same tensors when they already are)."""
        return {k: v.to(self.wire[k]) if k in self.wire and v.is_floating_point() else v for k, v in act.items()}


def client_precision(
    model: ModelConfig, zo: ZOConfig, split: SplitModel, uploads_both: bool = False
) -> ClientPrecision:
    """``zo.compute_dtype`` for this run, after refusing a half-precision client below the μ floor (ConfigError).

    ``uploads_both``: the server takes the difference of two uploaded activations (ZO-SFL, MU-SplitFed), so the
    upload's rounding bounds the estimate whatever the client computes in.
    """
    stored = model.dtype if model.name == "hf" else "float32"  # model.dtype applies to hf models only
    problem = zo.precision_problem(stored, uploads_both)
    if problem is not None:
        raise ConfigError(problem)
    choice = zo.compute_dtype
    compute = None if choice == "model" or (choice == "auto" and stored == "float32") else torch.float32
    if split.spec is not None:
        wire = {k: d for k, d in split.spec.dtypes.items() if d.is_floating_point}
    else:  # the profiler's client has no server: the run's would accept its stored dtype
        wire = {"z": getattr(torch, stored)}
    return ClientPrecision(compute, wire)
