"""Vision data and models: loaders, partitions, the ResNet-18 cut, pretrained weights from a local file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hosfl_dist.data.partition import dirichlet_partition, iid_partition
from hosfl_dist.data.vision import FASHION_MNIST_DEFAULT, load_cifar10_npz, load_fashion_mnist, shared_data_dir
from hosfl_dist.errors import ConfigError, DataError
from hosfl_dist.models.vision import MaxPool2d, ResNet18, ResNetClient, ResNetServer, SmallCNN, resnet18_split


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


@pytest.mark.parametrize("args, shape", [((2,), (4, 16, 28, 28)), ((3, 2, 1), (4, 64, 16, 16))])
def test_channels_last_pool_equals_the_nchw_pool_bit_for_bit(args, shape):
    """The pool of both vision models (small CNN 2x2, ResNet-18 stem 3x3/2 with overlapping windows) runs on a
    channels_last copy: output, input gradient and layout must be those of nn.MaxPool2d, ties (ReLU zeros) included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).relu()
    results = []
    for pool in (MaxPool2d(*args), torch.nn.MaxPool2d(*args)):
        xi = x.clone().requires_grad_(True)
        inner, seen = xi * 1, []  # not a leaf: autograd hands its gradient on in the layout the pool gives it
        inner.register_hook(lambda g: seen.append(g.is_contiguous()))
        y = pool(inner)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        assert y.is_contiguous() and seen == [True]  # the gradient in NCHW too: the backward before it never mixes
        results.append((y, xi.grad))
    (y, dx), (y_ref, dx_ref) = results
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert isinstance(ResNet18(10).maxpool, MaxPool2d)
    assert all(isinstance(b[2], MaxPool2d) for b in SmallCNN(10, (1, 28, 28), 16).blocks)


