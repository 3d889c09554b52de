"""Bit-level identity of replicas: a SHA-256 over the raw bytes of tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor


def tensors_digest(tensors: Iterable[Tensor]) -> str:
    """SHA-256 over the shapes, dtypes and raw bytes of ``tensors``, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu().reshape(-1)
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
