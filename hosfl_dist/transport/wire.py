"""What crosses a boundary, declared once: traffic categories (the paper's Table 5) and the calls' ordering rules.

Every client -> server call is a server method declared with :func:`wire`:

- **traffic**: which argument and which result field belongs to which category. Transports (in-process, RPC, the
  emulated link) count the bytes of exactly the tensors they move, per logical client, from this declaration, so
  every runtime reports the same totals for the same run;
- **ordering**, enforced by :class:`hosfl_dist.transport.endpoint.ServerEndpoint` for every runtime alike:
  ``after_previous_round`` (the call reads what round t−1 produced, so it waits until round t−1 is closed),
  ``gather`` (the round's calls from its K clients are collected and the method runs once with all of them, in
  client-id order whatever the arrival order), ``closes_round`` (once it ran, round t is closed);
- **live rounds** (:mod:`hosfl_dist.runtime.gate`): ``arrives`` (a client's first call of a round, where a round
  decided by who answers in time counts it) and ``aggregates`` (the call the gate makes with the round's
  client-side aggregate to close it).

How a call executes (one rank, a server group) is the runtime's, never the declaration's.

A server side may serve calls from more than one object (the algorithm's server and the evaluation server of
:mod:`hosfl_dist.evaluation`): the lookups below take a class or a tuple of classes.

Client <-> client aggregation is declared with an :class:`Exchange` and counted by the collective that carries it.
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

    def state_dict(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"bytes": dict(self.bytes), "messages": dict(self.messages)}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        with self._lock:
            self.bytes, self.messages = dict(state["bytes"]), dict(state["messages"])


@dataclasses.dataclass(frozen=True)
class WireSpec:
    """How one server method is reached: its traffic categories and its ordering rules."""

    args: Mapping[str, str]
    """Argument name -> category of the bytes it carries up."""
    result: Mapping[str, str]
    """Result field -> category of the bytes it carries down ("*": the whole result)."""
    after_previous_round: bool = False
    """A call about round t runs only once round t−1 is closed (it reads what that round produced)."""
    gather: bool = False
    """Calls ``(t, client, **fields)`` are collected until the round's clients all called; the method then runs once
    as ``method(t, batch)`` with ``batch = {client: fields}`` and returns ``{client: result}``."""
    closes_round: bool = False
    """Round t is closed once this call ran (held ``after_previous_round`` calls of round t+1 are released)."""
    arrives: bool = False
    """A sampled client's first call of a round: where a live round (decided by who answers in time) counts it
    (:mod:`hosfl_dist.runtime.gate`)."""
    aggregates: str = ""
    """The argument that takes the round's client-side aggregate, where a live round's gate computes it and makes
    this call to close the round (HO-SFL's ``finish_round(t, scalars=v̄)``)."""

    def categories(self) -> set[str]:
        return set(self.args.values()) | set(self.result.values())


def wire(
    args: Mapping[str, str] | None = None,
    result: Mapping[str, str] | str | None = None,
    *,
    after_previous_round: bool = False,
    gather: bool = False,
    closes_round: bool = False,
    arrives: bool = False,
    aggregates: str = "",
) -> Callable:
    """Declare a server method as a client -> server call (see :class:`WireSpec`)."""
    res = {"*": result} if isinstance(result, str) else dict(result or {})
    spec = WireSpec(dict(args or {}), res, after_previous_round, gather, closes_round, arrives, aggregates)

    def deco(fn: Callable) -> Callable:
        fn.__wire__ = spec
        return fn

    return deco


Served = type | tuple[type, ...]
"""The class (or classes, first match wins) whose declared calls a server side serves."""


def _classes(served: Served) -> tuple[type, ...]:
    return served if isinstance(served, tuple) else (served,)


def wire_spec(served: Served, method: str) -> WireSpec:
    """The declaration of ``method`` on the served class(es); AttributeError for anything that is not a declared
    call."""
    for cls in _classes(served):
        spec = getattr(getattr(cls, method, None), "__wire__", None)
        if isinstance(spec, WireSpec):
            return spec
    names = "/".join(c.__name__ for c in _classes(served))
    raise AttributeError(f"{names}.{method} is not a server method declared with @wire")


def wire_specs(served: Served) -> dict[str, WireSpec]:
    """Every declared call of the served class(es)."""
    out: dict[str, WireSpec] = {}
    for cls in reversed(_classes(served)):  # the first class's declaration wins
        for name in dir(cls):
            spec = getattr(getattr(cls, name, None), "__wire__", None)
            if isinstance(spec, WireSpec):
                out[name] = spec
    return out


def declared_call(targets: tuple[Any, ...], method: str) -> Callable[..., Any]:
    """The bound method ``method`` of the first of ``targets`` that declares it (AttributeError otherwise)."""
    for target in targets:
        if isinstance(getattr(getattr(type(target), method, None), "__wire__", None), WireSpec):
            return getattr(target, method)
    wire_spec(tuple(type(t) for t in targets), method)  # raises, naming the classes
    raise AssertionError("unreachable")


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


@dataclasses.dataclass(frozen=True)
class Exchange:
    """A client <-> client aggregation: what each contributing client sends up and receives back.

    The collective that carries it counts, per contributing client, the bytes of its contribution under ``up`` and
    the bytes of the aggregate it receives under ``down`` — what the modelled system moves (HO-SFL: P scalars up,
    v̄ down), whatever buffer the implementation reduces (a K×P matrix among worker processes).
    """

    name: str
    up: str
    down: str

    def count(self, meter: CommMeter, contribution: torch.Tensor, aggregate: torch.Tensor) -> None:
        meter.add(self.up, payload_bytes(contribution))
        meter.add(self.down, payload_bytes(aggregate))
