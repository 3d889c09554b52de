"""This host's settings for a process: intra-op threads, glibc's malloc, the network interface, the devices; whether
a process of this host runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import Config
from hosfl_dist.config.schema import thread_limit
from hosfl_dist.errors import ConfigError, first_line

if TYPE_CHECKING:
    from hosfl_dist.runtime.process.launch import LaunchEnv

MALLOC_ARENAS = 2
"""glibc malloc arenas of a torchrun process, unless MALLOC_ARENA_MAX says otherwise (glibc's default: 8 per core).
A thread that allocates while the others hold their arenas gets a new one, and memory freed in an arena stays there.
The server's executions run on one thread (:class:`~hosfl_dist.transport.endpoint.ServerThread`), which alone kept
its RSS flat; the cap bounds what the other threads (RPC, gloo, TensorPipe: more of them on larger nodes) can spread.
Alone, it stopped most of the old runtime's server RSS growth over 50 tiny-Qwen3 rounds, at no cost measured in
round time (results/scale/cpu_hygiene.md). Set in code rather than by the launch scripts so that every start
(scripts, Slurm, tests, benchmarks) gets it."""


def limit_malloc_arenas(environ: Mapping[str, str] | None = None) -> int | None:
    """Cap glibc's malloc arenas at :data:`MALLOC_ARENAS` (mallopt M_ARENA_MAX) unless MALLOC_ARENA_MAX is set, which
    glibc has read already; the cap in force, or None where there is no glibc. Arenas made before stay, so this runs
    before the process starts threads."""
    return _malloc_option("MALLOC_ARENA_MAX", -8, MALLOC_ARENAS, environ)  # M_ARENA_MAX of <malloc.h>


MMAP_THRESHOLD = 1 << 20
"""Allocations of at least this many bytes get their own mmap (glibc's M_MMAP_THRESHOLD), fixed."""


def fix_mmap_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` unless MALLOC_MMAP_THRESHOLD_ is set; the threshold in
    force, or None where there is no glibc.

    glibc raises its threshold (up to 32 MiB) each time a mapped block is freed, after which blocks of that size come
    from the heap and stay resident once freed. FSDP's per-block all-gather buffers (tens of MB, one block after
    another) then pile up: an FSDP server rank of Qwen3-0.6B peaked at 2.45 GB after one forward with the dynamic
    threshold and 1.56 GB with it fixed at 1 MiB, which returns every freed buffer to the system."""
    return _malloc_option("MALLOC_MMAP_THRESHOLD_", -3, MMAP_THRESHOLD, environ)  # M_MMAP_THRESHOLD of <malloc.h>


WORKER_MMAP_THRESHOLD = 32 << 20
"""A client worker's mmap threshold (glibc's largest): its forwards' activations come from the heap."""
WORKER_TRIM_THRESHOLD = 1 << 31
"""A client worker returns the heap's free top to the system only beyond this (glibc's M_TRIM_THRESHOLD)."""


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> int | None:
    """A client worker, and a server that is one rank (no FSDP all-gather buffers), keeps the memory it frees (mmap
    threshold :data:`WORKER_MMAP_THRESHOLD`, trim threshold :data:`WORKER_TRIM_THRESHOLD`) unless
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ are set; the mmap threshold in force, or None where there is no
    glibc. A server rank's round allocates and frees the same activation sizes too: keeping freed memory cut the
    quickstart server's compute per round under torchrun, for a little more peak resident memory (measured in
    results/bench/changes.md#round_overlap).

    A client runs the same forward P+1 times a round, each allocating and freeing the same activation sizes. With the
    threshold fixed at :data:`MMAP_THRESHOLD` every activation of 1 MiB or more is a fresh mapping whose pages fault
    on first touch (the quickstart client's forward: 32×16×28×28 float32 = 1.6 MB per layer output), so its forwards
    take several times as long as with freed memory kept (measured in results/bench/README.md#zo_step, "Torchrun
    client workers"). A worker's peak is what it holds at once, unchanged; its resident size
    stays at that peak between rounds instead of falling back."""
    threshold = _malloc_option("MALLOC_MMAP_THRESHOLD_", -3, WORKER_MMAP_THRESHOLD, environ)
    _malloc_option("MALLOC_TRIM_THRESHOLD_", -1, WORKER_TRIM_THRESHOLD, environ)  # M_TRIM_THRESHOLD of <malloc.h>
    return threshold


def _malloc_option(variable: str, param: int, value: int, environ: Mapping[str, str] | None) -> int | None:
    """mallopt(param, value) unless the environment variable that glibc reads at start sets it; the value in force,
    or None where there is no glibc."""
    environ = os.environ if environ is None else environ
    if environ.get(variable):
        return int(environ[variable])
    mallopt = _mallopt()
    if mallopt is None or mallopt(param, value) != 1:
        return None
    return value


def _mallopt() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def bind_interface(cfg: Config, env: LaunchEnv, environ: dict[str, str] | None = None) -> str | None:
    """Bind gloo and TensorPipe to ``job.interface`` (set before any group or RPC agent exists); the name bound.

    auto: loopback when the job runs on one node (torchrun's LOCAL_WORLD_SIZE equals WORLD_SIZE), so that nothing of
    the job listens beyond this machine; across nodes, what the environment already says: GLOO_SOCKET_IFNAME, which
    TensorPipe then follows too unless TP_SOCKET_IFNAME says otherwise (name the interface with job.interface, e.g.
    as an override to slurm/hosfl.sbatch). The job's store, where rank 0 hosts it, listens on loopback on one node
    and on MASTER_ADDR across nodes (:func:`~hosfl_dist.runtime.process.groups.store_address`).
    """
    environ = os.environ if environ is None else environ
    name = cfg.job.interface
    if name == "auto":
        if env.local_world_size != env.world_size:
            name = environ.get("GLOO_SOCKET_IFNAME") or ""
            if name:
                environ.setdefault("TP_SOCKET_IFNAME", name)
            return name or None
        name = "lo"
    check_interface(name)
    for key in SOCKET_IFNAMES:
        environ[key] = name
    return name


def check_interface(name: str) -> None:
    """Refuse a network interface this node does not have (where the system lists them)."""
    net = Path("/sys/class/net")
    if name != "auto" and net.is_dir() and not (net / name).exists():
        have = sorted(p.name for p in net.iterdir())
        raise ConfigError(f"job.interface={name}: this node has no such interface (it has {', '.join(have)})")


def check_devices(cfg: Config) -> None:
    """Refuse a CUDA device (for the models or the noise generator) on a machine without one, in one line."""
    import torch

    for key, value in (("job.device", cfg.job.device), ("zo.rng_device", cfg.zo.rng_device)):
        if value.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"{key}={value} but this machine has no CUDA device (torch.cuda.is_available() is False)"
                )
            index = torch.device(value).index
            if index is not None and index >= torch.cuda.device_count():
                raise ConfigError(f"{key}={value} but this machine has {torch.cuda.device_count()} CUDA device(s)")


SMALL_MODEL_PARAMS = 10_000_000
"""Below this many parameters a process runs on one intra-op thread (``job.threads=0``): the work per kernel is too
small to split, and threads that wait for cores other processes hold cost more than they save (measured in one
process on a loaded 2-core machine: results/bench/README.md#threads). A larger model gains from a core only while no
other work holds it, hence the rule's other branch (:func:`free_cores`)."""


def free_cores(cores: int, load: float) -> int:
    """The cores no other work holds: ``cores`` less the 1-minute load average, rounded, at least 1 and at most
    ``cores`` (2 cores at a load of 0.2 -> 2; at 1.0 -> 1; at 5 -> 1). The load counts this process's own start-up
    (imports, the build) only as the few seconds it has run, a fraction of one."""
    return max(1, min(cores, round(cores - load)))


def set_threads(
    cfg: Config,
    params: int,
    environ: Mapping[str, str] | None = None,
    load: float | None = None,
    recorded: int | None = None,
) -> tuple[int, str]:
    """Set this process's intra-op threads from ``job.threads``; (threads, why) for the log.

    ``job.threads=0`` (auto): ``OMP_NUM_THREADS`` where the environment sets it (torchrun sets 1 where it is unset,
    ``launch/torchrun.sh`` too; an experiment command sets its ``--threads``); else one thread for a model under
    :data:`SMALL_MODEL_PARAMS` parameters, and for a larger one the cores no other work holds now
    (:func:`free_cores`: the core count less the 1-minute load average, at least 1).

    ``params``: the parameters of the model this process runs (both parts in one process); ``load``: the 1-minute
    load average (default: ``os.getloadavg()``, where the system has one); ``recorded``: the threads the checkpoint a
    resume continues was written with (:func:`resumed_threads`): the load rule then takes them, since the threads are
    part of the run's identity and a resume under another load would otherwise be refused."""
    import torch

    environ = os.environ if environ is None else environ
    if cfg.job.threads:
        n, why = cfg.job.threads, "job.threads"
    elif environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        n = int(environ["OMP_NUM_THREADS"])
        launcher = ("torchrun's (it sets 1 where the variable is unset)" if "WORLD_SIZE" in environ
                    else "its launcher's (an experiment command's --threads) or the shell's")  # fmt: skip
        why = f"job.threads=0 (auto): OMP_NUM_THREADS={n}, set in the environment this process started with: {launcher}"
    elif params < SMALL_MODEL_PARAMS:
        n, why = 1, f"job.threads=0 (auto): {held(params, '.2g')} run fastest on one"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if load is None and hasattr(os, "getloadavg"):
            load = os.getloadavg()[0]
        size = f"job.threads=0 (auto): {held(params, '.3g')}"
        if recorded:
            n, why = recorded, f"{size}, the threads its newest checkpoint was written with (job.resume=auto)"
        elif load is None:
            n, why = cores, f"{size}, every core (this system has no load average)"
        else:
            n = free_cores(cores, load)
            why = (f"{size}, the cores other work leaves free ({cores} cores less the 1-minute load average "
                   f"{load:.2f}, at least 1)")  # fmt: skip
    try:
        torch.set_num_threads(n)
    except (RuntimeError, ValueError, OSError) as exc:  # threads the machine cannot start: one line, exit code 2
        raise ConfigError(f"cannot start {n} intra-op threads ({why.split(':')[0]}; at most {thread_limit()} on "
                          f"this machine): {first_line(exc)}") from None  # fmt: skip
    return n, why


def held(params: int, spec: str) -> str:
    """What ``params`` counts, in words: the parameters of the parts of the split model this process holds. Not a
    model card's count: f_c and f_s each hold an embedding tied to the head (SmolLM2-135M in one process: 163M here,
    134.5M as transformers counts it once)."""
    return (f"{params / 1e6:{spec}}M parameters in the parts of the model this process holds (an embedding tied to "
            "the head counts in f_c and in f_s)")  # fmt: skip


def resumed_threads(cfg: Config) -> int | None:
    """The intra-op threads recorded in the newest checkpoint of ``job.out_dir`` when ``job.resume=auto`` would
    continue it (None otherwise). Read from the manifest as written, a hint for the auto rule only: the resume
    verifies the manifest and compares the environment before a byte of the checkpoint is loaded."""
    from hosfl_dist.config.schema import MAX_THREADS
    from hosfl_dist.runfolder.checkpoints import checkpoint_folders, read_manifest

    if cfg.job.resume != "auto" or not cfg.job.out_dir:
        return None
    folders = checkpoint_folders(cfg.job.out_dir)
    manifest = read_manifest(folders[0]) if folders else None
    threads = (((manifest or {}).get("identity") or {}).get("environment") or {}).get("threads")
    ok = isinstance(threads, int) and not isinstance(threads, bool) and 0 < threads <= MAX_THREADS
    return threads if ok else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (another user's counts: it cannot be signalled, but it is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
