"""A floor of the memory each process and node of a run holds, against the node's (or GPU's) memory.

From the run's model built on the meta device (an LM costs nothing even at 8B:
:func:`hosfl_dist.models.build_split_model` with ``parts=()``, as ``python -m hosfl_dist.run --dry-run`` builds it for
its ``# built:`` line): each part's parameter bytes in their own dtypes (an LM's frozen base in ``model.dtype``) plus
its optimizer state, float32 per trainable parameter: two moments for AdamW (8 bytes), one momentum buffer for SGD
with momentum (4), none for plain SGD. Where each part lives is the role map's: one process holds both parts; under
torchrun a server rank holds 1/S of f_s (FSDP over ``server.ranks`` = S) and a client worker f_c; node k holds ranks
k·p .. k·p + p - 1 (p processes per node, torchrun's numbering). Gradients, activations, client replicas, buffers and
the interpreter come on top, so a run refused here cannot fit; one let through may still not.
"""

from __future__ import annotations

import re
from typing import Any

from hosfl_dist.config import Config, OptimConfig
from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.experiments.launch.worlds import World

GIB = 2**30
_MEM = re.compile(r"([0-9]+(?:\.[0-9]+)?)([KMGT]?)B?", re.IGNORECASE)


def optimizer_bytes(optim: OptimConfig) -> int:
    """Optimizer state per trainable parameter (float32)."""
    if optim.name == "adamw":
        return 8
    return 4 if optim.momentum > 0 else 0


def part_sizes(cfg: Config) -> dict[str, dict[str, int]]:
    """Per part (client, server): parameter bytes in their dtypes and trainable parameters, from a meta build."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.data import data_info
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    zeroth_order = get_algorithm(cfg.algorithm.name).zeroth_order_client
    split = build_split_model(cfg, data_info(data_sections(cfg)), zeroth_order, parts=())
    out = {}
    for part, module in (("client", split.client), ("server", split.server)):
        params = list(module.parameters())
        out[part] = {
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
        }
    return out


def rank_bytes(cfg: Config, sizes: dict[str, dict[str, int]], world: World) -> list[int]:
    """The floor of every rank's memory in ``world`` (one entry for one process)."""
    client = sizes["client"]["param_bytes"] + sizes["client"]["trainable"] * optimizer_bytes(cfg.clients.optim)
    server = sizes["server"]["param_bytes"] + sizes["server"]["trainable"] * optimizer_bytes(cfg.server.optim)
    if world.nproc <= 1:
        return [client + server]
    s = cfg.server.ranks
    return [-(-server // s)] * s + [client] * (world.nproc - s)


def node_bytes(ranks: list[int], world: World) -> list[int]:
    p = max(1, world.per_node)
    return [sum(ranks[i : i + p]) for i in range(0, len(ranks), p)]


def estimate(cfg: Config, world: World, sizes: dict[str, dict[str, int]]) -> dict[str, Any]:
    ranks = rank_bytes(cfg, sizes, world)
    return {"rank_bytes": ranks, "node_bytes": node_bytes(ranks, world), "sizes": sizes}


def too_big(cfg: Config, world: World, sizes: dict[str, dict[str, int]], node_gib: float | None,
            gpu_gib: float | None) -> str | None:  # fmt: skip
    """Why the run cannot fit (None: it may): a node's floor above ``node_gib`` (runs on the CPU), a rank's above
    ``gpu_gib`` (runs on a GPU)."""
    est = estimate(cfg, world, sizes)
    cuda = cfg.job.device.startswith("cuda")
    if cuda and gpu_gib is not None:
        worst = max(est["rank_bytes"])
        if worst > gpu_gib * GIB:
            rank = est["rank_bytes"].index(worst)
            return (f"rank {rank} needs at least {worst / GIB:,.3g} GiB (weights and optimizer state) and a GPU has "
                    f"{gpu_gib:g} GiB (--gpu-memory){_hint(cfg, world)}")  # fmt: skip
    if not cuda and node_gib is not None:
        worst = max(est["node_bytes"])
        if worst > node_gib * GIB:
            where = "the process" if world.nproc <= 1 else f"node {est['node_bytes'].index(worst)}"
            return (f"{where} needs at least {worst / GIB:,.3g} GiB (weights and optimizer state of "
                    f"{world.describe()}) and a node has {node_gib:g} GiB{_hint(cfg, world)}")  # fmt: skip
    return None


def _hint(cfg: Config, world: World) -> str:
    if world.nproc <= 1:
        return ""
    return f"; a larger server.ranks (now {cfg.server.ranks}) or more nodes spread it"


def slurm_mem_gib(options: list[str]) -> float | None:
    """The node memory a ``--mem=SIZE`` among sbatch options asks for, in GiB (Slurm's default unit, which it calls
    MB, is 2^20 bytes: MiB); None without one (``--mem=0``, the whole node, is unknown here too)."""
    value = None
    for i, opt in enumerate(options):
        if opt.startswith("--mem="):
            value = opt.split("=", 1)[1]
        elif opt == "--mem" and i + 1 < len(options):
            value = options[i + 1]
    if value is None:
        return None
    m = _MEM.fullmatch(value.strip())
    if m is None:
        raise ConfigError(f"--sbatch --mem={value}: not a size such as 64G or 64000 (MiB, Slurm's default unit)")
    scale = {"K": 2**10, "M": 2**20, "": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    gib = float(m.group(1)) * scale / GIB
    return gib or None


def sizes_or_none(cfg: Config) -> tuple[dict[str, dict[str, int]] | None, str | None]:
    """:func:`part_sizes`, or None and why where the model cannot be built here (a hub model: nothing is fetched)."""
    if cfg.model.name == "hf":
        from hosfl_dist.models.lm import hub_requirements

        hub = [need for need in hub_requirements(cfg.model, cfg.data) if need.startswith("model.source")]
        if hub:
            return None, hub[0]
    try:
        return part_sizes(cfg), None
    except (HosflError, OSError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