def test_frozen_bn_never_trains():
    client, server = resnet18_split(10, 3, 2, frozen_bn=True)
    bn = client.bn1
    assert not any(p.requires_grad for p in bn.parameters())
    client.train()
    assert not bn.training
    before = bn.running_mean.clone()
    client(torch.randn(4, 3, 32, 32))
    assert torch.equal(before, bn.running_mean)
    # as built, before any .train() / .eval() (a resumed run trains before its first evaluation), and even with the
    # flag forced: running statistics, never batch statistics
    fresh = resnet18_split(10, 3, 2, frozen_bn=True)[1]
    stats = [m.running_var.clone() for m in fresh.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert not any(m.training for m in fresh.modules() if isinstance(m, torch.nn.BatchNorm2d))
    x = torch.randn(4, 128, 8, 8)
    out = fresh(x)
    for m in fresh.modules():
        m.training = True
    assert torch.equal(fresh(x), out)
    assert all(torch.equal(a, m.running_var) for a, m in
               zip(stats, [m for m in fresh.modules() if isinstance(m, torch.nn.BatchNorm2d)]))  # fmt: skip


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


# -- model.freeze_bn: all | client | none ----------------------------------------------------------------------------
RESNET_TINY = [  # one HO-SFL round of K=2 clients on 1x8x8 synthetic images through ResNet-18 cut after stage 2
    "data.name=synthetic",
    "model.name=resnet18",
    "split.cut=2",
    "clients.total=4",
    "clients.per_round=2",
    "clients.batch_size=4",
    "zo.num_perturbations=2",
    "clients.optim.lr=1e-3",
    "server.optim.lr=1e-3",
    "train.budget_samples=8",
    "train.eval_every_samples=8",
    "train.eval_batch_size=8",
    "data.eval_max_samples=16",
    "job.progress=false",
]


def _bn_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every BatchNorm tensor of ``module`` (affine parameters and statistics), copied."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            out.update({f"{name}.{k}": v.detach().clone() for k, v in m.state_dict().items()})
    return out


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.parametrize(("value", "mode"), [("true", "all"), ("false", "none"), ("all", "all"), ("client", "client")])
def test_freeze_bn_takes_a_mode_or_the_old_booleans(value, mode):
    from hosfl_dist.config import load_config

    assert load_config(None, [f"model.freeze_bn={value}"]).model.freeze_bn == mode
    assert load_config(None, []).model.freeze_bn == "code"  # the authors' code, per method
    choices = r"\['all', 'code', 'client', 'none'\]"
    with pytest.raises(ConfigError, match=r"model.freeze_bn: 'some' \(choose one of " + choices):
        load_config(None, ["model.freeze_bn=some"])


def _one_round(tmp_path: Path, mode: str) -> tuple[dict, dict, dict, dict, list[bool]]:
    """BN state of both parts before and after one round (evaluations around it), and the train flag of every
    forward of the server's first BatchNorm."""
    from tiny import runner

    r = runner([*RESNET_TINY, f"model.freeze_bn={mode}", f"job.out_dir={tmp_path / mode}"])
    client, server = r.split.client, r.split.server
    modes: list[bool] = []
    first_bn = next(m for m in server.modules() if isinstance(m, torch.nn.BatchNorm2d))
    first_bn.register_forward_pre_hook(lambda m, _: modes.append(m.training))
    c0, s0 = _bn_state(client), _bn_state(server)
    r.run()
    return c0, _bn_state(client), s0, _bn_state(server), modes


def test_freeze_bn_all_leaves_every_batchnorm_as_it_was(tmp_path):
    c0, c1, s0, s1, modes = _one_round(tmp_path, "all")
    assert c0 and s0 and not _changed(c0, c1) and not _changed(s0, s1)
    assert modes and not any(modes)  # running statistics in training and evaluation alike


def test_freeze_bn_client_trains_server_statistics_one_client_at_a_time(tmp_path):
    c0, c1, s0, s1, modes = _one_round(tmp_path, "client")
    assert not _changed(c0, c1)  # the client part never leaves its running statistics
    changed = _changed(s0, s1)
    assert any(k.endswith("running_mean") for k in changed) and any(k.endswith("running_var") for k in changed)
    assert not any(k.endswith(("weight", "bias")) for k in changed)  # affine parameters frozen
    # evaluation (2 batches of 8) in eval mode, then the round's K=2 clients in train mode one pass each, then eval
    assert modes == [False, False, True, True, False, False]


@pytest.mark.parametrize("alg", ["sfl", "fsl_sage"])
def test_freeze_bn_code_trains_a_first_order_clients_statistics_and_averages_them_with_its_model(tmp_path, alg):
    """The authors' code runs a first-order client's BatchNorm in train mode: its running statistics move with its
    batches, travel with θc (downloaded beside it, uploaded beside θc_m) and are averaged with the model's weights;
    evaluation normalises with the averaged ones, and the end-of-run audit covers them."""
    from hosfl_dist.algorithms.exchange import aggregate
    from hosfl_dist.models.vision import BatchStatsNorm, running_stat_slots
    from tiny import runner

    r = runner([*RESNET_TINY, f"algorithm.name={alg}", "model.freeze_bn=code", f"job.out_dir={tmp_path / alg}"])
    server, worker = r.server, r.worker
    assert all(type(m) is BatchStatsNorm for m in r.split.client.modules() if isinstance(m, torch.nn.BatchNorm2d))
    before = [s.clone() for s in server.client_stats]
    uploads = []
    upload = server.upload

    def recorded(t, batch):
        uploads.append({m: ([s.clone() for s in b["stats"]], float(b["weight"])) for m, b in batch.items()})
        return upload(t=t, batch=batch)

    server.upload = recorded
    summary = r.run()
    assert summary["status"] == "completed" and len(uploads) == 1 and len(before) == 2 * 10  # mean and var, 10 layers
    ups = [uploads[0][m] for m in sorted(uploads[0])]
    assert all(any(not torch.equal(a, b) for a, b in zip(stats, before)) for stats, _ in ups)  # each client's moved
    want = aggregate(before, [stats for stats, _ in ups], [w for _, w in ups])
    assert all(torch.equal(a, b) for a, b in zip(server.client_stats, want))  # averaged with the model's weights
    held = [mod._buffers[name] for mod, name in running_stat_slots(worker.module)]
    assert all(torch.equal(a, b) for a, b in zip(held, want))  # the last evaluation normalised with them


def test_freeze_bn_code_keeps_a_zeroth_order_clients_statistics_and_trains_the_servers(tmp_path):

    c0, c1, s0, s1, modes = _one_round(tmp_path, "code")  # HO-SFL: as model.freeze_bn=client
    assert not _changed(c0, c1)
    assert any(k.endswith("running_mean") for k in _changed(s0, s1))
    assert modes == [False, False, True, True, False, False]


def test_freeze_bn_none_trains_affine_parameters_on_both_sides(tmp_path):
    from hosfl_dist.config import load_config
    from hosfl_dist.models import build_split_model
    from hosfl_dist.models.vision import BatchStatsNorm, FrozenBatchNorm

    cfg = load_config(None, [*RESNET_TINY, "model.freeze_bn=none"])
    split = build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)}, True)
    client_bn = [m for m in split.client.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    server_bn = [m for m in split.server.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(type(m) is FrozenBatchNorm for m in client_bn) and all(type(m) is BatchStatsNorm for m in server_bn)
    assert all(p.requires_grad for m in client_bn + server_bn for p in m.parameters())
    split.client.train()
    assert not any(m.training for m in client_bn)  # running statistics on the client: outside θc, never replicated
    c0, c1, s0, s1, modes = _one_round(tmp_path, "none")
    assert not any(k.endswith(("running_mean", "running_var")) for k in _changed(c0, c1))
    assert {k.rsplit(".", 1)[1] for k in _changed(s0, s1)} >= {"weight", "bias", "running_mean", "running_var"}


def test_running_statistics_update_once_in_a_zeroth_order_step():
    from hosfl_dist.models.vision import BatchStatsNorm, running_stat_updates

    torch.manual_seed(0)
    bn = BatchStatsNorm(3, trainable_affine=False)
    x, x2 = torch.randn(6, 3, 4, 4), torch.randn(6, 3, 4, 4) + 1.0
    ref = BatchStatsNorm(3, trainable_affine=False)
    ref(x)  # one ordinary train-mode forward
    with running_stat_updates(bn, 1):
        bn(x)
        probe = bn(x2)  # normalised with its own batch, statistics untouched
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(probe, torch.nn.functional.batch_norm(x2, None, None, training=True), rtol=0, atol=0)
    assert bn.updates_left is None


def test_batch_statistics_server_runs_each_client_alone():
    from hosfl_dist.algorithms.compute import Upload
    from hosfl_dist.runtime.server_compute import plan

    uploads = {m: Upload({"z": torch.zeros(3, 2)}, torch.zeros(3, dtype=torch.long)) for m in (2, 5, 7)}
    merged, _ = plan(uploads, 1, 0)[0]
    assert merged == [[(2, 0, 3), (5, 0, 3), (7, 0, 3)]]  # frozen BatchNorm: the round in one pass
    alone, _ = plan(uploads, 1, 0, per_client=True)[0]
    assert alone == [[(2, 0, 3)], [(5, 0, 3)], [(7, 0, 3)]]


@pytest.mark.parametrize(
    ("override", "needle"),
    [("server.ranks=2", r"server.ranks: 2 \(model.freeze_bn=client"), ("server.micro_batch_tokens=2", "micro_batch")],
)
def test_batch_statistics_server_refuses_cutting_a_client_batch(override, needle):
    from hosfl_dist.runtime.checks import load_run_config

    with pytest.raises(ConfigError, match=needle):  # where a run's config is built (--check too)
        load_run_config(None, [*RESNET_TINY, "model.freeze_bn=client", override])


def test_model_exchange_server_statistics_do_not_depend_on_arrival_order():
    """SFL in freeze_bn=client: each copy θs_m updates its own statistics, averaged at the round's end."""
    from hosfl_dist.algorithms.sfl import SFLServer
    from hosfl_dist.runtime.build import round_plan
    from tiny import server_of
    from hosfl_dist.config import load_config
    from hosfl_dist.models import build_split_model

    cfg = load_config(None, [*RESNET_TINY, "model.freeze_bn=client", "algorithm.name=sfl"])
    sampled = round_plan(cfg).sampled(0)
    torch.manual_seed(0)
    z = {m: torch.randn(4, 128, 1, 1) for m in sampled}
    y = {m: torch.randint(0, 4, (4,)) for m in sampled}
    stats = []
    for order in (sampled, sampled[::-1]):
        split = build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)}, False)
        server = server_of(cfg, split, SFLServer)
        for m in order:
            server.submit(0, m, {"z": z[m]}, y[m])
        server.upload(0, {m: {"params": server.client_model_copy(), "stats": [], "weight": 4} for m in sampled})
        stats.append([s.clone() for s in server.server_stats])
    assert stats[0] and all(torch.equal(a, b) for a, b in zip(*stats))


