"""Bit-level identity: a SHA-256 over the raw bytes of tensors (replicas), or of a file (a run's inputs)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

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


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
