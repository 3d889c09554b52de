"""Vision models cut into a client part and a server part.

ResNet-18 follows torchvision's layout and parameter names, so an ImageNet state dict saved by torchvision loads
from a local file (``model.pretrained``); the cut falls after residual stage ``split.cut`` (the paper cuts after the
2nd). BatchNorm follows ``model.freeze_bn``:

- ``all`` (the paper's text, App. B.2): :class:`FrozenBatchNorm` everywhere, statistics and affine parameters never
  change, which also makes batching the K clients' activations on the server exactly equal to processing them one
  by one;
- ``code`` (the authors' published code, per method): the server part gets :class:`BatchStatsNorm` with frozen
  affine parameters: batch statistics in train mode (running statistics updated), running statistics in eval mode;
  the servers then run each client's batch in its own pass. A first-order client (SFL, FSL-SAGE) trains with
  :class:`BatchStatsNorm` too, its running statistics travelling and averaged with θc (the baselines' model
  exchange carries them); a zeroth-order client (HO-SFL, ZO-SFL, MU-SplitFed, frozen_client) keeps
  :class:`FrozenBatchNorm`: its perturbed forwards must differ by the perturbation alone, and HO-SFL's seed replay
  carries no data-dependent state;
- ``client``: as ``code`` with every client part on :class:`FrozenBatchNorm` (what ``code`` was before first-order
  clients trained their statistics);
- ``none``: as ``client`` with the affine parameters trainable on both sides. The client part still normalises with
  its running statistics.

``conv_mlp`` (:class:`ConvMLP`: a conv block and two hidden fully connected layers) is the quickstart's model: a client
part of ~2e5 parameters that is cheap to run P + 1 times.

The models also exist whole (:class:`ResNet18`, :class:`SmallCNN`, :class:`ConvMLP`):
``python -m hosfl_dist.experiments.pretrain`` trains them centrally and saves the state dict ``model.pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hosfl_dist.errors import ConfigError

logger = logging.getLogger(__name__)

BN_MODES = ("all", "code", "client", "none")
"""``model.freeze_bn`` values (see the module docstring)."""


class FrozenBatchNorm(nn.BatchNorm2d):
    """BatchNorm that always uses its running statistics and never trains (App. B.2)."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        for p in self.parameters():
            p.requires_grad_(False)
        self.training = False  # a module starts in train mode; this one never is (a resumed run trains before any
        # evaluation has called .train() / .eval() on it)

    def train(self, mode: bool = True) -> FrozenBatchNorm:
        return super().train(False)

    def forward(self, x: Tensor) -> Tensor:  # running statistics, whatever the training flag says
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class BatchStatsNorm(nn.BatchNorm2d):
    """BatchNorm of a server part under ``model.freeze_bn=code|client|none`` (and of a first-order client part under
    ``code``): batch statistics in train mode (running statistics updated), running statistics in eval mode; affine
    parameters trainable or frozen.

    ``updates_left`` (set by :func:`running_stat_updates`): how many more train-mode forwards may update the running
    statistics; the rest normalise with their batch statistics and leave them as they are. None: every forward.
    """

    def __init__(self, num_features: int, trainable_affine: bool) -> None:
        super().__init__(num_features)
        for p in self.parameters():
            p.requires_grad_(trainable_affine)
        self.updates_left: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.updates_left is not None:
            if self.updates_left <= 0:  # a probe forward (zeroth-order ±μ, alignment): statistics stay as they are
                return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
            self.updates_left -= 1
        return super().forward(x)


def _norm(c: int, frozen: bool) -> nn.Module:
    return FrozenBatchNorm(c) if frozen else nn.BatchNorm2d(c)


def bn_mode(freeze_bn: bool | str) -> str:
    """``model.freeze_bn`` as one of :data:`BN_MODES` (booleans of older callers: True = all, False = none)."""
    mode = ("all" if freeze_bn else "none") if isinstance(freeze_bn, bool) else freeze_bn
    if mode not in BN_MODES:
        raise ConfigError(f"invalid value for model.freeze_bn: {freeze_bn!r} (choose one of {list(BN_MODES)})")
    return mode


