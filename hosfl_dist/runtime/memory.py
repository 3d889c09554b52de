"""What a process of a run holds: its peak RSS (from /proc), and the entry of summary.json's ``memory`` each process
sends (:func:`process_memory`)."""

from __future__ import annotations

from typing import Any

import torch


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int | None, int | None]:
    """(current RSS, peak RSS since the last reset) of this process, from /proc/self/status (psutil otherwise)."""
    try:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    fields[name] = int(value.split()[0]) * 1024
        return fields.get("VmRSS"), fields.get("VmHWM")
    except OSError:
        try:
            import psutil

            return psutil.Process().memory_info().rss, None
        except ImportError:
            return None, None


def process_memory(rank: int, role: str, *modules: Any) -> dict[str, Any]:
    """One entry of summary.json's ``memory``: this process's role and host, the bytes of the model parameters it
    materialised (its FSDP shard on a server rank; meta tensors count nothing), its peak RSS, and on GPU its peak
    CUDA allocation."""
    from hosfl_dist.models.materialize import param_bytes

    import socket

    entry: dict[str, Any] = {
        "rank": rank,
        "role": role,
        "host": socket.gethostname(),
        "param_bytes": param_bytes(*modules),
        "peak_rss_bytes": rss_bytes()[1],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entry["peak_cuda_bytes"] = int(torch.cuda.max_memory_allocated())
    return entry
