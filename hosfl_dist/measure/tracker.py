"""Counting what a client holds: live tensor-storage bytes at the aten level (deterministic), and the measurement of
one step under it and the process RSS (:mod:`hosfl_dist.runtime.memory`; CUDA's allocator peak too, on a GPU)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hosfl_dist.runtime.memory import reset_peak_rss, rss_bytes


class AllocationTracker(TorchDispatchMode):
    """Live bytes of tensor storages and their peak, counted at the aten level (deterministic).

    Every tensor an op returns is looked up by its storage: a storage not seen before is added with its size and a
    finaliser that subtracts it when the storage dies. Views and in-place results share a storage already counted,
    so they add nothing; a storage that grows in place (``resize_``) is re-counted at its new size. Tensors that
    exist before the step (weights, optimizer state, the batch) are added with :meth:`register`, so the count is
    "what the client holds": resident state plus everything allocated while the step runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.allocations = 0
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, tensors: Iterable[Tensor]) -> int:
        """Count the storages of existing tensors (once each); returns the bytes added."""
        before = self.current
        for t in tensors:
            self._track(t)
        return self.current - before

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def _track(self, t: Tensor) -> None:
        if not isinstance(t, Tensor) or t.is_meta or t.is_sparse:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (nested, functional wrappers)
            return
        key, nbytes = st._cdata, st.nbytes()
        with self._lock:
            old = self._live.get(key)
            if old is None:
                if nbytes == 0:
                    return
                self._live[key] = nbytes
                self.allocations += 1
                weakref.finalize(st, self._free, key)
            elif old != nbytes:  # resized in place
                self._live[key] = nbytes
            else:
                return
            self.current += nbytes - (old or 0)
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._track(t)
        return out


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of a counted tensor adds nothing)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor) and not t.is_meta:
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


@dataclass
class ModeStep:
    """A mode ready to run: ``step()`` does one client step; ``resident`` is what the client holds between steps."""

    step: Callable[[], None]
    resident: list[Tensor]
    module: nn.Module
    """What holds the weights (f_c, or both parts for full_local): its parameters are the ``params_bytes``."""
    trainable: list[Tensor]
    """The tensors the step updates."""
    optimizer_state: list[Tensor]
    """Optimizer state held between steps (counted as resident)."""
    activation_bytes: int = 0
    """Bytes of z, the activation uploaded per step (0 for full_local)."""


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Frees happen by reference counting only while measuring, so the count does not depend on GC timing."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def measure(ms: ModeStep, device: str = "cpu", steps: int = 1) -> dict[str, Any]:
    """Run ``steps`` client steps under the tracker and return the peak figures (bytes) and the step time."""
    cuda = device.startswith("cuda")
    with _gc_paused():
        tracker = AllocationTracker()
        tracker.register(ms.resident)
        resident = tracker.current
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            cuda_resident = torch.cuda.memory_allocated(device)
        rss_reset = reset_peak_rss()
        rss_before, _ = rss_bytes()
        times = []
        with tracker:
            for _ in range(steps):
                t0 = time.perf_counter()
                ms.step()
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
        _, rss_peak = rss_bytes()
    params = list(ms.module.parameters())
    out: dict[str, Any] = {
        "peak_bytes": tracker.peak,
        "resident_bytes": resident,
        "working_bytes": tracker.peak - resident,
        "params_bytes": storage_bytes(params),
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in ms.trainable),
        "optimizer_state_bytes": storage_bytes(ms.optimizer_state),
        "activation_bytes": ms.activation_bytes,
        "allocations": tracker.allocations,
        "step_s": min(times),
        "rss_before_bytes": rss_before,
        "rss_peak_bytes": rss_peak if rss_reset else None,
    }
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cuda_resident_bytes"] = cuda_resident
    return out
