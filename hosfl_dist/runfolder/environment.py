"""The environment part of a run's identity: what of the process's surroundings changes its bits.

    environment_identity(cfg)          # {"threads": 2, "torch": "2.13.0+cpu", "cpu": {...}, ...}
    environment_differences(a, b)      # ["threads 1 -> 2", "torch 2.13.0+cpu -> 2.14.0+cpu"]

- **threads**: the intra-op threads in effect when it is read (``torch.get_num_threads()``, after the runtime set
  them: whatever set them, ``job.threads``, ``OMP_NUM_THREADS`` or the auto rule). A reduction split over another
  number of threads sums in another order. Inter-op threads are not recorded: nothing this package runs uses torch's
  inter-op pool (no ``torch.jit.fork``), and its size follows the machine's core count;
- **torch**, and for a language model **transformers** and **peft**: their versions (a kernel or a model's code
  changes with them);
- **cpu**: what selects the CPU kernels: ATen's vector ISA (``torch.backends.cpu.get_cpu_capability()``, which
  ``ATEN_CPU_CAPABILITY`` lowers), the instruction-set flags MKL and oneDNN choose their GEMM and convolution kernels
  by (:data:`KERNEL_FLAGS`, from /proc/cpuinfo), and the variables that cap them (``ONEDNN_MAX_CPU_ISA``,
  ``MKL_ENABLE_INSTRUCTIONS``, ``MKL_CBWR``);
- **cuda**, where a device of the run is a GPU: the CUDA and cuDNN versions and the GPU's name.

Resume refuses a checkpoint recorded in another environment unless ``job.allow_environment_change=true``
(:mod:`hosfl_dist.runtime.front`); it is not part of the fingerprint that lets a study reuse a finished run, like the
code (:func:`hosfl_dist.runfolder.identity.fingerprint`).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from hosfl_dist.config import Config
from hosfl_dist.config.environment import kernel_settings

KERNEL_FLAGS = ("fma", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
"""CPU flags that choose which float kernel MKL and oneDNN run (FMA and AVX2 vs AVX-512 GEMM; bf16/fp16 dot products
in AVX-512 or AMX): another set may sum in another order. Integer-only extensions (VNNI, AMX-INT8) are left out:
nothing here computes in int8."""
LM_LIBRARIES = ("transformers", "peft")
"""The libraries a language model's forward runs through (their versions are identity where ``model.name=hf``)."""


def environment_identity(cfg: Config) -> dict[str, Any]:
    """This process's environment as identity (see the module docstring); read after the runtime set its threads."""
    import torch

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_kernels()}
    if cfg.model.name == "hf":
        out.update({name: library_version(name) for name in LM_LIBRARIES})
    if any(str(d).startswith("cuda") for d in (cfg.job.device, cfg.zo.rng_device)) and torch.cuda.is_available():
        device = torch.device(cfg.job.device if cfg.job.device.startswith("cuda") else "cuda")
        out["cuda"] = {
            "version": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "gpu": torch.cuda.get_device_name(device),
        }
    return out


def cpu_kernels() -> dict[str, Any]:
    """What selects this process's CPU kernels: ATen's capability, :data:`KERNEL_FLAGS` present (None where the
    system has no /proc/cpuinfo) and the variables that cap MKL and oneDNN, where set."""
    import torch

    return {"capability": torch.backends.cpu.get_cpu_capability(), "flags": _cpu_flags(), **kernel_settings()}


def library_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two environments, one phrase each: ``threads 1 -> 2``, ``cpu.capability AVX512 ->
    AVX2``."""
    return [f"{key} {_value(recorded, key)} -> {_value(now, key)}" for key in _differences(recorded, now)]


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> list[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((row for row in f if row.startswith("flags")), "")
    except OSError:
        return None
    present = set(line.partition(":")[2].split())
    return [flag for flag in KERNEL_FLAGS if flag in present]


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _value(env: dict[str, Any], dotted: str) -> str:
    value: Any = env
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, list):
        return "+".join(value) or "none"
    return "unset" if value is None else str(value)