# -- data.classes ----------------------------------------------------------------------------------------------------
def test_data_classes_keeps_and_relabels_in_the_given_order():
    from hosfl_dist.config import load_config
    from hosfl_dist.data import build_data, data_info, load_vision_data
    from hosfl_dist.data.vision import synthetic_images
    from hosfl_dist.runtime.build import data_sections

    full = synthetic_images(0)
    cfg = load_config(None, ["data.name=synthetic", "data.classes=[3, 1]", "clients.total=4", "clients.per_round=2"])
    got = load_vision_data(cfg.data, cfg.job.seed)
    for x, y, fx, fy in ((got.train_x, got.train_y, full.train_x, full.train_y),
                         (got.eval_x, got.eval_y, full.test_x, full.test_y)):  # fmt: skip
        keep = (fy == 3) | (fy == 1)
        assert torch.equal(x, fx[keep]) and torch.equal(y, (fy[keep] == 1).long())  # class 3 -> 0, class 1 -> 1
    assert got.info["num_classes"] == 2 and build_data(data_sections(cfg)).info["num_classes"] == 2
    kept = load_config(None, ["data.name=cifar10_npz", "data.classes=[5, 6, 7]"])
    assert data_info(data_sections(kept))["num_classes"] == 3
    for built in (build_data, data_info):  # the whole config is not what the data is built from
        with pytest.raises(TypeError, match=rf"^{built.__name__} takes hosfl_dist.data.DataSections .* not Config$"):
            built(kept)
    capped = load_vision_data(
        load_config(None, ["data.name=synthetic", "data.classes=[3, 1]", "data.train_max_samples=50"]).data, 0
    )
    assert len(capped.train_y) == 50 and set(capped.train_y.tolist()) <= {0, 1}  # the cap counts kept classes


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["data.name=cifar10_npz", "data.classes=[0, 10]"], r"data.classes: \[0, 10\] \(class 10 is outside 0..9"),
        (["data.name=synthetic", "data.classes=[1, 4]"], "class 4 is outside 0..3"),
        (["data.name=cifar10_npz", "data.classes=[2, 2]"], "class 2 is listed twice"),
        (["data.name=cifar10_npz", "data.classes=[2]"], "two or more classes"),
        (["data.name=sst2", "model.name=hf", "model.source=tiny:llama", "data.classes=[0, 1]"], "vision data sets"),
    ],
)
def test_data_classes_errors_name_the_key(overrides, needle):
    from hosfl_dist.runtime.checks import load_run_config  # a text task's refusal needs the task registry

    with pytest.raises(ConfigError, match=needle) as exc:
        load_run_config(None, overrides)
    assert "\n" not in str(exc.value) and "data.classes" in str(exc.value)


