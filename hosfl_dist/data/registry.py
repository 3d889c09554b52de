"""The registry that ``data.name`` selects from: the package's tasks (the image data sets, the text tasks) and a
plug-in's.

A task of the ``vision`` family gives its examples as tensors (:class:`~hosfl_dist.data.TensorData`, from its
``load``); the package keeps ``data.classes``, draws ``data.train_max_samples`` / ``data.eval_max_samples``,
partitions the training set over the clients (``data.partition``) and batches it, and the server scores it as
classification: cross-entropy and ``eval_accuracy``, or the task's own ``loss``, and its ``metrics`` beside them. A
task of the ``hf`` family builds its own tokenised data (``build``) for a decoder LM. A plug-in (``job.plugins``,
``--plugin``) registers its own with :func:`register_task`; the config check, both runtimes and the run's identity
then know it like the package's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hosfl_dist.core.registry import Registry
from hosfl_dist.tasks.classification import ClassificationTask, Loss, Score

if TYPE_CHECKING:
    from hosfl_dist.config import ClientsConfig, DataConfig, ModelConfig
    from hosfl_dist.data import FederatedData, TensorData

TASK_FAMILIES = ("vision", "hf")
"""The model family a task feeds (``model.name`` of that family, :mod:`hosfl_dist.models.registry`)."""


@dataclass(frozen=True)
class DataSections:
    """The sections of a run's config its data is built from (``runtime.build.data_sections(cfg)``): a task's
    ``info`` and ``build`` receive it."""

    data: DataConfig
    model: ModelConfig
    """A text task tokenises with the model's tokenizer."""
    clients: ClientsConfig
    """``total`` (the partition) and ``batch_size``."""
    seed: int
    """``job.seed``: subsets, partition and batch order draw from it."""


@dataclass(frozen=True)
class TaskSpec:
    name: str
    """``data.name``."""
    load: Callable[[DataConfig, int], TensorData] | None = None
    """(data section, job.seed) -> every example as tensors, before ``data.classes`` and the subsets are applied (the
    package applies them). Called in each process that holds data, so it must give the same tensors each time."""
    info: Callable[[DataSections], dict[str, Any]] | None = None
    """What the model builders need (``num_classes``, ``input_shape``) without loading the data, for a server that
    loads none; None: ``load`` it and read it off the tensors."""
    inputs: Callable[[DataConfig], dict[str, Any]] | None = None
    """The files it reads, by role (``{"data.train": path}``): a run's identity hashes them. None: none."""
    family: str = "vision"
    """One of :data:`TASK_FAMILIES`."""
    build: Callable[[DataSections, Sequence[int] | None, bool], FederatedData] | None = None
    """Instead of ``load``: (data sections, hosted clients or None for all, holds the evaluation split) -> the federated
    data, built and partitioned by the task itself (the text tasks)."""
    loss: Loss | None = None
    """A ``vision`` task's training loss: (outputs (B, C), labels (B,)) -> (B,) per-sample loss, a differentiable torch
    function; the server trains on its mean (λ = ∂ℓ/∂z) and reports it as ``eval_loss``. None: cross-entropy."""
    metrics: Mapping[str, Score] = field(default_factory=dict)
    """A ``vision`` task's own evaluation metrics: name (``eval_...``) -> (outputs, labels) -> (B,) per-sample score;
    each is the mean over the held-out samples, written beside ``eval_accuracy`` and ``eval_loss``."""

    def __post_init__(self) -> None:
        if self.family not in TASK_FAMILIES:
            raise ValueError(f"task {self.name!r}: family {self.family!r} is not one of {list(TASK_FAMILIES)}")
        if (self.load is None) == (self.build is None):
            raise ValueError(f"task {self.name!r}: give load (tensors the package partitions) or build, not both")
        if (self.loss is not None or self.metrics) and self.family != "vision":
            raise ValueError(f"task {self.name!r}: loss and metrics are for the vision family (hf ones score alone)")
        for name in self.metrics:
            if not name.startswith("eval_") or name in ("eval_loss", "eval_accuracy"):
                raise ValueError(f"task {self.name!r}: metric {name!r} must be named eval_<something> other than "
                                 "eval_loss and eval_accuracy (the metrics rows' own)")  # fmt: skip

    def scoring(self) -> dict[str, Any]:
        """What the model builders attach to a vision split (``data_info``'s ``scorer``; a text task's ``task`` is its
        name): the task's loss and metrics, or nothing for the package's default (cross-entropy, accuracy)."""
        if self.loss is None and not self.metrics:
            return {}
        return {"scorer": ClassificationTask(self.loss, self.metrics, self.name)}


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
