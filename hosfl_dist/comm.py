"""Communication accounting by the paper's categories (Table 5), from the tensors that actually cross a boundary.

Every client<->server call is declared with :func:`wire`: which argument and which result field belongs to which
category. Transports (in-process or RPC) count the bytes of exactly the tensors they move, per logical client, so
both engines report the same totals for the same run. Client<->client aggregation is counted where it happens.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

UPLINK_ACTIVATIONS = "uplink_activations"
UPLINK_MODEL = "uplink_model"
UPLINK_SCALARS = "uplink_scalars"
DOWNLINK_GRADIENTS = "downlink_gradients"
DOWNLINK_MODEL = "downlink_model"
DOWNLINK_SCALARS_SEEDS = "downlink_scalars_seeds"
PAPER_CATEGORIES = (
    UPLINK_ACTIVATIONS,
    UPLINK_MODEL,
    UPLINK_SCALARS,
    DOWNLINK_GRADIENTS,
    DOWNLINK_MODEL,
    DOWNLINK_SCALARS_SEEDS,
)
# Not part of training traffic in the paper's table, but sent all the same: reported beside it.
CONTROL = "control"
EVAL = "eval"
CATEGORIES = PAPER_CATEGORIES + (CONTROL, EVAL)


def payload_bytes(obj: Any) -> int:
    """Bytes of all tensors inside ``obj`` (tensors, lists, tuples, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


class CommMeter:
    """Thread-safe byte counters per category (and message counts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.messages = dict.fromkeys(CATEGORIES, 0)

    def add(self, category: str, nbytes: int, messages: int = 1) -> None:
        if category not in self.bytes:
            raise KeyError(f"unknown traffic category {category!r}")
        with self._lock:
            self.bytes[category] += int(nbytes)
            self.messages[category] += messages

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.bytes)

    def merge(self, totals: Mapping[str, int]) -> None:
        for k, v in totals.items():
            self.add(k, v, messages=0)

    def training_total(self) -> int:
        return sum(self.bytes[c] for c in PAPER_CATEGORIES)


@dataclasses.dataclass(frozen=True)
class WireSpec:
    """Categories of a server method's arguments and of its result's fields (a field name or "*" for all)."""

    args: Mapping[str, str]
    result: Mapping[str, str]


def wire(args: Mapping[str, str] | None = None, result: Mapping[str, str] | str | None = None) -> Callable:
    """Declare how a server method's traffic is categorised; transports read it from ``method.__wire__``."""
    res = {"*": result} if isinstance(result, str) else dict(result or {})

    def deco(fn: Callable) -> Callable:
        fn.__wire__ = WireSpec(dict(args or {}), res)
        return fn

    return deco


def count_call(meter: CommMeter, spec: WireSpec, kwargs: Mapping[str, Any]) -> None:
    for name, cat in spec.args.items():
        if name in kwargs:
            meter.add(cat, payload_bytes(kwargs[name]))


def count_result(meter: CommMeter, spec: WireSpec, result: Any) -> None:
    if not spec.result:
        return
    if "*" in spec.result:
        meter.add(spec.result["*"], payload_bytes(result))
        return
    if isinstance(result, Mapping):
        fields = result
    else:  # a dataclass; asdict would deep-copy the tensors
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    for name, cat in spec.result.items():
        if name in fields:
            meter.add(cat, payload_bytes(fields[name]))
