"""Every random choice of a run derives from ``job.seed`` through a named stream.

A stream is a fixed salt: ``stream_seed(job.seed, Stream.PARTITION)`` seeds the data partition,
``stream_seed(job.seed, Stream.PERTURBATION, t, p)`` the seed s_p^t of the p-th perturbation of round t, and so on.
Seeds are hashed with SplitMix64 (stable across processes, platforms and Python versions, unlike ``hash``), so any
process can regenerate any stream without shipping it: that is what lets clients rebuild ĝ_c from P seeds.
The salts are part of the replicas' contract (changing one changes every result), so they are listed here once.
"""

from __future__ import annotations

from enum import IntEnum

import torch

_MASK64 = (1 << 64) - 1


class Stream(IntEnum):
    """Salts of the independent random streams of a run."""

    TRAIN_SUBSET = 1
    """Which training samples ``data.train_max_samples`` keeps."""
    PARTITION = 0x9A27
    """How training samples are spread over the M clients (IID or Dirichlet)."""
    CLIENT_BATCHES = 0xDA7A
    """The batch order of one client's shard (per client id)."""
    AUGMENT = 0xA06
    """Random crops and flips of one client's batches (per client id)."""
    VISION_INIT = 0x0DE1
    """Initial weights of the vision models."""
    MODEL_INIT = 0x1417
    """Weights of an architecture without a checkpoint (``model.source=arch:<name>``; per tensor name and chunk)."""
    LORA_INIT = 0x10A
    """LoRA A matrices of the client (0) and server (1) parts."""
    CLIENT_SAMPLING = 0x5A3F
    """S_t: the K clients sampled in round t."""
    PERTURBATION = 0x5EED
    """s_p^t: the seed of perturbation p of round t (HO-SFL)."""
    STEP_PERTURBATION = 0x250F
    """The perturbation of one client step of the two-point baselines (per round, client, step)."""
    SERVER_PERTURBATION = 0x5E4
    """The server's slice of a baseline's perturbation, derived from the step's seed (not from the run seed)."""
    AUX_INIT = 0xA0C
    """FSL-SAGE's auxiliary head."""
    ALIGNMENT = 0xA119
    """FSL-SAGE's alignment batches (per round and client)."""
    CENTRALIZED_ORDER = 0xCE17
    """The sample order of the centralised first-order reference (hosfl_dist/centralized/lora.py)."""
    DROPOUT = 0xD809
    """Whether a sampled client fails to deliver its round (``clients.dropout``; per round and client)."""
    DROPOUT_STAGE = 0xD57A
    """The stage of a client's failure under ``clients.dropout_stage=mixed`` (per round and client)."""
    ARRIVAL = 0xA771
    """The order in which a round's uploads arrive under ``clients.over_select`` (per round and client)."""
    LINK_SPEED = 0x5BEED
    """A client's link speed factor under ``comm.speed_spread`` (per client)."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers into one 63-bit seed."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h & ((1 << 63) - 1)


def stream_seed(seed: int, stream: Stream, *parts: int) -> int:
    """The seed of ``stream`` (and of the ids in ``parts``) under ``seed``."""
    return mix_seed(seed, stream, *parts)


def generator(seed: int, stream: Stream, *parts: int) -> torch.Generator:
    """A CPU generator on ``stream``."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, *parts))


def round_seeds(run_seed: int, round_idx: int, num_perturbations: int) -> list[int]:
    """s_p^t for p = 1..P: derived from the run seed so that nobody ships u_p (only the P seeds travel)."""
    return [stream_seed(run_seed, Stream.PERTURBATION, round_idx, p) for p in range(num_perturbations)]


def sample_clients(seed: int, round_idx: int, total: int, per_round: int) -> list[int]:
    """S_t: K of M clients, uniformly without replacement, sorted."""
    g = generator(seed, Stream.CLIENT_SAMPLING, round_idx)
    return sorted(torch.randperm(total, generator=g)[:per_round].tolist())
