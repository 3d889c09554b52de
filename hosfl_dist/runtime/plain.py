"""What a checkpoint's files may hold, and reading them without running code from them.

``state.pt`` holds plain data only (tensors, dicts, lists, tuples, str, int, float, bool, None, bytes:
:func:`check_plain` at every save) and is read with ``torch.load(weights_only=True)`` (:func:`read_state`).
DCP's ``model/.metadata`` is a pickle that torch's own reader loads unrestricted: it is read here by an unpickler that
admits DCP's metadata records, ``torch.Size`` and dtypes alone (:class:`MetadataUnpickler`), and DCP's non-tensor
items (the optimizer's hyperparameters) with ``weights_only=True`` (:func:`safe_dcp`). A file that holds anything
else is refused before any of it runs.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from hosfl_dist.errors import ConfigError

PLAIN = (str, int, float, bool, type(None), bytes)
"""The scalars state.pt may hold beside tensors (exactly these types: a subclass would be pickled by its name)."""


def check_plain(obj: Any, where: str = "state") -> None:
    """Refuse (TypeError naming where) anything in ``obj`` but tensors, dicts, lists, tuples and :data:`PLAIN`
    scalars: what ``torch.load(weights_only=True)`` reads back without naming any type."""
    if type(obj) in PLAIN:
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            raise TypeError(f"{where}: a {type(obj).__name__}, not a plain tensor")
        return
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: a key of type {type(k).__name__}")
            check_plain(v, f"{where}.{k}")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__}, which state.pt does not hold "
                    "(tensors, dicts, lists, tuples, str, int, float, bool, None only)")  # fmt: skip


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.pt``, read without running code (``weights_only=True``); ConfigError in one line for
    one that holds anything but plain data (never written by this version)."""
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only refusals, a torn zip, anything torch cannot read
        raise ConfigError(f"checkpoint {path}: state.pt is not plain data this version wrote, refused unread "
                          f"({_why_refused(exc)})") from None  # fmt: skip
    if not isinstance(state, dict) or not {"server", "loop", "workers", "rng"} <= set(state):
        raise ConfigError(f"checkpoint {path}: state.pt does not hold a checkpoint's state")
    return state


def _dcp_globals() -> dict[tuple[str, str], Any]:
    """The only names a DCP ``.metadata`` pickle may ask for: DCP's own metadata records, torch.Size, a path, a
    layout by its name (dtypes are admitted by :class:`MetadataUnpickler` as they are looked up)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
             "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")  # fmt: skip
    return {
        **{(metadata.__name__, n): getattr(metadata, n) for n in names},
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }


class MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` (a pickle, which torch's reader would load unrestricted) admitting only
    :func:`_dcp_globals` and torch's dtypes: a crafted one is refused, never run."""

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_globals().get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"model/.metadata asks for {module}.{name}")
        return found


def safe_dcp(path: Path) -> dict[str, Any]:
    """A DCP reader and planner that run no code from the checkpoint: the metadata through
    :class:`MetadataUnpickler`, the non-tensor items (the optimizer's hyperparameters) with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                found = MetadataUnpickler(f).load()
            if getattr(found, "storage_meta", None) is None:
                found.storage_meta = StorageMeta()
            found.storage_meta.load_id = self.load_id
            return found

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return {"storage_reader": Reader(str(path)), "planner": Planner()}


def _why_refused(exc: Exception) -> str:
    """torch's weights_only refusal in a few words: the global it would have imported (``builtins.open``), not its
    paragraph of advice to load the file anyway; any other failure by its first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch bolds part of its advice with terminal escapes
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand (\d+)", text)
    if found:
        return f"it would import {found.group(1)}" if "GLOBAL" in found.group(0) else found.group(0)
    return (text.strip().splitlines() or [type(exc).__name__])[0][:200]
