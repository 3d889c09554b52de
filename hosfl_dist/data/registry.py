"""The registry that ``data.name`` selects from: the package's tasks (the image data sets, the text tasks) and a
plug-in's.

A task of the ``vision`` family gives its examples as tensors (:class:`~hosfl_dist.data.TensorData`, from its
``load``); the package keeps ``data.classes``, draws ``data.train_max_samples`` / ``data.eval_max_samples``,
partitions the training set over the clients (``data.partition``) and batches it, and the server scores it as
classification (cross-entropy, accuracy). A task of the ``hf`` family builds its own tokenised data (``build``) for a
decoder LM. A plug-in (``job.plugins``, ``--plugin``) registers its own with :func:`register_task`; the config check,
both runtimes and the run's identity then know it like the package's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hosfl_dist.core.registry import Registry

if TYPE_CHECKING:
    from hosfl_dist.config import Config, DataConfig
    from hosfl_dist.data import FederatedData, TensorData

TASK_FAMILIES = ("vision", "hf")
"""The model family a task feeds (``model.name`` of that family, :mod:`hosfl_dist.models.registry`)."""


@dataclass(frozen=True)
class TaskSpec:
    name: str
    """``data.name``."""
    load: Callable[[DataConfig, int], TensorData] | None = None
    """(data section, job.seed) -> every example as tensors, before ``data.classes`` and the subsets are applied (the
    package applies them). Called in each process that holds data, so it must give the same tensors each time."""
    info: Callable[[Config], dict[str, Any]] | None = None
    """What the model builders need (``num_classes``, ``input_shape``) without loading the data, for a server that
    loads none; None: ``load`` it and read it off the tensors."""
    inputs: Callable[[DataConfig], dict[str, Any]] | None = None
    """The files it reads, by role (``{"data.train": path}``): a run's identity hashes them. None: none."""
    family: str = "vision"
    """One of :data:`TASK_FAMILIES`."""
    build: Callable[[Config, Sequence[int] | None, bool], FederatedData] | None = None
    """Instead of ``load``: (config, hosted clients or None for all, holds the evaluation split) -> the federated
    data, built and partitioned by the task itself (the text tasks)."""

    def __post_init__(self) -> None:
        if self.family not in TASK_FAMILIES:
            raise ValueError(f"task {self.name!r}: family {self.family!r} is not one of {list(TASK_FAMILIES)}")
        if (self.load is None) == (self.build is None):
            raise ValueError(f"task {self.name!r}: give load (tensors the package partitions) or build, not both")


_TASKS: Registry[TaskSpec] = Registry("task", "data.name")


def register_task(spec: TaskSpec) -> TaskSpec:
    """Add ``spec`` under ``spec.name`` (ValueError for a name taken by another task)."""
    return _TASKS.add(spec.name, spec)


def task_names() -> list[str]:
    """Every registered ``data.name``, the package's and the imported plug-ins'."""
    return _TASKS.names()


def get_task(name: str) -> TaskSpec:
    """The spec registered under ``name``; ConfigError listing the names otherwise."""
    return _TASKS.get_or_refuse(name)
