"""The algorithms, one module each, and the registry that ``algorithm.name`` selects from.

Every module of this package that defines a method ends with ``register(AlgorithmSpec(...))``: the server and worker
classes and what the rest of the code asks about the method (does its client back-propagate, which model parts each
role holds, which traffic it may send, which models it supports). The registry finds the modules by listing this
package, so adding a method is one new module (plus its tests); nothing else names it. A method outside the package
registers itself the same way from a module of the user's, a plug-in (``job.plugins``, ``--plugin``) that
:func:`load_plugins` imports before the config is checked.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass

from hosfl_dist.core.registry import Registry
from hosfl_dist.errors import ConfigError

MODEL_PARTS = ("client", "server")
"""f_c and f_s. A role that does not need a part drops it after the model is built."""
FAMILIES = ("vision", "hf")
"""Model families: the vision models (small_cnn, conv_mlp, resnet18) and Hugging Face decoder LMs."""


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    """``algorithm.name``."""
    server: type
    """Lives on rank 0 (or in-process): θs, its optimizer and the method's history; its @wire methods are the only
    client -> server calls."""
    worker: type
    """A client worker: runs rounds for the logical clients it hosts."""
    zeroth_order_client: bool
    """The client estimates gradients from forward differences: its part runs without dropout (z and the perturbed
    z̃ must differ by the perturbation alone) and never builds an autograd graph."""
    traffic: frozenset[str]
    """The paper's traffic categories (Table 5) the method may send; ``control`` and ``eval`` are always allowed."""
    worker_parts: tuple[str, ...] = ("client",)
    """Model parts a client worker holds ("server" too when the client derives something from f_s)."""
    server_parts: tuple[str, ...] = ("server",)
    """Model parts the server holds ("client" too when it keeps θc^t, i.e. methods that aggregate client models)."""
    families: tuple[str, ...] = FAMILIES
    """Model families the method supports."""
    needs_lora: bool = False
    """Trains LoRA adapters on both sides (model.name=hf with client and server targets)."""
    skips_nonfinite: bool = False
    """Can leave a client with a non-finite upload out of a round (``train.on_nonfinite=skip``); else it stops."""
    batches_perturbations: bool = False
    """Can run its perturbed forwards batched (``zo.perturb_batch`` > 1); else that is refused."""
    batches_clients: bool = False
    """Can run a worker's clients of a round in one pass (``zo.batch_clients``); else that is refused."""
    compiles_client: bool = False
    """Can run its client's zeroth-order forwards through ``torch.compile`` (``zo.compile``); else that is refused."""
    zo_estimator: bool = False
    """Draws its perturbations and rebuilds its updates through ``zo.estimator``
    (:func:`~hosfl_dist.core.estimators.build_estimator`); else an estimator other than the default is refused."""
    lr_schedules: bool = False
    """Follows ``optim.schedule`` and ``optim.warmup_rounds`` (its optimizers step once a round); else they are
    refused."""
    drops_clients: bool = False
    """Can run rounds that not every sampled client finishes (``clients.dropout``, ``clients.over_select``,
    ``clients.participation``: docs/participation.md); else those are refused."""
    uploads_perturbed_pair: bool = False
    """The server takes the difference of two uploaded activations (z₊ − z₋): their rounding to a half-precision
    model.dtype bounds μ from below (``ZOConfig.precision_problem``)."""

    def __post_init__(self) -> None:
        from hosfl_dist.transport.wire import CONTROL, EVAL, wire_specs

        for method, spec in wire_specs(self.server).items():
            stray = spec.categories() - self.traffic - {CONTROL, EVAL}
            if stray:
                raise ValueError(
                    f"{self.name}: {self.server.__name__}.{method} sends {sorted(stray)} outside its traffic"
                )
        from hosfl_dist.algorithms.base import ServerBase

        called = getattr(self.worker, "server_class", None)  # ServerBase: WorkerBase's, which declares no call
        if not (isinstance(called, type) and called is not ServerBase and issubclass(self.server, called)):
            raise ValueError(
                f"{self.name}: {self.worker.__name__} calls {getattr(called, '__name__', called)}, not "
                f"the registered server {self.server.__name__} (set {self.worker.__name__}.server_class)"
            )
        for part in (*self.worker_parts, *self.server_parts):
            if part not in MODEL_PARTS:
                raise ValueError(f"{self.name}: unknown model part {part!r}")


_REGISTRY: Registry[AlgorithmSpec] = Registry("algorithm", "algorithm.name")
_SKIP = frozenset({"base", "exchange", "participation"})
"""Modules of this package that hold shared parts, not methods."""


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    return _REGISTRY.add(spec.name, spec)


def _discover() -> None:
    """Import every method module of this package, once (a study checks thousands of configs: each lookup would scan
    the package's folder again, and an imported module registers nothing new)."""
    global _discovered
    if _discovered:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in _SKIP:
            importlib.import_module(f"{__name__}.{mod.name}")
    _discovered = True


_discovered = False


def load_plugins(modules: list[str] | tuple[str, ...], key: str = "job.plugins") -> list[str]:
    """Import the user's plug-in modules (each registers what it defines, e.g. a method with :func:`register`);
    returns the method names they added. One that cannot be imported is a ConfigError naming it and why."""
    _discover()  # the package's own first: a plug-in's name that clashes with one of them is refused by register
    before = set(_REGISTRY)
    for module in modules:
        if module in sys.modules:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever the module raises, the user's input is what failed
            sys.modules.pop(module, None)
            raise ConfigError(f"{key}: cannot import plug-in {module!r} ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None  # fmt: skip
    return sorted(set(_REGISTRY) - before)


def algorithm_names() -> list[str]:
    """Every registered ``algorithm.name``."""
    _discover()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec registered under ``name``; ConfigError listing the names otherwise."""
    if name not in _REGISTRY:
        _discover()
    return _REGISTRY.get_or_refuse(name)
