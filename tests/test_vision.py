"""Vision data and models: loaders, partitions, the ResNet-18 cut, pretrained weights from a local file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hosfl_dist.data.partition import dirichlet_partition, iid_partition
from hosfl_dist.data.vision import FASHION_MNIST_DEFAULT, load_cifar10_npz, load_fashion_mnist, shared_data_dir
from hosfl_dist.errors import ConfigError, DataError
from hosfl_dist.models.vision import ResNet18, ResNetClient, ResNetServer, resnet18_split


def test_iid_partition_covers_everything_once():
    shards = iid_partition(103, 10, seed=0)
    allidx = np.concatenate(shards)
    assert sorted(allidx.tolist()) == list(range(103))
    assert {len(s) for s in shards} <= {10, 11}


def test_dirichlet_partition_is_a_partition_and_skewed():
    labels = np.repeat(np.arange(10), 100)
    shards = dirichlet_partition(labels, 20, alpha=0.1, seed=0)
    assert sorted(np.concatenate(shards).tolist()) == list(range(1000))
    # small α: most clients are dominated by few classes
    top_share = [np.bincount(labels[s], minlength=10).max() / len(s) for s in shards]
    assert np.median(top_share) > 0.5
    iid_share = [np.bincount(labels[s], minlength=10).max() / len(s) for s in iid_partition(1000, 20, 0)]
    assert np.median(iid_share) < np.median(top_share)


def test_too_few_samples_is_a_data_error():
    with pytest.raises(DataError, match="clients.total=10"):
        iid_partition(5, 10, 0)


@pytest.mark.skipif(
    not Path(FASHION_MNIST_DEFAULT).is_dir(), reason="Debian package dataset-fashion-mnist not installed"
)
def test_fashion_mnist_loads():
    d = load_fashion_mnist("")
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert d.train_x.dtype == torch.uint8 and set(d.train_y.unique().tolist()) == set(range(10))


@pytest.mark.skipif(not (shared_data_dir() / "cifar10_test10k").is_dir(), reason="shared/data/cifar10_test10k absent")
def test_cifar10_npz_split_follows_the_readme():
    d = load_cifar10_npz("")
    assert d.train_x.shape == (8000, 3, 32, 32) and d.test_x.shape == (2000, 3, 32, 32)
    counts = torch.bincount(d.train_y, minlength=10).tolist()
    assert counts == [783, 781, 807, 808, 805, 789, 798, 825, 805, 799]  # the README's per-class train counts


def test_resnet_cut_reproduces_the_whole_network():
    torch.manual_seed(0)
    net = ResNet18(10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        h = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        for layer in (net.layer1, net.layer2, net.layer3, net.layer4):
            h = layer(h)
        full = net.fc(torch.flatten(net.avgpool(h), 1))
        for cut in (1, 2, 3):
            z = ResNetClient(net, cut)(x)
            torch.testing.assert_close(ResNetServer(net, cut)(z), full, rtol=0, atol=0)
    z = ResNetClient(net, 2)(x)
    assert z.shape == (2, 128, 4, 4)  # the paper's cut on 32x32 inputs: 2048 floats per sample


def test_frozen_bn_never_trains():
    client, server = resnet18_split(10, 3, 2, frozen_bn=True)
    bn = client.bn1
    assert not any(p.requires_grad for p in bn.parameters())
    client.train()
    assert not bn.training
    before = bn.running_mean.clone()
    client(torch.randn(4, 3, 32, 32))
    assert torch.equal(before, bn.running_mean)


def test_pretrained_weights_load_from_a_local_file(tmp_path):
    torch.manual_seed(1)
    src = ResNet18(1000)
    path = tmp_path / "resnet18.pth"
    torch.save(src.state_dict(), path)
    client, server = resnet18_split(10, 3, 2, True, str(path))  # new 10-class head, the rest loaded
    assert torch.equal(client.conv1.weight, src.conv1.weight)
    assert server.fc.weight.shape == (10, 512)
    with pytest.raises(ConfigError, match="weights file not found"):
        resnet18_split(10, 3, 2, True, str(tmp_path / "missing.pth"))
    torch.save({"foo": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ConfigError, match="does not match ResNet-18"):
        resnet18_split(10, 3, 2, True, str(tmp_path / "bad.pth"))


def _write_batch(path: Path, n: int, key: str, seed: int) -> None:
    import pickle

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        pickle.dump({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), key: rng.integers(0, 10, n).tolist()}, f)


def test_torchvision_cifar_folders_load(tmp_path):
    from hosfl_dist.data.vision import load_cifar_folder

    c10 = tmp_path / "cifar-10-batches-py"
    c10.mkdir()
    for i in range(1, 6):
        _write_batch(c10 / f"data_batch_{i}", 4, "labels", i)
    _write_batch(c10 / "test_batch", 3, "labels", 9)
    d = load_cifar_folder(str(tmp_path), 10)
    assert d.train_x.shape == (20, 3, 32, 32) and d.test_x.shape == (3, 3, 32, 32)
    c100 = tmp_path / "cifar-100-python"
    c100.mkdir()
    _write_batch(c100 / "train", 5, "fine_labels", 1)
    _write_batch(c100 / "test", 2, "fine_labels", 2)
    d = load_cifar_folder(str(c100), 100)
    assert d.num_classes == 100 and d.train_y.shape == (5,)
    with pytest.raises(DataError, match="CIFAR file not found"):
        load_cifar_folder(str(tmp_path / "nothing"), 10)
