"""Split models: a client part f_c, a server part f_s, and the task that turns server outputs into loss and metrics.

``model.name`` selects from :mod:`hosfl_dist.models.registry` (small_cnn, conv_mlp, resnet18 and hf register at the
bottom of this module; a plug-in's with :func:`~hosfl_dist.models.registry.register_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.config import Config, ModelConfig
from hosfl_dist.core.plugins import plugin_call, plugin_of, refuse
from hosfl_dist.core.seeding import Stream, stream_seed
from hosfl_dist.errors import ConfigError
from hosfl_dist.models.registry import ModelSpec, get_model, model_names, register_model
from hosfl_dist.tasks import Task
from hosfl_dist.tasks.classification import ClassificationTask

Activation = dict[str, Tensor]
"""What the client sends the server: ``"z"`` is f_c's output (λ is ∂ℓ/∂z); other keys are side inputs the server
needs (e.g. attention masks), counted as uplink activation traffic too."""


@dataclass(frozen=True)
class ActivationSpec:
    """What a well-formed upload looks like, so the server refuses anything else (fail closed).

    ``shapes`` gives each field's shape per sample, None for a sequence length (1..``max_len``, the same for every
    field of one upload); labels are class indices in 0..``num_classes``-1, or token labels (-100 or 0..``vocab``-1)
    of the upload's length.
    """

    shapes: dict[str, tuple[int | None, ...]]
    dtypes: dict[str, torch.dtype]
    max_len: int | None = None
    num_classes: int | None = None
    vocab: int | None = None

    def problem(self, act: Any, labels: Any, batch_size: int) -> str | None:
        """What is wrong with an upload of at most ``batch_size`` samples (None: nothing)."""
        if not isinstance(act, dict) or set(act) != set(self.shapes):
            got = sorted(act) if isinstance(act, dict) else type(act).__name__
            return f"an activation with fields {got}, expected {sorted(self.shapes)}"
        n, length = None, None
        for k, v in act.items():
            want = self.shapes[k]
            if not isinstance(v, Tensor) or v.dtype != self.dtypes[k] or v.dim() != len(want) + 1:
                got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, Tensor) else type(v).__name__
                dims = ", ".join("T" if w is None else str(w) for w in want)
                return f"{k} as {got}, expected (B, {dims}) {self.dtypes[k]}"
            n = v.shape[0] if n is None else n
            for got, w in zip(v.shape[1:], want):
                if w is None:
                    length = got if length is None else length
                    if got != length or not 1 <= got <= (self.max_len or got):
                        return f"{k} of length {got} (at most {self.max_len}, the same for every field)"
                elif got != w:
                    return f"{k} of shape {tuple(v.shape)}, expected (B, {', '.join(map(str, want))})"
            if v.shape[0] != n:
                return f"fields of different batch sizes ({n} and {v.shape[0]})"
        if not 1 <= n <= batch_size:
            return f"a batch of {n} samples (clients.batch_size is {batch_size})"
        if not isinstance(labels, Tensor) or labels.dtype != torch.long or labels.dim() == 0 or labels.shape[0] != n:
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            return f"labels {got}, expected {n} int64 labels"
        if self.num_classes is not None:
            if labels.dim() != 1 or not bool(((labels >= 0) & (labels < self.num_classes)).all()):
                return f"labels outside 0..{self.num_classes - 1}"
        else:
            in_vocab = (labels == -100) | ((labels >= 0) & (labels < (self.vocab or 0)))
            if labels.shape[1:] != (length,) or not bool(in_vocab.all()):
                return "token labels of another length or outside the vocabulary"
        return None


@dataclass
class SplitModel:
    client: nn.Module
    server: nn.Module
    task: Task
    spec: ActivationSpec | None = None
    """What the client uploads (built from both parts, so it survives dropping the client part)."""

    def client_forward(self, inputs: Any) -> Activation:
        return as_activation(self.client(**inputs) if isinstance(inputs, dict) else self.client(inputs))

    def keep(self, parts: tuple[str, ...]) -> SplitModel:
        """Drop the parts a role does not hold ("client", "server"), so their memory is freed."""
        for part in ("client", "server"):
            if part not in parts:
                setattr(self, part, None)
        return self


def as_activation(out: Tensor | Activation) -> Activation:
    return out if isinstance(out, dict) else {"z": out}


def server_forward(server: nn.Module, act: Activation) -> Tensor:
    """f_s on an activation: vision servers take z; servers with side inputs take the whole dict."""
    return server(act["z"]) if len(act) == 1 else server(act)


def build_split_model(
    cfg: Config,
    data_info: dict[str, Any],
    zeroth_order_client: bool,
    parts: Sequence[str] = ("client", "server"),
    shard: Callable[[nn.Module], Any] | None = None,
) -> SplitModel:
    """Build f_c and f_s with weights that depend only on ``job.seed`` (identical in every process and layout).

    ``zeroth_order_client``: whether the method's client is zeroth-order (its registry entry says; the caller asks
    it), which keeps an LM client part free of dropout; vision models ignore it. ``parts``: the parts this process
    runs; an LM is built on the meta device and only these are materialised (of the others, only their trainable
    tensors). ``shard`` is applied to f_s before its weights exist (FSDP2 over the server group), so a server rank
    materialises only its shard. Vision models are small: built whole, then sharded. A server normalising with batch
    statistics needs one server rank and whole client batches (:func:`hosfl_dist.runtime.checks.check_config`).
    A vision split scores with ``data_info["scorer"]`` where the data gives one (a plug-in task's loss and metrics),
    classification otherwise.
    """
    model = get_model(cfg.model.name)
    if model.family == "hf":  # split decoder LM + LoRA + task head (hosfl_dist.models.lm)
        from hosfl_dist.models import lm

        return lm.build(cfg, data_info, zeroth_order_client, parts, shard)
    assert model.build is not None  # a vision model's spec has its builder (ModelSpec.__post_init__)
    built = f"model {model.name}: build(config, data info, zeroth_order_client)"
    with torch.random.fork_rng(devices=[]), plugin_call(model.build, built):
        torch.manual_seed(stream_seed(cfg.job.seed, Stream.VISION_INIT))
        pair = model.build(cfg, data_info, zeroth_order_client)
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(m, nn.Module) for m in pair)):
        raise refuse(model.build, built, f"gave {type(pair).__name__}, not the pair (f_c, f_s) of torch modules")
    client, server = pair
    device = torch.device(cfg.job.device)
    x = torch.zeros(1, *data_info["input_shape"])
    z = _probe(client, x, model, f"model {model.name}: f_c on a batch of shape {tuple(x.shape)}")
    if plugin_of(model.build) is not None:  # the package's own fit their task by construction
        _check_server(server, z, model, data_info["num_classes"])
    scorer = data_info.get("scorer") or ClassificationTask()
    scorer.check(data_info["num_classes"])  # a plug-in task's loss and metrics, on a made-up batch
    spec = ActivationSpec({"z": tuple(z.shape[1:])}, {"z": z.dtype}, num_classes=data_info["num_classes"])
    server = server.to(device)
    if shard is not None:
        shard(server)
    return SplitModel(client.to(device), server, scorer, spec)


def _probe(part: nn.Module, x: Tensor, model: ModelSpec, what: str) -> Tensor:
    """``part`` (f_c or f_s) on a made-up batch in eval mode, without gradients (BatchNorm statistics and the weights
    stay as they are); what a plug-in's part raises is one line naming it (``what``: the call)."""
    was = part.training
    try:
        with torch.no_grad(), plugin_call(model.build, what):
            out = part.eval()(x)
    finally:
        part.train(was)
    if not isinstance(out, Tensor):
        raise refuse(model.build, what, f"gave {type(out).__name__}, not a tensor")
    return out


def _check_server(server: nn.Module, z: Tensor, model: ModelSpec, classes: int) -> None:
    """A plug-in's f_s takes what its f_c gives (one sample's z) and gives the task's class scores, (1, classes): a
    head of another width would train without an error (surplus classes never labelled) or fail in the first round."""
    with torch.random.fork_rng(devices=[]):  # a module that draws in its forward leaves the run's streams alone
        out = _probe(server, z, model, f"model {model.name}: f_s on f_c's output of shape {tuple(z.shape)}")
    if tuple(out.shape) != (1, classes):
        raise refuse(model.build, f"model {model.name}: f_s", f"gives class scores of shape {tuple(out.shape)} for one "
                     f"sample; the task has {classes} classes (data info num_classes): its head must give (1, "
                     f"{classes})")  # fmt: skip


def build_whole_vision_model(model: ModelConfig, data_info: dict[str, Any], seed: int, device: str) -> nn.Module:
    """The uncut vision model with trainable BatchNorm (train mode: batch statistics, running statistics updated),
    initialised from ``seed`` (job.seed) on ``device``: what ``python -m hosfl_dist.experiments.pretrain`` trains.
    Its state dict is in the layout ``model.pretrained`` loads (torchvision's for ResNet-18)."""
    spec = get_model(model.name)
    if spec.whole is None:
        raise ConfigError(f"invalid value for model.name: {model.name!r} (pretraining is implemented for the "
                          f"vision models {pretrainable_models()})")  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, Stream.VISION_INIT))
        with plugin_call(spec.whole, f"model {model.name}: whole(model section, data info)"):
            net = spec.whole(model, data_info)
    return net.to(torch.device(device))


