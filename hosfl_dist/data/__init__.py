"""Federated data: per-client batch streams over a partitioned training set, and the held-out evaluation split.

``data.name`` selects from :mod:`hosfl_dist.data.registry` (the image data sets and the text tasks register at the
bottom of this module; a plug-in's with :func:`~hosfl_dist.data.registry.register_task`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hosfl_dist.config import DataConfig
from hosfl_dist.data.partition import dirichlet_partition, iid_partition
from hosfl_dist.core.plugins import plugin_call, refuse
from hosfl_dist.core.seeding import Stream, generator, stream_seed
from hosfl_dist.data.registry import DataSections, TaskSpec, get_task, register_task
from hosfl_dist.data.text import CUSTOM
from hosfl_dist.data.text import TASKS as TEXT_TASKS
from hosfl_dist.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


class ClientStream:
    """Batches of one logical client: its shard, reshuffled every local epoch from its own generator.

    Depends only on (run seed, client id), so the same client yields the same batches in any process.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int) -> None:
        self.indices = torch.as_tensor(indices, dtype=torch.long)
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order = self.indices[torch.randperm(len(self.indices), generator=self.gen)]
        self.cursor = 0
        self.epoch = 0

    def next_indices(self) -> Tensor:
        out = []
        need = self.batch_size
        while need > 0:  # a shard smaller than a batch wraps around (reshuffled) so every step has B samples
            take = self.order[self.cursor : self.cursor + need]
            out.append(take)
            need -= len(take)
            self.cursor += len(take)
            if self.cursor >= len(self.order):
                self.order = self.indices[torch.randperm(len(self.indices), generator=self.gen)]
                self.cursor = 0
                self.epoch += 1
        return torch.cat(out)

    def steps_per_epoch(self) -> int:
        return max(1, -(-len(self.indices) // self.batch_size))

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order.clone(), "cursor": self.cursor, "epoch": self.epoch, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.cursor, self.epoch = state["order"].clone(), state["cursor"], state["epoch"]
        self.gen.set_state(state["gen"])


class FederatedData:
    """Training shards of M clients and the evaluation split, for any dataset that gives tensors.

    ``inputs`` is a tensor (N, ...) or a dict of such tensors; ``transform(batch_inputs, gen)`` turns stored rows
    into model inputs (normalisation, augmentation).
    """

    def __init__(
        self,
        train_inputs: Any,
        train_labels: Tensor,
        eval_inputs: Any,
        eval_labels: Tensor,
        shards: Sequence[np.ndarray],
        batch_size: int,
        seed: int,
        info: dict[str, Any],
        train_transform: Any = None,
        eval_transform: Any = None,
        row_of: Tensor | None = None,
    ) -> None:
        self.train_inputs, self.train_labels = train_inputs, train_labels
        self.eval_inputs, self.eval_labels = eval_inputs, eval_labels
        self.shards = list(shards)
        self.row_of = row_of
        """Global sample index -> row of ``train_inputs`` when this process holds some clients' shards only."""
        self.batch_size = batch_size
        _check_shards(self.shards, batch_size)
        self.seed = seed
        self.info = info
        self.train_transform = train_transform
        self.eval_transform = eval_transform
        self._streams: dict[int, ClientStream] = {}
        self._aug_gens: dict[int, torch.Generator] = {}

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    def stream(self, client: int) -> ClientStream:
        if client not in self._streams:
            self._streams[client] = ClientStream(
                self.shards[client], self.batch_size, stream_seed(self.seed, Stream.CLIENT_BATCHES, client)
            )
            self._aug_gens[client] = generator(self.seed, Stream.AUGMENT, client)
        return self._streams[client]

    def restart(self, client: int) -> None:
        """Put ``client``'s batch stream (and its augmentation generator) back at the start of the run."""
        self._streams.pop(client, None)
        self._aug_gens.pop(client, None)

    def state_dict(self, clients: Iterable[int]) -> dict[int, Any]:
        """Where each of ``clients`` stands in its batch stream (and its augmentation generator)."""
        return {m: {"stream": self.stream(m).state_dict(), "augment": self._aug_gens[m].get_state()} for m in clients}

    def load_state_dict(self, state: dict[int, Any]) -> None:
        for m, st in state.items():
            self.stream(m).load_state_dict(st["stream"])
            self._aug_gens[m].set_state(st["augment"])

    def rows(self, idx: Tensor) -> Tensor:
        """Rows of the held training tensors of global sample indices ``idx``."""
        if self.row_of is None:
            return idx
        rows = self.row_of[idx]
        if bool((rows < 0).any()):
            raise DataError("a batch of a client whose shard this process does not hold")
        return rows

    def next_batch(self, client: int) -> tuple[Any, Tensor]:
        idx = self.rows(self.stream(client).next_indices())
        x = _take(self.train_inputs, idx)
        if self.train_transform is not None:
            x = self.train_transform(x, self._aug_gens[client])
        return x, self.train_labels[idx]

    def eval_batches(self, batch_size: int) -> Iterator[tuple[Any, Tensor]]:
        n = len(self.eval_labels)
        for start in range(0, n, batch_size):
            idx = torch.arange(start, min(n, start + batch_size))
            x = _take(self.eval_inputs, idx)
            if self.eval_transform is not None:
                x = self.eval_transform(x, None)
            yield x, self.eval_labels[idx]


def _take(inputs: Any, idx: Tensor) -> Any:
    if isinstance(inputs, dict):
        return {k: v[idx] for k, v in inputs.items()}
    return inputs[idx]


def _check_shards(shards: Sequence[np.ndarray], batch_size: int) -> None:
    """An empty shard cannot give a batch (refused); a shard smaller than a batch repeats samples in one step
    (allowed, e.g. for tiny tests, but said once)."""
    sizes = [len(s) for s in shards]
    if sizes and min(sizes) == 0:
        raise DataError(f"client {sizes.index(0)} has no training samples: use fewer clients (clients.total)")
    small = [m for m, n in enumerate(sizes) if n < batch_size]
    if small:  # one line in the run's log (no source line, as a Python warning would add)
        logger.warning(
            f"clients.batch_size={batch_size} is larger than the training samples of {len(small)} of the "
            f"{len(sizes)} clients (the fewest: client {min(small, key=sizes.__getitem__)}, {min(sizes)} samples): "
            "their batches repeat samples within a step; lower clients.batch_size or clients.total, or train on "
            "more data"
        )


def partition(labels: Tensor, data: DataConfig, total: int, seed: int) -> list[np.ndarray]:
    """The training samples' indices of each of ``total`` clients (``data.partition``), drawn from ``seed``
    (job.seed)."""
    seed = stream_seed(seed, Stream.PARTITION)
    if data.partition == "dirichlet":
        return dirichlet_partition(labels.numpy(), total, data.alpha, seed)
    return iid_partition(len(labels), total, seed)


VISION_INFO = {
    "fashion_mnist": (10, (1, 28, 28)),
    "cifar10_npz": (10, (3, 32, 32)),
    "cifar10": (10, (3, 32, 32)),
    "cifar100": (100, (3, 32, 32)),
}
"""(classes, image shape) of the image data sets, so a server builds its model without loading images."""


def data_info(cfg: DataSections) -> dict[str, Any]:
    """What the model builders need from the data (classes, input shape, label words; a plug-in task's own loss and
    metrics as ``scorer``), without loading the data: a server loads no training data."""
    _check_sections(cfg, "data_info")
    task = get_task(cfg.data.name)
    if task.info is not None:
        with plugin_call(task.info, f"task {task.name}: info(data sections)"):
            info = task.info(cfg)
        return {**info, **task.scoring()}
    if task.load is not None:  # loaded only for its shape (synthetic images are generated, a plug-in's as it says)
        return {**select(_load(task, cfg.data, cfg.seed), cfg.data, cfg.seed).info, **task.scoring()}
    with plugin_call(task.build, f"task {task.name}: build(data sections, clients, evaluation)"):
        return task.build(cfg, [], False).info


def _check_sections(given: Any, what: str) -> None:
    if not isinstance(given, DataSections):
        raise TypeError(f"{what} takes hosfl_dist.data.DataSections (hosfl_dist.runtime.build.data_sections(cfg) of a "
                        f"run's config), not {type(given).__name__}")  # fmt: skip


def _load(task: TaskSpec, data: DataConfig, seed: int) -> TensorData:
    """A vision task's examples, from its ``load``."""
    assert task.load is not None
    what = f"task {task.name}: load(data section, job.seed)"
    with plugin_call(task.load, what):
        data = task.load(data, seed)
    if not isinstance(data, TensorData):
        raise refuse(task.load, what, f"gave {type(data).__name__}, not a hosfl_dist.data.TensorData")
    return data


def input_sources(data: DataConfig) -> dict[str, Any]:
    """What the configured data is read from, by role: a local file's path (``data.train`` / ``data.eval`` for text,
    ``data.files[i]`` for images), or for the hub the data set's name and splits (``data.hub``). Generated data reads
    nothing. A run's identity hashes these files (:mod:`hosfl_dist.runfolder.identity`)."""
    task = get_task(data.name)
    if task.inputs is None:
        return {}
    with plugin_call(task.inputs, f"task {task.name}: inputs(data section)"):
        return task.inputs(data)


def build_data(cfg: DataSections, clients: Sequence[int] | None = None, evaluation: bool = True) -> FederatedData:
    """Load the configured dataset from local files and partition it over ``clients.total`` clients.

    ``clients``: the clients whose shards this process holds (default: all); ``evaluation``: whether it holds the
    evaluation split (the leader worker and the in-process runtime). Text is tokenised for those only (the task's own
    ``build``: hosfl_dist.data.text_fed); tensors are read whole (the files are small) and the rows of other clients
    dropped.
    """
    _check_sections(cfg, "build_data")
    task = get_task(cfg.data.name)
    if task.build is not None:
        with plugin_call(task.build, f"task {task.name}: build(data sections, clients, evaluation)"):
            return task.build(cfg, clients, evaluation)
    data = select(_load(task, cfg.data, cfg.seed), cfg.data, cfg.seed)
    tx, ty, vx, vy = data.train_x, data.train_y, data.eval_x, data.eval_y
    shards = partition(ty, cfg.data, cfg.clients.total, cfg.seed)
    row_of = None
    if clients is not None:
        rows = torch.as_tensor(np.unique(np.concatenate([shards[m] for m in clients] or [np.zeros(0, np.int64)])))
        row_of = torch.full((len(ty),), -1, dtype=torch.long)
        row_of[rows] = torch.arange(len(rows))
        tx, ty = tx[rows], ty[rows]
    if not evaluation:
        vx, vy = vx[:0], vy[:0]
    train_tf, eval_tf = data.train_transform, data.eval_transform
    info = {**data.info, **task.scoring()}
    return FederatedData(
        tx, ty, vx, vy, shards, cfg.clients.batch_size, cfg.seed, info, train_tf, eval_tf, row_of=row_of
    )


Transform = Callable[[Tensor, "torch.Generator | None"], Tensor]
"""Stored rows -> model inputs of a batch (the generator: the client's augmentation stream; None in evaluation)."""


@dataclass
class TensorData:
    """A task's examples as tensors, as its ``load`` gives them (:class:`~hosfl_dist.data.registry.TaskSpec`), not yet
    partitioned over clients."""

    train_x: Tensor
    """(N, ...) one row per training sample (images: (N, C, H, W) uint8)."""
    train_y: Tensor
    """(N,) int64 class labels, 0..num_classes-1."""
    eval_x: Tensor
    """The held-out samples, as train_x."""
    eval_y: Tensor
    """Their labels."""
    num_classes: int = 0
    """Classes of the task (0: one more than the largest label)."""
    train_transform: Transform | None = None
    """Stored rows -> model inputs of a training batch (images: augmentation from the generator, normalisation);
    None: the rows as stored."""
    eval_transform: Transform | None = None
    """The same for an evaluation batch."""

    def __post_init__(self) -> None:
        if self.train_y.dtype != torch.long or self.eval_y.dtype != torch.long:
            raise DataError(f"labels must be int64 class indices, got {self.train_y.dtype} / {self.eval_y.dtype}")
        if len(self.train_x) != len(self.train_y) or len(self.eval_x) != len(self.eval_y):
            raise DataError(f"{len(self.train_x)} / {len(self.eval_x)} training / held-out samples for "
                            f"{len(self.train_y)} / {len(self.eval_y)} labels")  # fmt: skip
        if not self.num_classes:
            self.num_classes = int(max(self.train_y.max(initial=0), self.eval_y.max(initial=0))) + 1

    @property
    def info(self) -> dict[str, Any]:
        """num_classes, input_shape (one sample's), train_size, eval_size."""
        return {"num_classes": self.num_classes, "input_shape": tuple(self.train_x.shape[1:]),
                "train_size": len(self.train_y), "eval_size": len(self.eval_y)}  # fmt: skip


def select(data: TensorData, config: DataConfig, seed: int) -> TensorData:
    """``data.classes`` kept and relabelled 0..n-1 in their order, then ``data.train_max_samples`` (a subset drawn
    from ``seed``, job.seed) and ``data.eval_max_samples`` (the first ones) applied."""
    from hosfl_dist.data.vision import select_classes

    tx, ty, vx, vy, num_classes = data.train_x, data.train_y, data.eval_x, data.eval_y, data.num_classes
    if config.classes:
        (tx, ty), (vx, vy) = (select_classes(x, y, config.classes, num_classes) for x, y in ((tx, ty), (vx, vy)))
        num_classes = len(config.classes)
    if config.train_max_samples:
        keep = torch.randperm(len(ty), generator=generator(seed, Stream.TRAIN_SUBSET))
        keep = keep[: config.train_max_samples].sort().values
        tx, ty = tx[keep], ty[keep]
    if config.eval_max_samples:
        vx, vy = vx[: config.eval_max_samples], vy[: config.eval_max_samples]
    return TensorData(tx, ty, vx, vy, num_classes, data.train_transform, data.eval_transform)


def load_vision_data(data: DataConfig, seed: int) -> TensorData:
    """The configured data set's examples as tensors, with ``data.classes`` and the subsets applied (:func:`select`):
    what the federated runs (:func:`build_data`) partition and centralised pretraining
    (hosfl_dist.experiments.pretrain) trains on."""
    task = get_task(data.name)
    if task.load is None:
        raise ConfigError(f"invalid value for data.name: {data.name!r} (a text task: it is tokenised for an LM)")
    return select(task.load(data, seed), data, seed)


def _load_images(data: DataConfig, seed: int) -> TensorData:
    """An image data set from local files (synthetic: generated from ``seed``), normalised with its statistics;
    ``data.augment`` adds random crops and flips to the training batches."""
    from hosfl_dist.data.vision import augment, load_images, normalize

    splits = load_images(data.name, data.root, seed)
    mean, std = splits.mean, splits.std
    use_aug = data.augment

    def train_tf(x: Tensor, gen: torch.Generator | None) -> Tensor:
        if use_aug and gen is not None:
            x = augment(x, gen)
        return normalize(x, mean, std)

    def eval_tf(x: Tensor, gen: torch.Generator | None) -> Tensor:
        return normalize(x, mean, std)

    return TensorData(splits.train_x, splits.train_y, splits.test_x, splits.test_y, splits.num_classes, train_tf,
                      eval_tf)  # fmt: skip


def _image_info(cfg: DataSections) -> dict[str, Any]:
    classes, shape = VISION_INFO[cfg.data.name]
    return {"num_classes": len(cfg.data.classes) or classes, "input_shape": shape}  # data.classes: the kept ones


def _image_inputs(data: DataConfig) -> dict[str, Any]:
    from hosfl_dist.data.vision import image_files

    return {f"data.files[{i}]": str(f) for i, f in enumerate(image_files(data.name, data.root))}


def _text_info(cfg: DataSections) -> dict[str, Any]:
    from hosfl_dist.data.text_fed import text_data_info

    return text_data_info(cfg.data, cfg.model)


def _text_inputs(data: DataConfig) -> dict[str, Any]:
    from hosfl_dist.data.text_fed import hub_splits, text_files

    files = text_files(data)
    if files is None:
        return {"data.hub": hub_splits(data)}
    return {"data.train": files[0], "data.eval": files[1]}


def _build_text(cfg: DataSections, clients: Sequence[int] | None, evaluation: bool) -> FederatedData:
    """Tokenised with the model's tokenizer (hosfl_dist.data.text_fed)."""
    from hosfl_dist.data.text_fed import build_text_data

    return build_text_data(cfg, clients, evaluation)


for _name in DataConfig.CLASSES:  # the image data sets (synthetic: generated, its shape read off the tensors)
    register_task(TaskSpec(_name, _load_images, _image_info if _name in VISION_INFO else None, _image_inputs))
for _name in (*TEXT_TASKS, "sentiment_multiemo", CUSTOM):
    register_task(TaskSpec(_name, info=_text_info, inputs=_text_inputs, family="hf", build=_build_text))
