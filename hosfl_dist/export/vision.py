"""A split vision model back in one piece: the whole model's state dict as safetensors, and its one-call loader.

The whole model (:class:`~hosfl_dist.models.vision.SmallCNN`, :class:`~hosfl_dist.models.vision.ResNet18`) is built
and cut at the run's cut with the split's own part classes, so its halves share the whole model's modules; the
restored parts' state dicts load into them, and the whole model's state dict is what is saved (ResNet-18 in
torchvision's layout). Its BatchNorm layers are plain ones: in eval mode they normalise with the running statistics,
which is what every ``model.freeze_bn`` mode does in evaluation.

    model = load_vision("exported/")        # nn.Module in eval mode; inputs normalised as vision.json says

A plug-in's model (``register_model``, ``job.plugins``) has no whole model of the package's to load into: its export
is its two parts in one module (:class:`Joined`, state dict keys ``client.*`` and ``server.*``), and vision.json names
the plug-in modules, the model and the run's config, from which :func:`load_vision` imports the plug-ins and rebuilds
the parts with the model's own builder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hosfl_dist.export.restore import ExportError, Restored

WEIGHTS = "model.safetensors"
DESCRIPTION = "vision.json"
"""What :func:`load_vision` builds: model name, classes, input shape, width, and the inputs' normalisation."""


BUILT_IN = ("small_cnn", "conv_mlp", "resnet18")
"""The package's vision models, exported as the whole model (the others, a plug-in's, as :class:`Joined`)."""


class Joined(nn.Module):
    """A plug-in model's f_c then f_s, as one module: inputs -> class scores."""

    def __init__(self, client: nn.Module, server: nn.Module) -> None:
        super().__init__()
        self.client, self.server = client, server

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.server(self.client(x))


def whole_model(name: str, num_classes: int, input_shape: tuple[int, ...], width: int) -> nn.Module:
    from hosfl_dist.models import vision

    if name == "resnet18":
        return vision.ResNet18(num_classes, input_shape[0], frozen_bn=False)
    if name == "small_cnn":
        return vision.SmallCNN(num_classes, tuple(input_shape), width)
    if name == "conv_mlp":
        return vision.ConvMLP(num_classes, tuple(input_shape), width, vision.CONV_MLP_HIDDEN * width)
    raise ExportError(f"model.name={name!r} has no whole-model export")


def _halves(net: nn.Module, name: str, cut: int) -> tuple[nn.Module, nn.Module]:
    """The run's two parts over ``net``'s own modules (what ``resnet18_split`` / ``small_cnn_split`` /
    ``conv_mlp_split`` make)."""
    from hosfl_dist.models import vision

    if name == "resnet18":
        return vision.ResNetClient(net, cut), vision.ResNetServer(net, cut)
    blocks = list(net.blocks)
    client = vision.SmallCNNClient(nn.ModuleList(blocks[:cut]))
    return client, vision.SmallCNNServer(nn.ModuleList(blocks[cut:]), net.head)


def write_vision(restored: Restored, out: Path) -> dict[str, Any]:
    """model.safetensors (the whole model's state dict) and vision.json."""
    cfg = restored.cfg
    info = _info(restored)
    if cfg.model.name not in BUILT_IN:
        return _write_joined(restored, info, out)
    net = whole_model(cfg.model.name, info["num_classes"], info["input_shape"], cfg.model.width)
    client, server = _halves(net, cfg.model.name, cfg.split.cut)
    for half, part in ((client, restored.split.client), (server, restored.split.server)):
        try:
            half.load_state_dict(part.state_dict(), strict=True)
        except RuntimeError as exc:
            raise ExportError(f"the restored parts do not fit the whole {cfg.model.name}: {exc}") from None
    return _write(net, restored, info, out)


def _write_joined(restored: Restored, info: dict[str, Any], out: Path) -> dict[str, Any]:
    """model.safetensors (f_c and f_s, as :class:`Joined`'s state dict) and vision.json with what rebuilds them: the
    plug-in modules, the model, the run's config and whether its client was zeroth-order (the builder is told)."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.config.dump import config_to_dict

    cfg = restored.cfg
    plugin = {
        "plugins": list(cfg.job.plugins),
        "zeroth_order_client": get_algorithm(cfg.algorithm.name).zeroth_order_client,
        "config": config_to_dict(cfg),
    }
    return _write(Joined(restored.split.client, restored.split.server), restored, info, out, plugin)


def _write(
    net: nn.Module, restored: Restored, info: dict[str, Any], out: Path, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``net``'s state dict as model.safetensors and vision.json describing it (plus ``extra``)."""
    from safetensors.torch import save_file

    cfg = restored.cfg
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    description = {
        "model": cfg.model.name,
        "num_classes": info["num_classes"],
        "input_shape": list(info["input_shape"]),
        "width": cfg.model.width,
        "normalize": _normalisation(restored),
        **(extra or {}),
    }
    (out / DESCRIPTION).write_text(json.dumps(description, indent=2, default=str) + "\n")
    return {"format": "state_dict", "parameters": sum(v.numel() for v in state.values())}


def _joined(d: dict[str, Any]) -> nn.Module:
    """A plug-in model rebuilt from vision.json: its plug-ins imported, its parts built as the run built them."""
    from hosfl_dist.algorithms import load_plugins
    from hosfl_dist.config.load import build_config
    from hosfl_dist.errors import HosflError
    from hosfl_dist.models.registry import get_model

    try:
        load_plugins(d["plugins"], "vision.json plugins")
        cfg = build_config(d["config"])
        spec = get_model(d["model"])
    except HosflError as exc:
        raise ExportError(f"cannot rebuild {d['model']!r}: {exc}") from None
    assert spec.build is not None  # a vision model's spec has its builder (ModelSpec.__post_init__)
    info = {"num_classes": int(d["num_classes"]), "input_shape": tuple(d["input_shape"])}
    client, server = spec.build(cfg, info, bool(d["zeroth_order_client"]))
    return Joined(client, server)


