"""In-place updates of a list of tensors, as one ``torch._foreach_*`` op where that gives the bits of the loop over the
tensors, else as the loop.

On the CPU torch's ``_foreach_*`` ops run the per-tensor kernel on each tensor (checked for float32, float64 and
bfloat16 in ``tests/test_zo.py``), except the in-place product by a scalar, which rounds bfloat16 and float16
differently (torch 2.13). On other devices they run fused multi-tensor kernels whose arithmetic is not the per-tensor
kernels' (CUDA's ``div_`` by a scalar multiplies by its reciprocal, the foreach one divides), so the loop stays there:
a replica's bits never depend on which path updated it. A copy (``_foreach_copy_``) is exact anywhere, and callers
use it directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

_HALF = (torch.bfloat16, torch.float16)


def fused(tensors: list[Tensor]) -> bool:
    """Whether the ``_foreach_*`` ops give these tensors the loop's bits (on the CPU; see the module docstring)."""
    return bool(tensors) and tensors[0].device.type == "cpu"


def mul_(xs: list[Tensor], scale: float) -> None:
    """x ← x·scale."""
    if fused(xs) and xs[0].dtype not in _HALF:
        torch._foreach_mul_(xs, scale)
    else:
        for x in xs:
            x.mul_(scale)


def muled(xs: list[Tensor], scale: float) -> list[Tensor]:
    """x·scale, new tensors."""
    if fused(xs):
        return list(torch._foreach_mul(xs, scale))
    return [x.mul(scale) for x in xs]


def add_(xs: list[Tensor], ys: list[Tensor], alpha: float = 1.0) -> None:
    """x ← x + alpha·y."""
    if fused(xs):
        torch._foreach_add_(xs, ys, alpha=alpha)
    else:
        for x, y in zip(xs, ys):
            x.add_(y, alpha=alpha)


def added(xs: list[Tensor], ys: list[Tensor], alpha: float = 1.0) -> list[Tensor]:
    """x + alpha·y, new tensors."""
    if fused(xs):
        return list(torch._foreach_add(xs, ys, alpha=alpha))
    return [x.add(y, alpha=alpha) for x, y in zip(xs, ys)]


def add_scalar_(xs: list[Tensor], value: float) -> None:
    """x ← x + value."""
    if fused(xs):
        torch._foreach_add_(xs, value)
    else:
        for x in xs:
            x.add_(value)


def div_(xs: list[Tensor], value: float) -> None:
    """x ← x / value."""
    if fused(xs):
        torch._foreach_div_(xs, value)
    else:
        for x in xs:
            x.div_(value)


def sqrt(xs: list[Tensor]) -> list[Tensor]:
    """√x, new tensors."""
    return list(torch._foreach_sqrt(xs)) if fused(xs) else [x.sqrt() for x in xs]


def addcmul_(xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float) -> None:
    """x ← x + value·y·z."""
    if fused(xs):
        torch._foreach_addcmul_(xs, ys, zs, value=value)
    else:
        for x, y, z in zip(xs, ys, zs):
            x.addcmul_(y, z, value=value)


def addcdiv_(xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float) -> None:
    """x ← x + value·y/z."""
    if fused(xs):
        torch._foreach_addcdiv_(xs, ys, zs, value=value)
    else:
        for x, y, z in zip(xs, ys, zs):
            x.addcdiv_(y, z, value=value)
