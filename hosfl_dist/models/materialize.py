"""Role-aware construction: a decoder LM is built on the meta device and each process materialises only its part.

A client worker materialises f_c; a server rank materialises f_s — after FSDP2 has sharded it, so every parameter is
allocated and filled as this rank's rows only — plus the client's trainable tensors (θc^0, which every method's
server keeps). Values come from a :class:`Weights` source, read one parameter, or one shard of it, at a time:

- :class:`RandomWeights` (``model.source=arch:<name>``, a config without weights): each weight matrix is drawn in
  fixed chunks of rows, every chunk from its own generator seeded by (``job.seed``, the tensor's name, the chunk), so a
  rank that holds rows [a, b) draws only the chunks that cover them and θ^0 is the same for any server group size or
  layout (in-process, S=1, S=2);
- :class:`SafetensorsWeights` (a local Hugging Face directory): the rows of each tensor are sliced from the files
  without reading the rest (``safe_open(...).get_slice``);
- :class:`StateDictWeights`: a whole state dict, for sources that only load whole (tiny test models, a few hundred
  KB; GGUF files, which transformers dequantises as a whole) — the full model then exists in this process for as long
  as its parameters are copied, and is freed before training starts.

LoRA adapters have no source: their A matrices are drawn as :func:`~hosfl_dist.models.hf_split.lora_init_values`
says (the same generator sequence as an eagerly built model) and B is zero.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hosfl_dist.core.seeding import Stream, stream_seed

ROWS_PER_DRAW = 1 << 20
"""Elements per random chunk: a weight matrix is drawn ⌈rows / (ROWS_PER_DRAW // cols)⌉ chunks at a time."""

Key = tuple[int, str]
"""(id(module), parameter name): how a parameter is found again after FSDP2 replaced the Parameter object."""


class Weights(Protocol):
    def rows(self, name: str, module: nn.Module, attr: str, shape: torch.Size, start: int, stop: int) -> Tensor:
        """Rows [start, stop) (along dim 0) of the tensor ``name`` of the full model, shape ``shape``."""


class StateDictWeights:
    def __init__(self, state: dict[str, Tensor]) -> None:
        self.state = state

    def rows(self, name: str, module: nn.Module, attr: str, shape: torch.Size, start: int, stop: int) -> Tensor:
        if name not in self.state:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return self.state[name][start:stop]


class SafetensorsWeights:
    """The tensors of a local Hugging Face directory (``model.safetensors`` or a sharded index), read by slice."""

    def __init__(self, directory: str, aliases: dict[str, str]) -> None:
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
        else:
            with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        self.directory, self.where, self.aliases = directory, where, aliases
        self._open: dict[str, Any] = {}

    @staticmethod
    def available(directory: str) -> bool:
        names = ("model.safetensors", "model.safetensors.index.json")
        return any(os.path.isfile(os.path.join(directory, n)) for n in names)

    def rows(self, name: str, module: nn.Module, attr: str, shape: torch.Size, start: int, stop: int) -> Tensor:
        from safetensors import safe_open

        key = name if name in self.where else self.aliases.get(name, name)
        if key not in self.where:
            raise KeyError(f"{self.directory} has no tensor {name!r}")
        file = self.where[key]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.directory, file), "pt")
        return self._open[file].get_slice(key)[start:stop]