def _info(restored: Restored) -> dict[str, Any]:
    from hosfl_dist.data import data_info
    from hosfl_dist.runtime.build import data_sections

    info = data_info(data_sections(restored.cfg))
    return {"num_classes": int(info["num_classes"]), "input_shape": tuple(int(d) for d in info["input_shape"])}


def _normalisation(restored: Restored) -> dict[str, list[float]] | None:
    """The per-channel (mean, std) the run normalised [0, 1] pixels with (None where its images cannot be read here)."""
    from hosfl_dist.data.vision import load_images
    from hosfl_dist.errors import HosflError

    cfg = restored.cfg
    try:
        images = load_images(cfg.data.name, cfg.data.root, cfg.job.seed)
    except HosflError:
        return None
    return {"mean": list(images.mean), "std": list(images.std)}


def load_vision(folder: str | Path, device: str | torch.device = "cpu", allow_unsigned: bool = False) -> nn.Module:
    """The exported vision model in ``folder``, whole, in eval mode: ``(B, C, H, W)`` normalised images -> logits.
    vision.json's ``normalize`` says how: ``(pixels / 255 - mean) / std`` per channel. The folder is verified against
    its signed manifest first (``allow_unsigned``: read one without a signature). A plug-in's model imports the
    plug-in modules vision.json names (they must be importable here, as for the run) and is rebuilt by its builder."""
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.runfolder.exported import verify_export
    from hosfl_dist.runfolder.signing import load_key

    folder = Path(folder)
    try:
        verify_export(folder, load_key(), allow_unsigned, "allow_unsigned=True")
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    return load_verified(folder, device)


def load_verified(folder: Path, device: str | torch.device = "cpu") -> nn.Module:
    """:func:`load_vision` of a folder its caller has verified already."""
    from safetensors.torch import load_file

    try:
        d = json.loads((folder / DESCRIPTION).read_text())
        state = load_file(str(folder / WEIGHTS))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{folder} holds no exported vision model ({DESCRIPTION}, {WEIGHTS}): {exc}") from None
    if "plugins" in d:
        net = _joined(d)
    else:
        net = whole_model(d["model"], int(d["num_classes"]), tuple(d["input_shape"]), int(d["width"]))
    net.load_state_dict(state, strict=True)
    return net.to(device).eval()


def evaluation_set(record: dict[str, Any], limit: int = 0) -> tuple[Any, torch.Tensor, Any]:
    """(inputs, labels, eval transform) of the run's evaluation set, rebuilt from the run's resolved config that
    hosfl_export.json holds (``config``) with the run's own data code: the same images, in the same order, normalised
    the same way (``data.eval_max_samples`` applied; ``limit``: the first ``limit`` of them). ExportError in one line
    where the record holds no config (an export of an earlier version) or the data cannot be read here."""
    from hosfl_dist.errors import ConfigError, DataError, HosflError

    raw = record.get("config")
    if not isinstance(raw, dict):
        raise ExportError("hosfl_export.json holds no run config (an export of an earlier version): export the run "
                          "again to predict its evaluation set")  # fmt: skip
    from hosfl_dist.algorithms import load_plugins
    from hosfl_dist.config.load import build_config
    from hosfl_dist.data import build_data
    from hosfl_dist.runtime.build import data_sections

    try:
        cfg = build_config(raw)
        if cfg.job.plugins:
            load_plugins(list(cfg.job.plugins))
        data = build_data(data_sections(cfg), clients=[], evaluation=True)
    except (ConfigError, DataError, HosflError) as exc:
        raise ExportError(f"cannot rebuild the run's evaluation set ({cfg_name(raw)}): {exc}") from None
    inputs, labels = data.eval_inputs, data.eval_labels
    if limit:
        inputs, labels = inputs[:limit], labels[:limit]
    return inputs, labels, data.eval_transform


def cfg_name(raw: dict[str, Any]) -> str:
    """``data.name`` of a config dict, for messages."""
    return f"data.name={(raw.get('data') or {}).get('name')!r}"


def predict_images(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, transform: Any, batch_size: int, step: Any = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(a row per image, the metrics): the run's evaluation of ``model`` — consecutive batches of ``batch_size``,
    each through the eval transform, the prediction the highest logit. ``step()`` is called after each batch."""
    device = next(model.parameters()).device
    out: list[dict[str, Any]] = []
    with torch.no_grad():
        for start in range(0, len(labels), batch_size):
            x = inputs[start : start + batch_size]
            x = transform(x, None) if transform is not None else x
            logits = model(x.to(device)).float().cpu()  # (B, classes)
            for i, row in enumerate(logits, start):
                k, gold = int(row.argmax()), int(labels[i])
                out.append({"index": i, "prediction": k, "label": k, "gold": gold, "correct": k == gold,
                            "scores": row.tolist()})  # fmt: skip
            if step is not None:
                step()
    n = len(out)
    return out, {"examples": n, "accuracy": sum(r["correct"] for r in out) / max(n, 1)}


def normalise(pixels: torch.Tensor, description: dict[str, Any]) -> torch.Tensor:
    """uint8 (B, C, H, W) -> the model's inputs, as vision.json's ``normalize`` says (float pixels as they are when
    it names none)."""
    norm = description.get("normalize")
    if norm is None:
        return pixels.float()
    from hosfl_dist.data.vision import normalize

    return normalize(pixels, tuple(norm["mean"]), tuple(norm["std"]))