def test_select_classes_refuses_what_the_config_would():
    from hosfl_dist.data.vision import select_classes

    with pytest.raises(DataError, match="data.classes"):
        select_classes(torch.zeros(3, 1, 2, 2), torch.tensor([0, 1, 2]), [0, 3], num_classes=3)


def test_class_counts_of_the_config_match_the_loaders():
    from hosfl_dist.config import DataConfig
    from hosfl_dist.data import VISION_INFO
    from hosfl_dist.data.vision import synthetic_images

    assert {k: v[0] for k, v in VISION_INFO.items()} == {k: DataConfig.CLASSES[k] for k in VISION_INFO}
    assert DataConfig.CLASSES["synthetic"] == synthetic_images(0).num_classes


@pytest.mark.parametrize("alg", ["sfl", "zo_sfl", "mu_splitfed"])
def test_a_client_step_updates_server_statistics_once(tmp_path, alg):
    """Zeroth-order servers probe one batch at θs ± μv (τ pairs and more for MU-SplitFed): one update a step."""
    from tiny import runner

    r = runner([*RESNET_TINY, "model.freeze_bn=client", f"algorithm.name={alg}", f"job.out_dir={tmp_path}"])
    bn = next(m for m in r.split.server.modules() if isinstance(m, torch.nn.BatchNorm2d))
    summary = r.run()
    assert int(bn.num_batches_tracked) == summary["processed_samples"] // 4 == 2  # K=2 clients, one step each
