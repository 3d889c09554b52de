"""Trainable slots: where a module's trainable tensors live, so replicas can be swapped in without copies.

A slot is (owner module, parameter name). Binding a list of tensors into the slots points the module at them; this
is how one client module serves many replicas (one per logical client) and how the zeroth-order perturbation
swaps θ + μu in and θ back out without ever writing to θ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

Slots = Sequence[tuple[nn.Module, str]]


def trainable_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner module, parameter name) for every trainable parameter, in ``named_parameters`` order.

    The position in this list is the tensor index used for noise seeds, so it must be identical on every replica
    (same architecture, same order).
    """
    slots = []
    for _, mod in module.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            if p.requires_grad:
                slots.append((mod, name))
    return slots


def slot_tensors(slots: Slots) -> list[Tensor]:
    """The tensors the slots hold now."""
    return [mod._parameters[name] for mod, name in slots]


def bind_slots(slots: Slots, params: Sequence[Tensor]) -> None:
    """Point the slots at ``params`` (no copy)."""
    for (mod, name), p in zip(slots, params, strict=True):
        mod._parameters[name] = p


@contextlib.contextmanager
def bound(slots: Slots, params: Sequence[Tensor]) -> Iterator[None]:
    """Run a block with ``params`` in the slots, then put the previous tensors back."""
    saved = slot_tensors(slots)
    bind_slots(slots, params)
    try:
        yield
    finally:
        bind_slots(slots, saved)


def clone_params(
    tensors: Sequence[Tensor], requires_grad: bool, device: torch.device | None = None
) -> list[nn.Parameter]:
    """Independent copies of ``tensors`` as parameters (a replica, a server copy, a downloaded model)."""
    return [nn.Parameter(t.detach().to(device).clone(), requires_grad=requires_grad) for t in tensors]


GROUP_NUMEL = 1 << 18
"""Elements per group of tensors that the zeroth-order passes treat as one flat buffer (1 MiB of float32): small
tensors share one ``_foreach`` op per pass, while the scratch a pass holds stays near the largest tensor's size."""


def groups(tensors: Sequence[Tensor], limit: int = GROUP_NUMEL) -> list[list[int]]:
    """The indices of ``tensors`` as consecutive runs that share a device and dtype and hold at most ``limit``
    elements together (a larger tensor is a run of its own); a tensor that is not contiguous is always alone."""
    runs: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        if runs and t.is_contiguous() and size + t.numel() <= limit:
            prev = tensors[runs[-1][-1]]
            if prev.is_contiguous() and prev.device == t.device and prev.dtype == t.dtype:
                runs[-1].append(i)
                size += t.numel()
                continue
        runs.append([i])
        size = t.numel()
    return runs