def _replace_bn(module: nn.Module, make: type[nn.Module], trainable_affine: bool) -> None:
    """Swap every BatchNorm below ``module`` for a ``make`` layer holding the same parameters and statistics."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            new = make(child.num_features, trainable_affine).to(child.weight.device)
            new.load_state_dict(child.state_dict())
            setattr(module, name, new)
        else:
            _replace_bn(child, make, trainable_affine)


def apply_bn_mode(client: nn.Module, server: nn.Module, mode: str, first_order_client: bool = False) -> None:
    """Set the BatchNorm layers of a frozen-BN split to ``model.freeze_bn=mode`` (``all``: nothing to do);
    ``first_order_client``: the method's client back-propagates (under ``code`` it trains its statistics)."""
    if mode == "all":
        return
    _replace_bn(server, BatchStatsNorm, trainable_affine=mode == "none")
    if mode == "code" and first_order_client:
        _replace_bn(client, BatchStatsNorm, trainable_affine=False)
    if mode == "none":  # the client's γ, β join θc; its statistics stay frozen (FrozenBatchNorm's eval mode)
        for m in client.modules():
            if isinstance(m, FrozenBatchNorm):
                for p in m.parameters():
                    p.requires_grad_(True)


def uses_batch_stats(module: nn.Module) -> bool:
    """Whether a forward of ``module`` in train mode depends on its batch (then clients are run one by one)."""
    return any(isinstance(m, BatchStatsNorm) for m in module.modules())


def mixes_batch_rows(module: nn.Module) -> bool:
    """Whether a forward of ``module`` may depend on the other rows of its batch: a BatchNorm layer other than
    :class:`FrozenBatchNorm` normalises with batch statistics in train mode (a plug-in's plain one included)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, FrozenBatchNorm)
               for m in module.modules())  # fmt: skip


def running_stat_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(layer, buffer name) of the running statistics that train-mode forwards of ``module`` update."""
    return [(m, name) for m in module.modules() if isinstance(m, BatchStatsNorm)
            for name in ("running_mean", "running_var")]  # fmt: skip


@contextlib.contextmanager
def bound_running_stats(slots: Sequence[tuple[nn.Module, str]], stats: Sequence[Tensor]) -> Iterator[None]:
    """Run a block with ``stats`` as the running statistics (a server copy θs_m's own), then put the module's back."""
    saved = [mod._buffers[name] for mod, name in slots]
    for (mod, name), t in zip(slots, stats, strict=True):
        mod._buffers[name] = t
    try:
        yield
    finally:
        for (mod, name), t in zip(slots, saved):
            mod._buffers[name] = t