def pretrainable_models() -> list[str]:
    """The ``model.name`` values :func:`build_whole_vision_model` builds (their spec has ``whole``)."""
    return [n for n in model_names() if get_model(n).whole is not None]


def _resnet18(cfg: Config, info: dict[str, Any], zeroth_order_client: bool) -> tuple[nn.Module, nn.Module]:
    from hosfl_dist.models import vision

    m = cfg.model
    return vision.resnet18_split(info["num_classes"], info["input_shape"][0], cfg.split.cut, m.freeze_bn,
                                 m.pretrained, m.reset_head, first_order_client=not zeroth_order_client)  # fmt: skip


def _small_cnn(cfg: Config, info: dict[str, Any], zeroth_order_client: bool) -> tuple[nn.Module, nn.Module]:
    """No BatchNorm: model.freeze_bn does not apply."""
    from hosfl_dist.models import vision

    m = cfg.model
    return vision.small_cnn_split(info["num_classes"], info["input_shape"], cfg.split.cut, m.width, m.pretrained,
                                  m.reset_head)  # fmt: skip


def _conv_mlp(cfg: Config, info: dict[str, Any], zeroth_order_client: bool) -> tuple[nn.Module, nn.Module]:
    """No BatchNorm: model.freeze_bn does not apply."""
    from hosfl_dist.models import vision

    m = cfg.model
    return vision.conv_mlp_split(info["num_classes"], info["input_shape"], cfg.split.cut, m.width, m.pretrained,
                                 m.reset_head)  # fmt: skip


def _whole_resnet18(model: ModelConfig, info: dict[str, Any]) -> nn.Module:
    from hosfl_dist.models import vision

    return vision.ResNet18(info["num_classes"], info["input_shape"][0], frozen_bn=False)


def _whole_small_cnn(model: ModelConfig, info: dict[str, Any]) -> nn.Module:
    from hosfl_dist.models import vision

    return vision.SmallCNN(info["num_classes"], info["input_shape"], model.width)


def _whole_conv_mlp(model: ModelConfig, info: dict[str, Any]) -> nn.Module:
    from hosfl_dist.models import vision

    return vision.ConvMLP(info["num_classes"], info["input_shape"], model.width, vision.CONV_MLP_HIDDEN * model.width)


register_model(ModelSpec("small_cnn", _small_cnn, cuts=(1, 2), whole=_whole_small_cnn))
register_model(ModelSpec("conv_mlp", _conv_mlp, cuts=(1, 2), whole=_whole_conv_mlp))
register_model(ModelSpec("resnet18", _resnet18, cuts=(1, 3), whole=_whole_resnet18))
register_model(ModelSpec("hf", None, family="hf"))  # its depth is the checkpoint's: checked where it is built
