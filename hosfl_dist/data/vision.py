"""Image datasets read from local files (no downloads): Fashion-MNIST IDX, the offline CIFAR-10 test images,
torchvision-format CIFAR-10/100 folders, and a small synthetic set for tests.

Each loader returns uint8 images (N, C, H, W) and int64 labels for a train and a held-out split.
"""

from __future__ import annotations

import gzip
import importlib
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hosfl_dist.errors import DataError

FASHION_MNIST_DEFAULT = "/usr/share/datasets/fashion-mnist"
# (mean, std) per channel on [0, 1] pixels.
STATS = {
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@dataclass
class ImageSplits:
    train_x: Tensor  # (N, C, H, W) uint8
    train_y: Tensor  # (N,) int64
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def shared_data_dir() -> Path:
    """``shared/data`` beside the checkout (the project's offline data), found from the package location or cwd."""
    here = Path(__file__).resolve()
    cands = (here.parents[3] / "shared" / "data", Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data")
    for cand in cands:
        if cand.is_dir():
            return cand
    return here.parents[3] / "shared" / "data"


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:  # a truncated or corrupt .gz ends here
        raise DataError(f"{path}: cannot be read ({exc})") from None
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes, not an IDX file (truncated?)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08 or not 1 <= ndim <= 4:
        raise DataError(f"{path} is not an unsigned-byte IDX file")
    head = 4 + 4 * ndim
    if len(data) < head:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes)")
    dims = struct.unpack(">" + "I" * ndim, data[4:head])
    want = head + int(np.prod(dims))
    if len(data) != want:
        raise DataError(f"{path}: {len(data)} bytes where its header {dims} needs {want} (truncated file?)")
    return np.frombuffer(data, dtype=np.uint8, offset=head).reshape(dims)


def _check_pairs(where: str, x: np.ndarray, y: np.ndarray, num_classes: int, image_ndim: int) -> None:
    """Images and labels that belong together: one label per image, each a class index."""
    if x.ndim != image_ndim or y.ndim != 1:
        raise DataError(f"{where}: images of {x.ndim} dimensions and labels of {y.ndim}, expected {image_ndim} and 1")
    if len(x) != len(y):
        raise DataError(f"{where}: {len(x)} images but {len(y)} labels")
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if len(bad):
        raise DataError(f"{where}: label {int(y[bad[0]])} of example {int(bad[0])} is outside 0..{num_classes - 1}")


def _find(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    raise DataError(
        f"Fashion-MNIST file {stem}[.gz] not found under {root} "
        "(install the Debian package dataset-fashion-mnist or set data.root)"
    )


FASHION_MNIST_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                       "t10k-labels-idx1-ubyte")  # fmt: skip


def fashion_mnist_files(root: str) -> list[Path]:
    """The four IDX files (each plain or .gz) Fashion-MNIST is read from: train images, labels, test images, labels."""
    r = Path(root or FASHION_MNIST_DEFAULT)
    if not r.is_dir():
        raise DataError(f"data.root {r} does not exist (Fashion-MNIST: apt-get install dataset-fashion-mnist)")
    return [_find(r, stem) for stem in FASHION_MNIST_STEMS]


def load_fashion_mnist(root: str) -> ImageSplits:
    r = Path(root or FASHION_MNIST_DEFAULT)
    tx, ty, vx, vy = (_read_idx(f) for f in fashion_mnist_files(root))
    for what, x, y in (("train", tx, ty), ("t10k", vx, vy)):
        _check_pairs(f"Fashion-MNIST {what} under {r}", x, y, 10, image_ndim=3)
    m, s = STATS["fashion_mnist"]
    return ImageSplits(
        torch.from_numpy(tx.copy()).unsqueeze(1),
        torch.from_numpy(ty.astype(np.int64)),
        torch.from_numpy(vx.copy()).unsqueeze(1),
        torch.from_numpy(vy.astype(np.int64)),
        10,
        m,
        s,
    )


def cifar10_npz_file(root: str) -> Path:
    base = Path(root) if root else shared_data_dir() / "cifar10_test10k"
    path = base if base.suffix == ".npz" else base / "cifar10_test10k.npz"
    if not path.is_file():
        raise DataError(f"CIFAR-10 npz not found: {path} (set data.root to the cifar10_test10k folder)")
    return path


def load_cifar10_npz(root: str) -> ImageSplits:
    """The 10,000 CIFAR-10 test images shipped offline, split 8,000 / 2,000 by the data README's fixed permutation."""
    path = cifar10_npz_file(root)
    try:
        d = np.load(path)
        images, labels = d["images"], d["labels"]
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise DataError(f"{path}: cannot be read as the CIFAR-10 npz ({exc})") from None
    _check_pairs(str(path), images, labels, 10, image_ndim=4)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) -> (N, 3, 32, 32)
    y = torch.from_numpy(labels.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    tr, te = perm[:8000], perm[8000:]
    m, s = STATS["cifar10"]
    return ImageSplits(x[tr], y[tr], x[te], y[te], 10, m, s)


_CIFAR_GLOBALS = {
    ("numpy", "ndarray"): ("numpy", "ndarray"),
    ("numpy", "dtype"): ("numpy", "dtype"),
    ("_codecs", "encode"): ("_codecs", "encode"),  # bytes in a protocol-2 pickle written by Python 3
    **{(f"numpy.{core}.multiarray", name): ("numpy._core.multiarray", name)
       for core in ("core", "_core") for name in ("_reconstruct", "scalar")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer") for core in ("core", "_core")},
}  # fmt: skip
"""The only names a CIFAR batch's pickle may call: a numpy array's and dtype's reconstruction, under numpy 1's
(``numpy.core``, as the published files name them) and numpy 2's module names."""


class _DataUnpickler(pickle.Unpickler):
    """Reads a pickle of plain data and numpy arrays; any other name it asks for is refused, so no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        where = _CIFAR_GLOBALS.get((module, name))
        if where is None:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a data file has no use for")
        return getattr(importlib.import_module(where[0]), where[1])


def _unpickle(path: Path) -> dict:
    """A CIFAR python batch (a pickled dict of numpy arrays and lists), read without running code from it."""
    if not path.is_file():
        raise DataError(f"CIFAR file not found: {path}")
    try:
        with open(path, "rb") as f:
            data = _DataUnpickler(f, encoding="latin1").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: cannot be read as a CIFAR batch ({exc})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: cannot be read as a CIFAR batch (a {type(data).__name__}, not a dict)")
    return data


def cifar_folder_files(root: str, num_classes: int) -> tuple[list[Path], list[Path]]:
    """(train, test) batch files of torchvision's on-disk format: cifar-10-batches-py/ or cifar-100-python/ (under
    root, or root itself)."""
    sub = "cifar-10-batches-py" if num_classes == 10 else "cifar-100-python"
    if not root:
        raise DataError(f"data.root must point at a folder holding {sub}/ (no download is attempted)")
    r = Path(root)
    r = r / sub if (r / sub).is_dir() else r
    if num_classes == 10:
        return [r / f"data_batch_{i}" for i in range(1, 6)], [r / "test_batch"]
    return [r / "train"], [r / "test"]


def image_files(name: str, root: str) -> list[Path]:
    """The files ``data.name`` = ``name`` reads from ``root`` (none for generated data)."""
    if name == "fashion_mnist":
        return fashion_mnist_files(root)
    if name == "cifar10_npz":
        return [cifar10_npz_file(root)]
    if name in ("cifar10", "cifar100"):
        train, test = cifar_folder_files(root, 10 if name == "cifar10" else 100)
        return [*train, *test]
    return []


def load_cifar_folder(root: str, num_classes: int) -> ImageSplits:
    """torchvision's on-disk format: cifar-10-batches-py/ or cifar-100-python/ (under root, or root itself)."""
    train_files, test_files = cifar_folder_files(root, num_classes)
    r = train_files[0].parent
    train, test = [_unpickle(f) for f in train_files], [_unpickle(f) for f in test_files]
    key = "labels" if num_classes == 10 else "fine_labels"

    def stack(parts: list[dict]) -> tuple[Tensor, Tensor]:
        x = np.concatenate([np.asarray(p["data"], dtype=np.uint8).reshape(-1, 3, 32, 32) for p in parts])
        y = np.concatenate([np.asarray(p[key], dtype=np.int64) for p in parts])
        return torch.from_numpy(x), torch.from_numpy(y)

    try:
        (tx, ty), (vx, vy) = stack(train), stack(test)
    except (KeyError, ValueError) as exc:
        raise DataError(f"{r}: CIFAR batches of an unexpected layout ({exc})") from None
    for what, x, y in (("train", tx, ty), ("test", vx, vy)):
        _check_pairs(f"{r} {what}", x.numpy(), y.numpy(), num_classes, image_ndim=4)
    m, s = STATS["cifar10" if num_classes == 10 else "cifar100"]
    return ImageSplits(tx, ty, vx, vy, num_classes, m, s)


def synthetic_images(seed: int = 0, n_train: int = 2000, n_test: int = 500, num_classes: int = 4) -> ImageSplits:
    """Class templates plus noise (1x8x8): learnable in a few rounds, for fast tests of the whole pipeline."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(num_classes, 1, 8, 8, generator=g) * 255

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.randint(0, num_classes, (n,), generator=g)
        x = templates[y] * 0.6 + torch.rand(n, 1, 8, 8, generator=g) * 0.4 * 255
        return x.to(torch.uint8), y

    (tx, ty), (vx, vy) = draw(n_train), draw(n_test)
    return ImageSplits(tx, ty, vx, vy, num_classes, (0.5,), (0.25,))


def load_images(name: str, root: str, seed: int) -> ImageSplits:
    if name == "fashion_mnist":
        return load_fashion_mnist(root)
    if name == "cifar10_npz":
        return load_cifar10_npz(root)
    if name == "cifar10":
        return load_cifar_folder(root, 10)
    if name == "cifar100":
        return load_cifar_folder(root, 100)
    if name == "synthetic":
        return synthetic_images(seed)
    raise DataError(f"unknown image dataset {name!r}")


def select_classes(x: Tensor, y: Tensor, classes: Sequence[int], num_classes: int) -> tuple[Tensor, Tensor]:
    """The examples of ``classes`` only, relabelled: class ``classes[i]`` becomes label i."""
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad or len(set(classes)) != len(classes):  # the config refuses both; a caller building its own may not
        raise DataError(f"invalid value for data.classes: {list(classes)} (distinct classes in 0..{num_classes - 1})")
    relabel = torch.full((num_classes,), -1, dtype=torch.long)
    relabel[torch.as_tensor(list(classes), dtype=torch.long)] = torch.arange(len(classes))
    new = relabel[y]
    keep = new >= 0
    if not bool(keep.any()):
        raise DataError(f"data.classes={list(classes)}: no example of these classes in this split")
    return x[keep], new[keep]


def normalize(x: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """uint8 (B, C, H, W) -> float32 standardised per channel."""
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x.float() / 255.0 - m) / s


def augment(x: Tensor, gen: torch.Generator, pad: int = 4) -> Tensor:
    """Random crop with zero padding + horizontal flip (CIFAR-style), per sample, from ``gen``."""
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen).tolist()
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen).tolist()
    flip = (torch.rand(b, generator=gen) < 0.5).tolist()
    out = torch.empty_like(x)
    for i in range(b):
        crop = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
        out[i] = crop.flip(-1) if flip[i] else crop
    return out