@contextlib.contextmanager
def running_stat_updates(module: nn.Module, limit: int) -> Iterator[None]:
    """Within the block, the batch-statistics BatchNorm layers of ``module`` update their running statistics on the
    first ``limit`` forwards only; later forwards use their batch statistics without updating. A zeroth-order step
    runs several forwards of one batch at perturbed weights: counting each would weigh that batch several times."""
    layers = [m for m in module.modules() if isinstance(m, BatchStatsNorm)]
    for m in layers:
        m.updates_left = limit
    try:
        yield
    finally:
        for m in layers:
            m.updates_left = None


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that pools a channels_last copy on CPU and hands back a contiguous (NCHW) result.

    PyTorch's CPU max-pool kernel for NCHW walks one window at a time, the channels_last kernel vectorises over
    channels: at the client's shapes (B=32: [32, 16, 28, 28] 2x2, [32, 32, 14, 14] 2x2, ResNet-18's stem
    [32, 64, 16, 16] 3x3/2; 1 thread) the copy, the pool and the copy back take a fraction of the NCHW pool's time,
    and less than it at B=1 and B=1000 too (measured in results/bench/README.md#zo_step, "The pool"). A maximum is a
    selection, not a sum, and the backward scatters into the same positions in the same order, so outputs and
    gradients are bit-identical to the NCHW pool's: the layout is free to differ between processes and devices.
    Everything around the pool stays NCHW (a channels_last convolution sums in another order), its gradient included:
    the copy hands the pool's channels_last gradient back as NCHW, so the ReLU and convolution backward before it
    never mix layouts (they did, and the quickstart server's forward and backward took longer:
    results/bench/changes.md#round_overlap). On other devices, and under ``torch.func.vmap`` (``zo.perturb_batch``,
    which cannot batch a layout change), the NCHW kernel is used as is.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or x.dim() != 4 or torch._C._functorch.is_batchedtensor(x):  # (vmap: NCHW)
            return super().forward(x)
        return super().forward(_ChannelsLastCopy.apply(x)).contiguous()


class _ChannelsLastCopy(torch.autograd.Function):
    """``x.contiguous(memory_format=torch.channels_last)`` whose gradient goes back in the NCHW layout."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, frozen_bn: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = _norm(c_out, frozen_bn)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = _norm(c_out, frozen_bn)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm(c_out, frozen_bn))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision-compatible ResNet-18 (same module names, so its state dict loads as is)."""

    def __init__(self, num_classes: int, in_channels: int = 3, frozen_bn: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = _norm(64, frozen_bn)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        c_in = 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(BasicBlock(c_in, w, stride, frozen_bn), BasicBlock(w, w, 1, frozen_bn))
            setattr(self, f"layer{i + 1}", layer)
            c_in = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, classes); the whole model, for pretraining
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNetClient(nn.Module):
    """Stem + residual stages 1..cut: z = f_c(x; θc)."""

    def __init__(self, net: ResNet18, cut: int) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.layers = nn.Sequential(*[getattr(net, f"layer{i}") for i in range(1, cut + 1)])

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, C', H', W')
        return self.layers(self.maxpool(self.relu(self.bn1(self.conv1(x)))))


class ResNetServer(nn.Module):
    """Residual stages cut+1..4 + pooling + classifier: ŷ = f_s(z; θs)."""

    def __init__(self, net: ResNet18, cut: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[getattr(net, f"layer{i}") for i in range(cut + 1, 5)])
        self.avgpool, self.fc = net.avgpool, net.fc

    def forward(self, z: Tensor) -> Tensor:  # (B, C', H', W') -> (B, classes)
        return self.fc(torch.flatten(self.avgpool(self.layers(z)), 1))


def load_pretrained(
    net: nn.Module, path: str, num_classes: int, head: str = "fc", what: str = "ResNet-18", reset_head: bool = False
) -> None:
    """Load a state dict of the whole model from a local file into ``net``; a classifier ``head`` of another number
    of classes (an ImageNet head, or a pretraining run on other classes), or any head with ``reset_head``, is dropped
    and ``net``'s new head kept."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.pretrained: weights file not found: {path}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a config problem for the user
        raise ConfigError(f"model.pretrained: cannot read {path}: {exc}") from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"model.pretrained: {path} holds a {type(state).__name__}, not a state dict")
    head_w = state.get(f"{head}.weight")
    if isinstance(head_w, Tensor) and (head_w.shape[0] != num_classes or reset_head):
        state = {k: v for k, v in state.items() if not k.startswith(f"{head}.")}
        why = "model.reset_head" if head_w.shape[0] == num_classes else f"{num_classes} classes here"
        logger.warning(f"note: model.pretrained: {path} has a {head_w.shape[0]}-class head ({head}); it is dropped "
                       f"({why}) and a new {num_classes}-class head initialised")  # fmt: skip
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # tensors of other shapes: another width, input size or architecture
        why = str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else str(exc)
        raise ConfigError(f"model.pretrained: {path} does not match {what} ({why})") from None
    missing = [k for k in missing if not k.startswith(f"{head}.")]
    if missing or unexpected:
        raise ConfigError(
            f"model.pretrained: {path} does not match {what} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def resnet18_split(
    num_classes: int,
    in_channels: int,
    cut: int,
    frozen_bn: bool | str = True,
    pretrained: str = "",
    reset_head: bool = False,
    first_order_client: bool = False,
) -> tuple:
    """(f_c, f_s) of ResNet-18 cut after stage ``cut``; ``frozen_bn``: ``model.freeze_bn`` (or a boolean);
    ``first_order_client``: the method's client back-propagates (see :func:`apply_bn_mode`)."""
    mode = bn_mode(frozen_bn)
    net = ResNet18(num_classes, in_channels, frozen_bn=True)  # other modes are derived from the frozen split
    if pretrained:
        load_pretrained(net, pretrained, num_classes, reset_head=reset_head)
    client, server = ResNetClient(net, cut), ResNetServer(net, cut)
    apply_bn_mode(client, server, mode, first_order_client)
    return client, server


class SmallCNN(nn.Module):
    """Two conv blocks (conv3x3-ReLU-maxpool) and a linear head: the whole model that :func:`small_cnn_split` cuts,
    and the layout of its pretrained state dict (``blocks.i.*``, ``head.*``)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: int) -> None:
        super().__init__()
        c, h, w = input_shape
        blocks = []
        for i in range(2):
            c_out = width * 2**i
            blocks.append(nn.Sequential(nn.Conv2d(c, c_out, 3, padding=1), nn.ReLU(), MaxPool2d(2)))
            c, h, w = c_out, h // 2, w // 2
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c * h * w, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, classes)
        for b in self.blocks:
            x = b(x)
        return self.head(torch.flatten(x, 1))


class SmallCNNClient(nn.Module):
    """The first blocks of :class:`SmallCNN` or :class:`ConvMLP`, one after the other."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class SmallCNNServer(nn.Module):
    """The other blocks of :class:`SmallCNN` or :class:`ConvMLP`, then the head on the flattened output."""

    def __init__(self, blocks: nn.ModuleList, head: nn.Module) -> None:
        super().__init__()
        self.blocks = blocks
        self.head = head

    def forward(self, z: Tensor) -> Tensor:
        for b in self.blocks:
            z = b(z)
        return self.head(torch.flatten(z, 1))


class ConvMLP(nn.Module):
    """A conv block (conv3x3-ReLU-maxpool, ``width`` channels), a hidden fully connected layer and another, both of
    ``hidden`` units (Linear-ReLU), and a linear head: the whole model that :func:`conv_mlp_split` cuts, in the layout
    of :class:`SmallCNN` (``blocks.i.*``, ``head.*``).

    At the quickstart's cut 2 the client keeps the conv block and the first hidden layer: ~2e5 parameters (d_c =
    10·width + 196·width·hidden + hidden on 28x28 inputs) at a forward cost of ~0.3 MFLOP·2 per sample, and the conv
    block's 28x28 activations are what a back-propagating client keeps for its backward; the server keeps the second
    hidden layer and the head.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: int, hidden: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), MaxPool2d(2)),  # (B, width, H/2, W/2)
            nn.Sequential(nn.Flatten(), nn.Linear(width * (h // 2) * (w // 2), hidden), nn.ReLU()),  # (B, hidden)
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        ])  # fmt: skip
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, classes)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


CONV_MLP_HIDDEN = 4
"""conv_mlp's hidden units per conv channel: ``hidden = 4 · model.width`` (64 at the quickstart's width 16)."""


def conv_mlp_split(
    num_classes: int,
    input_shape: tuple[int, int, int],
    cut: int,
    width: int,
    pretrained: str = "",
    reset_head: bool = False,
) -> tuple:
    """:class:`ConvMLP` of ``width`` channels and ``4 · width`` hidden units; the client keeps the first ``cut``
    blocks (1: the conv block; 2: and the first hidden layer)."""
    net = ConvMLP(num_classes, input_shape, width, CONV_MLP_HIDDEN * width)
    return _blocks_split(net, cut, num_classes, f"conv_mlp of width {width}", pretrained, reset_head)


def small_cnn_split(
    num_classes: int,
    input_shape: tuple[int, int, int],
    cut: int,
    width: int,
    pretrained: str = "",
    reset_head: bool = False,
) -> tuple:
    """Two conv blocks (conv3x3-ReLU-maxpool) and a linear head; the client keeps the first ``cut`` blocks."""
    net = SmallCNN(num_classes, input_shape, width)
    return _blocks_split(net, cut, num_classes, f"small_cnn of width {width}", pretrained, reset_head)


def _blocks_split(net: nn.Module, cut: int, num_classes: int, what: str, pretrained: str, reset_head: bool) -> tuple:
    """A network of ``blocks`` and a ``head`` (small_cnn, conv_mlp), its pretrained weights loaded where given: the
    client the first ``cut`` blocks, the server the rest and the head."""
    if pretrained:
        load_pretrained(net, pretrained, num_classes, "head", what, reset_head)
    blocks = list(net.blocks)
    return SmallCNNClient(nn.ModuleList(blocks[:cut])), SmallCNNServer(nn.ModuleList(blocks[cut:]), net.head)