class RandomWeights:
    """Weights of an architecture without a checkpoint, as Hugging Face's ``_init_weights`` lays them out: linear and
    embedding weights ~ N(0, initializer_range²) (an embedding's padding row zero), biases zero, norm scales one (zero
    for Gemma's ``1 + w`` norms) — each matrix drawn chunk by chunk from seeds that depend on its name only."""

    def __init__(self, seed: int, std: float) -> None:
        self.seed, self.std = seed, std

    def rows(self, name: str, module: nn.Module, attr: str, shape: torch.Size, start: int, stop: int) -> Tensor:
        n = stop - start
        rest = tuple(shape[1:])
        if attr == "bias":
            return torch.zeros((n, *rest))
        if not isinstance(module, (nn.Linear, nn.Embedding)):  # norms: HF sets these without drawing
            fill = 0.0 if type(module).__name__.startswith("Gemma") and "Norm" in type(module).__name__ else 1.0
            return torch.full((n, *rest), fill)
        cols = max(1, int(torch.Size(rest).numel()))
        per = max(1, ROWS_PER_DRAW // cols)
        out = torch.empty((n, *rest))
        tensor_id = zlib.crc32(name.encode())
        for chunk in range(start // per, (stop - 1) // per + 1):
            lo, hi = chunk * per, min((chunk + 1) * per, shape[0])
            gen = torch.Generator().manual_seed(stream_seed(self.seed, Stream.MODEL_INIT, tensor_id, chunk))
            block = torch.randn((hi - lo, *rest), generator=gen).mul_(self.std)
            a, b = max(lo, start), min(hi, stop)
            out[a - start : b - start] = block[a - lo : b - lo]
        pad = getattr(module, "padding_idx", None)
        if isinstance(module, nn.Embedding) and pad is not None and start <= pad < stop:
            out[pad - start].zero_()
        return out


def parameter_names(model: nn.Module) -> dict[Key, str]:
    """The full model's name of every parameter, keyed by (module, attribute) (tied parameters: the first name)."""
    names: dict[Key, str] = {}
    seen: dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            full = f"{prefix}.{attr}" if prefix else attr
            names[(id(module), attr)] = seen.setdefault(id(p), full)
    return names


def _parameters(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                yield m, attr, p


def _rows_of(p: Tensor) -> tuple[Tensor, int]:
    """(this process's tensor, its first row in the full tensor): a DTensor shard of FSDP2, or the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), int(offset[0]) if offset else 0
    return p, 0


def materialize(
    module: nn.Module,
    device: torch.device,
    weights: Weights,
    names: dict[Key, str],
    init: dict[Key, Tensor],
) -> None:
    """Allocate every parameter of ``module`` on ``device`` (only this rank's shard of an FSDP2 module) and fill it:
    from ``init`` (LoRA A), zero for other tensors without a name (LoRA B), else from ``weights``. Buffers that were
    built for real (rotary tables, label ids) survive ``to_empty``."""
    saved = {
        (id(m), n): b.detach().clone()
        for m in module.modules()
        for n, b in m._buffers.items()
        if b is not None and not b.is_meta
    }
    module.to_empty(device=device)
    with torch.no_grad():
        for m in module.modules():
            for n, b in m._buffers.items():
                if (id(m), n) in saved:
                    b.copy_(saved[(id(m), n)])
        for m, attr, p in _parameters(module):
            local, start = _rows_of(p)
            if local.numel() == 0:
                continue
            key = (id(m), attr)
            if key in init:
                local.copy_(init[key][start : start + local.shape[0]])
            elif key not in names:
                local.zero_()
            else:  # in blocks of rows, so the float32 values in flight stay small (an 8B embedding is 2.5 GB)
                step = max(1, ROWS_PER_DRAW // max(1, local[0].numel()))
                for a in range(0, local.shape[0], step):
                    b = min(a + step, local.shape[0])
                    local[a:b].copy_(weights.rows(names[key], m, attr, p.shape, start + a, start + b))


def materialize_trainable(module: nn.Module, device: torch.device, init: dict[Key, Tensor]) -> None:
    """Allocate and fill only the trainable tensors of a part this process does not run (the server's copy of θc^0);
    its frozen weights stay on the meta device."""
    with torch.no_grad():
        for m, attr, p in list(_parameters(module)):
            if p.requires_grad:
                key = (id(m), attr)
                value = init[key].to(device, p.dtype) if key in init else torch.zeros(p.shape, dtype=p.dtype)
                m._parameters[attr] = nn.Parameter(value.to(device), requires_grad=True)


def param_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the parameters materialised in this process (this rank's shards; meta tensors count nothing)."""
    total, seen = 0, set()
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            local, _ = _rows_of(p)
            if id(p) in seen or local.is_meta:
                continue
            seen.add(id(p))
            total += local.numel() * local.element_size()
    return total
