"""Vision models cut into a client part and a server part.

ResNet-18 follows torchvision's layout and parameter names, so an ImageNet state dict saved by torchvision loads
from a local file (``model.pretrained``); the cut falls after residual stage ``split.cut`` (the paper cuts after the
2nd). BatchNorm is frozen (App. B.2): its statistics and affine parameters never change, which also makes batching
the K clients' activations on the server exactly equal to processing them one by one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from hosfl_dist.errors import ConfigError


class FrozenBatchNorm(nn.BatchNorm2d):
    """BatchNorm that always uses its running statistics and never trains (App. B.2)."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        for p in self.parameters():
            p.requires_grad_(False)

    def train(self, mode: bool = True) -> FrozenBatchNorm:
        return super().train(False)


def _norm(c: int, frozen: bool) -> nn.Module:
    return FrozenBatchNorm(c) if frozen else nn.BatchNorm2d(c)


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
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        c_in = 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(BasicBlock(c_in, w, stride, frozen_bn), BasicBlock(w, w, 1, frozen_bn))
            setattr(self, f"layer{i + 1}", layer)
            c_in = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)


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


def load_pretrained(net: nn.Module, path: str, num_classes: int) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.pretrained: weights file not found: {path}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a config problem for the user
        raise ConfigError(f"model.pretrained: cannot read {path}: {exc}") from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if state.get("fc.weight") is not None and state["fc.weight"].shape[0] != num_classes:
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}  # new head for our classes
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("fc.")]
    if missing or unexpected:
        raise ConfigError(
            f"model.pretrained: {path} does not match ResNet-18 (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def resnet18_split(num_classes: int, in_channels: int, cut: int, frozen_bn: bool, pretrained: str = "") -> tuple:
    net = ResNet18(num_classes, in_channels, frozen_bn)
    if pretrained:
        load_pretrained(net, pretrained, num_classes)
    return ResNetClient(net, cut), ResNetServer(net, cut)


class SmallCNNClient(nn.Module):
    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class SmallCNNServer(nn.Module):
    def __init__(self, blocks: nn.ModuleList, head: nn.Module) -> None:
        super().__init__()
        self.blocks = blocks
        self.head = head

    def forward(self, z: Tensor) -> Tensor:
        for b in self.blocks:
            z = b(z)
        return self.head(torch.flatten(z, 1))


def small_cnn_split(num_classes: int, input_shape: tuple[int, int, int], cut: int, width: int) -> tuple:
    """Two conv blocks (conv3x3-ReLU-maxpool) and a linear head; the client keeps the first ``cut`` blocks."""
    c, h, w = input_shape
    blocks = []
    for i in range(2):
        c_out = width * 2**i
        blocks.append(nn.Sequential(nn.Conv2d(c, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)))
        c, h, w = c_out, h // 2, w // 2
    head = nn.Linear(c * h * w, num_classes)
    return SmallCNNClient(nn.ModuleList(blocks[:cut])), SmallCNNServer(nn.ModuleList(blocks[cut:]), head)
