"""What the memory profiler runs: one client, one batch, and one step of a method through its own worker code.

    inference   z = f_c(x) under no_grad (the floor every method pays)
    hosfl       ``HOSFLWorker.run_round`` for one sampled client: z, the P perturbed forwards z̃_p = f_c(x; θ + μu_p)
                (Eq. 12) each projected on λ (Eq. 13), and the tensorwise optimizer step (Eq. 15-16); the replica's
                optimizer state is held between rounds
    sfl         ``SFLWorker.train_client`` for one step: forward with autograd, backward from λ, AdamW step (a fresh
                optimizer every round, as SFL clients keep no state)
    zo_sfl      ``ZOSFLWorker.train_client`` for one step: the two perturbed forwards (±μu) whose activations go up
                together, the seeded update with the returned scalar
    full_local  the whole model trained on the client: ``SFLWorker.train_client`` with a real ``SFLServer`` in the
                same process (f_c and f_s forward and backward, both optimizers); the server's per-round copy of its
                trainable tensors is made before measuring, so the figure is the single-device training step's
The server of the other modes is :class:`~hosfl_dist.measure.standin.StandInServer`.

Every other method of the registry (a plug-in's included: ``ProfileSpec.plugins``) is a mode too, named by its
``algorithm.name``, measured as the built-in its worker derives from: a round of a ``HOSFLWorker`` as ``hosfl``, the
client step of an ``ExchangeWorker`` as ``sfl`` (``zo_sfl`` for a zeroth-order client), against the same stand-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from hosfl_dist.config import Config, build_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.measure.standin import NoPeers, OneBatch, StandInServer
from hosfl_dist.measure.tracker import ModeStep, storage_bytes
from hosfl_dist.models import SplitModel, get_model
from hosfl_dist.models.sources import DTYPES
from hosfl_dist.runtime.build import method_config
from hosfl_dist.runtime.checks import check_config
from hosfl_dist.tasks.classification import ClassificationTask
from hosfl_dist.tasks.generation import lm_loss

MODES = ("inference", "hosfl", "sfl", "zo_sfl", "full_local")
"""The default modes; :func:`mode_names` adds the other registered methods the profiler can drive."""
VISION_INPUTS = {"small_cnn": ((1, 28, 28), 10), "conv_mlp": ((1, 28, 28), 10), "resnet18": ((3, 32, 32), 10)}
"""Input shape and classes of the vision models: Fashion-MNIST for small_cnn and conv_mlp, CIFAR-10 for ResNet-18."""
_ALGORITHM = {"full_local": "sfl"}
"""The method whose worker runs a mode not named after it."""


@dataclass(frozen=True)
class ProfileSpec:
    """One client to profile: model, cut and batch shape, and the zeroth-order settings of HO-SFL / ZO-SFL."""

    model: str = "tiny:llama"
    """tiny:<arch> (random tiny LM), arch:<name> (a published shape, random weights), pkg:<python package holding a
    .gguf>, a local HF directory or .gguf path, small_cnn or conv_mlp (Fashion-MNIST input) or resnet18 (CIFAR-10
    input)."""
    cut: int = 2
    """Client depth: decoder blocks (LMs), conv blocks (small_cnn), blocks (conv_mlp), residual stages (resnet18)."""
    width: int = 16
    """model.width of small_cnn and conv_mlp."""
    input_shape: tuple[int, ...] = ()
    """Vision models: one sample's shape (C, H, W) and ``classes`` its classes; () = the model's data set in
    :data:`VISION_INPUTS`."""
    classes: int = 10
    batch: int = 32
    """Samples per client step (the paper's 32)."""
    seq: int = 128
    """Tokens per sequence (LMs only)."""
    num_perturbations: int = 0
    """P; 0 = the paper's default for the model (2 for LMs, 5 for vision, App. B)."""
    mu: float = 1e-3
    """μ of the perturbations."""
    client_optim: str = "adamw"
    """clients.optim.name: adamw keeps two moments of θc (HO-SFL's replica between rounds, SFL's within a round)."""
    momentum: float = 0.0
    """clients.optim.momentum of sgd (> 0: a momentum buffer of θc)."""
    lora: bool = True
    """LMs: LoRA r=8, α=16 on q_proj/v_proj (the paper's setting) with the base frozen; False = full fine-tuning."""
    dtype: str = "float32"
    """LM parameter dtype (float32, bfloat16, float16)."""
    compute_dtype: str = "auto"
    """zo.compute_dtype of the zeroth-order clients: auto/float32 = float32 forwards over the stored weights (one
    module upcast at a time, float32 activations), model = forwards in ``dtype``."""
    device: str = "cpu"
    """Torch device of the client."""
    rng_device: str = "cpu"
    """zo.rng_device: where the perturbations are drawn (cpu: the default stream, moved to ``device``; cuda)."""
    gguf_file: str = ""
    """GGUF file inside the model directory / package (default: the only .gguf file there)."""
    seed: int = 0
    """Weights, batch and stand-in values derive from it."""
    overlap: bool = False
    """hosfl: latency hiding (zo.overlap): the P perturbed forwards run before λ arrives and are all kept until it
    does; False: λ is received first and each z̃ is projected as soon as it is computed."""
    noise_cache_mb: float = 0.0
    """hosfl: zo.noise_cache_mb, the round's draws of u kept from the perturbed forwards to the update (P·d_c·4 bytes
    where they fit; 0, the config default: drawn again)."""
    perturb_batch: int = 1
    """hosfl: zo.perturb_batch, the perturbed forwards run together as one batched forward (1: one at a time)."""
    perturb_mode: str = "hooks"
    """zo.perturb_mode: hooks (one module perturbed at a time) or copy (a perturbed copy of θc)."""
    compile: str = "off"
    """hosfl: zo.compile, the client's ZO forwards through ``torch.compile`` in this mode (needs perturb_mode=copy)."""
    plugins: tuple[str, ...] = ()
    """Modules imported first (``--plugin``, as ``job.plugins``): the methods they register are modes too."""

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ConfigError(f"--batch must be >= 1, got {self.batch}")
        if self.seq < 2:
            raise ConfigError(f"--seq must be >= 2, got {self.seq}")
        if self.num_perturbations < 0:
            raise ConfigError(f"--P must be >= 1 (or 0 for the paper's default), got {self.num_perturbations}")
        if not self.mu > 0:
            raise ConfigError(f"--mu must be > 0, got {self.mu}")
        if self.client_optim not in ("adamw", "sgd"):
            raise ConfigError(f"--client-optim must be adamw or sgd, got {self.client_optim!r}")
        if self.classes < 1:
            raise ConfigError(f"--classes must be >= 1, got {self.classes}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.compute_dtype not in ("auto", "float32", "model"):
            raise ConfigError(f"compute_dtype {self.compute_dtype!r} is not one of auto, float32, model")
        if self.model in VISION_INPUTS:
            lo, hi = get_model(self.model).cuts
            if not lo <= self.cut <= hi:
                raise ConfigError(f"--cut {self.cut} is out of range for {self.model}: need {lo} <= cut <= {hi}")
        for key, dev in (("--device", self.device), ("rng_device", self.rng_device)):
            if dev.startswith("cuda") and not torch.cuda.is_available():
                raise ConfigError(f"{key} {dev}: CUDA is not available on this machine")

    @property
    def is_lm(self) -> bool:
        return self.model not in VISION_INPUTS

    @property
    def P(self) -> int:  # noqa: N802 - the paper's symbol
        return self.num_perturbations or (2 if self.is_lm else 5)


class NextTokenTask:
    """full_local on an LM: the causal LM loss on every position (the labels are the input ids)."""

    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        return lm_loss(outputs, labels)


@dataclass
class Setup:
    """What the client holds: the split model (the server part only for full_local) and one batch."""

    split: SplitModel
    inputs: Any
    """x_m: a tensor, or a dict of tensors passed as keyword arguments (LMs: input_ids, attention_mask)."""
    labels: Tensor


def build_setup(spec: ProfileSpec, whole: bool = False) -> Setup:
    """f_c (and, with ``whole``, f_s) and one deterministic batch."""
    gen = torch.Generator().manual_seed(spec.seed)
    device = torch.device(spec.device)
    if not spec.is_lm:
        from hosfl_dist.models import vision

        shape, classes = (spec.input_shape, spec.classes) if spec.input_shape else VISION_INPUTS[spec.model]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            if spec.model == "small_cnn":
                client, server = vision.small_cnn_split(classes, shape, spec.cut, width=spec.width)
            elif spec.model == "conv_mlp":
                client, server = vision.conv_mlp_split(classes, shape, spec.cut, width=spec.width)
            else:
                client, server = vision.resnet18_split(classes, shape[0], spec.cut, frozen_bn=True)
        x = torch.randn(spec.batch, *shape, generator=gen).to(device)
        y = torch.randint(0, classes, (spec.batch,), generator=gen).to(device)
        split = SplitModel(client.to(device), server.to(device) if whole else None, ClassificationTask())
        return Setup(split, x, y)

    if spec.lora and not whole:  # the worker's own build: f_c alone materialised (arch: sources included)
        return _client_setup(spec, gen, device)
    from hosfl_dist.config import LoraConfig
    from hosfl_dist.models.hf_split import apply_lora, num_decoder_layers, split_causal_lm
    from hosfl_dist.models.sources import load_model, resolve

    model = load_model(resolve(spec.model, spec.gguf_file, key="--model"), spec.dtype, local_files_only=True)
    n_layers = num_decoder_layers(model)
    if not 1 <= spec.cut < n_layers:
        raise ConfigError(f"--cut {spec.cut} is out of range for {spec.model}: need 1 <= cut < {n_layers}")
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (spec.batch, spec.seq), generator=gen).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    client, server = split_causal_lm(model, spec.cut)  # tied embeddings stay tied: one device holds them once
    del model  # the client keeps only its blocks; the rest is freed unless the whole model is trained here
    lora = LoraConfig()  # the paper's r=8, α=16 on q_proj/v_proj (App. B)
    if spec.lora:
        apply_lora(client, list(lora.client_targets), lora.r, lora.alpha, lora.dropout, seed=spec.seed)
        if whole:
            apply_lora(server, list(lora.server_targets), lora.r, lora.alpha, lora.dropout, seed=spec.seed + 1)
    if not whole:
        del server
        return Setup(SplitModel(client.to(device), None, NextTokenTask()), inputs, ids)
    return Setup(SplitModel(client.to(device), server.to(device), NextTokenTask()), inputs, ids)


def _client_setup(spec: ProfileSpec, gen: torch.Generator, device: torch.device) -> Setup:
    """An LM's f_c with the paper's LoRA as a client worker builds it (``models.lm.build`` with parts=("client",):
    a meta-device model of which only f_c gets values), and one batch of random token ids."""
    from hosfl_dist.data import data_info
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    cfg = worker_config(spec, "hosfl")
    # the bare f_c, as before the worker wraps it (a zeroth-order worker only pins it to eval mode: no dropout)
    split = build_split_model(cfg, data_info(data_sections(cfg)), zeroth_order_client=False, parts=("client",))
    ids = torch.randint(0, split.spec.vocab, (spec.batch, spec.seq), generator=gen).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return Setup(SplitModel(split.client, None, NextTokenTask()), inputs, ids)


def step_kind(method: str) -> str | None:
    """How the profiler drives ``method``'s worker: ``round`` (a HOSFLWorker: its run_round against the stand-in),
    ``client`` (an ExchangeWorker: its train_client for one step), or None (it cannot)."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.algorithms.exchange import ExchangeWorker
    from hosfl_dist.algorithms.hosfl import HOSFLWorker

    worker = get_algorithm(method).worker
    return "round" if issubclass(worker, HOSFLWorker) else "client" if issubclass(worker, ExchangeWorker) else None


def zeroth_order(method: str) -> bool:
    from hosfl_dist.algorithms import get_algorithm

    return get_algorithm(method).zeroth_order_client


def worker_parts(method: str) -> tuple[str, ...]:
    """The model parts ``method``'s client worker holds (f_s too where the client derives something from it)."""
    from hosfl_dist.algorithms import get_algorithm

    return get_algorithm(method).worker_parts


def mode_names(plugins: Sequence[str] = ()) -> list[str]:
    """:data:`MODES`, then every other registered method the profiler can drive (``plugins`` imported first)."""
    from hosfl_dist.algorithms import algorithm_names, load_plugins

    load_plugins(tuple(plugins), "--plugin")
    return [*MODES, *(m for m in algorithm_names() if m not in MODES and step_kind(m) is not None)]


def check_modes(modes: Sequence[str], plugins: Sequence[str] = ()) -> None:
    """ConfigError for a mode the profiler does not know (after importing ``plugins``)."""
    known = mode_names(plugins)
    for m in modes:
        if m not in known:
            raise ConfigError(f"unknown mode {m!r}; choose from {', '.join(known)}")


RUN_MODE = {"hosfl": "hosfl", "sfl": "sfl", "splitlora": "sfl", "zo_sfl": "zo_sfl", "frozen_client": "inference"}
"""The mode that runs each method's client where it is not the method's own name (the frozen client runs f_c forward
only: inference); any other method the profiler drives (a plug-in's included) is its own mode."""


def run_mode(cfg: Config) -> str | None:
    """The mode that measures the client of the run ``cfg`` (None: the profiler cannot drive its method)."""
    own = cfg.algorithm.name if cfg.algorithm.name in mode_names(cfg.job.plugins) else None
    return RUN_MODE.get(cfg.algorithm.name, own)


def run_spec(cfg: Config, mode: str) -> ProfileSpec:
    """The client of the run ``cfg`` as the profiler builds it: its model, cut, batch and zeroth-order settings (with
    latency hiding where the run would keep the P z̃ of a ``hosfl`` client). The weights are the profiler's own
    (random, seeded by job.seed): what is measured is the memory of the shapes, not of the trained values."""
    import dataclasses

    spec = ProfileSpec(
        model=cfg.model.source if cfg.model.name == "hf" else cfg.model.name,
        cut=cfg.split.cut,
        width=cfg.model.width,
        batch=cfg.clients.batch_size,
        seq=cfg.data.max_length,
        num_perturbations=cfg.zo.num_perturbations,
        mu=cfg.zo.mu,
        client_optim=cfg.clients.optim.name,
        momentum=cfg.clients.optim.momentum,
        dtype=cfg.model.dtype,
        device=cfg.job.device,
        gguf_file=cfg.model.gguf_file,
        seed=cfg.job.seed,
        plugins=tuple(cfg.job.plugins),
    )
    if not spec.is_lm:  # the run's own data shape (a synthetic task's is not Fashion-MNIST's)
        from hosfl_dist.data import data_info
        from hosfl_dist.runtime.build import data_sections

        info = data_info(data_sections(cfg))
        spec = dataclasses.replace(spec, input_shape=tuple(info["input_shape"]), classes=info["num_classes"])
    if mode == "hosfl" and cfg.zo.overlap is not False:  # latency hiding keeps P z̃ of the profiled client
        z_bytes = expected_costs(spec, [mode])[0].z_bytes
        spec = dataclasses.replace(spec, overlap=cfg.zo.overlap_on(cfg.zo.num_perturbations * z_bytes))
    return spec


def worker_config(spec: ProfileSpec, algorithm: str) -> Config:
    """The run config a profiled worker sees: the zo and clients sections, and model.dtype (what a zeroth-order
    client computes in and uploads follows from it)."""
    tree = build_config(
        {
            "algorithm": {"name": algorithm},
            # model and data just have to be a valid pair
            "model": {"name": "hf", "source": spec.model, "dtype": spec.dtype, "gguf_file": spec.gguf_file}
            if spec.is_lm
            else {"name": spec.model, "width": spec.width},
            "data": {"name": "sst2" if spec.is_lm else "synthetic"},
            "split": {"cut": spec.cut},
            "zo": {
                "num_perturbations": spec.P,
                "mu": spec.mu,
                "perturb_mode": spec.perturb_mode,
                "overlap": spec.overlap,
                "compute_dtype": spec.compute_dtype,
                "rng_device": spec.rng_device,
                "noise_cache_mb": spec.noise_cache_mb,
                "perturb_batch": spec.perturb_batch,
                "compile": spec.compile,
            },
            "clients": {"total": 1, "per_round": 1, "batch_size": spec.batch, "replicas": "shared",
                        "optim": {"name": spec.client_optim, "momentum": spec.momentum}},
            "train": {"budget_samples": spec.batch},
            "job": {"seed": spec.seed, "device": spec.device, "progress": False, "plugins": list(spec.plugins)},
        }
    )
    return check_config(tree)


def profiled_worker(spec: ProfileSpec, setup: Setup, algorithm: str, transport: Any = None) -> Any:
    """The method's worker hosting client 0, talking to the stand-in server (or to ``transport``)."""
    from hosfl_dist.algorithms import get_algorithm
    worker_cls = get_algorithm(algorithm).worker
    transport = transport or StandInServer(spec.seed, spec.P)
    data = OneBatch(setup.inputs, setup.labels)
    return worker_cls(method_config(worker_config(spec, algorithm)), setup.split, data, [0], transport, NoPeers())


def module_tensors(module: nn.Module) -> list[Tensor]:
    """Parameters, buffers and plain tensor attributes of every submodule."""
    out = list(module.parameters()) + list(module.buffers())
    for mod in module.modules():
        out += [v for v in vars(mod).values() if isinstance(v, Tensor)]
    return out


def flat(obj: Any) -> list[Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, Tensor)]


def make_step(mode: str, spec: ProfileSpec, setup: Setup | None = None) -> ModeStep:
    """Build the client (unless ``setup`` is given) and the function that runs one step of ``mode`` on it."""
    check_modes([mode], spec.plugins)
    method = _ALGORITHM.get(mode, mode)
    both = mode == "full_local" or (mode != "inference" and "server" in worker_parts(method))  # fsl_sage's f_s too
    setup = setup or build_setup(spec, whole=both)
    split, x = setup.split, setup.inputs
    split.client.train()  # dropout-free models here; train() only matters for frozen BN, which stays frozen
    modules = [split.client] + ([split.server] if both else [])
    held = nn.ModuleDict({"client": split.client, "server": split.server}) if both else split.client

    def resident(*extra: Tensor) -> list[Tensor]:  # what the client holds between steps (after any binding)
        return [*(t for m in modules for t in module_tensors(m)), *extra, *flat(x)]

    with torch.no_grad():
        act_bytes = storage_bytes([split.client_forward(x)["z"]]) if mode != "full_local" else 0

    if mode == "inference":

        def inference_step() -> None:
            with torch.no_grad():
                split.client_forward(x)  # z goes up; nothing comes back

        return ModeStep(inference_step, resident(), held, [], [], act_bytes)

    if step_kind(method) == "round":
        worker = profiled_worker(spec, setup, method)
        rep = worker.replicas[0]
        rep.opt.step(rep.params, lambda ids, ps: [torch.zeros_like(p) for p in ps])  # optimizer state as after round 0
        state = rep.opt.state_tensors()
        rounds = iter(range(1, 1 << 62))

        def round_step() -> None:
            worker.run_round(next(rounds))  # the method's own round (a HOSFLWorker's), the stand-in as its server

        return ModeStep(round_step, resident(*state), held, list(rep.params), state, act_bytes)

    transport = None
    if mode == "full_local":  # the real SFL server, in this process
        from hosfl_dist.algorithms.sfl import SFLServer
        from hosfl_dist.runtime.server_compute import GroupCompute
        from hosfl_dist.transport.endpoint import ServerEndpoint
        from hosfl_dist.transport.inprocess import InProcessTransport

        sfl = worker_config(spec, "sfl")
        server = SFLServer(method_config(sfl), split, GroupCompute(split.server, split.task, sfl.server))
        server.copy_for(0, 0)  # SFL's per-round copy of θs's trainable tensors: not part of single-device training
        transport = InProcessTransport(ServerEndpoint(server))
    worker = profiled_worker(spec, setup, method, transport)
    params = worker.current_params()
    if zeroth_order(method):
        for p in params:
            p.requires_grad_(False)  # zeroth-order clients build no graph

    def client_step() -> None:
        worker.train_client(0, 0, params, 1, {})  # the method's own client step; the optimizer is the round's

    trainable = [p for p in held.parameters() if p.requires_grad] if mode == "full_local" else params
    return ModeStep(client_step, resident(), held, trainable, [], act_bytes)


# ------------------------------------------------------------------------------------------------ expected cost
F32 = 4
"""Activations and gradients are float32 (zo.compute_dtype=auto upcasts a half-precision model's forwards)."""


@dataclass(frozen=True)
class Expectation:
    """A mode's rough cost, worked out from the model's shape before anything runs, to say up front what a profile
    will take (full_local trains the whole model: 10-30x the memory of the others)."""

    peak_bytes: float
    """Live tensor storage at the step's peak (what ``peak_bytes`` measures), within a factor ~2: for SmolLM2-135M,
    cut 5, batch 32 x 128 it gives 269 MiB / 986 MiB / 7.6 GiB for inference / sfl / full_local, and for tiny:llama
    15 / 56 / 127 MiB (the measured peaks: results/memory/README.md and the suite's ``memory`` record,
    results/bench/README.md#memory)."""
    step_flops: float
    """Floating-point operations of one client step (matmuls and convolutions; elementwise work left out)."""


@dataclass(frozen=True)
class ModelCosts:
    """What the expectations are made of, in bytes and FLOPs."""

    client_bytes: float
    """f_c's weights."""
    whole_bytes: float
    """f_c's and f_s's weights (full_local holds both)."""
    client_trainable_bytes: float
    """f_c's trainable tensors in float32 (the LoRA adapters of an LM: ~0 next to the rest)."""
    whole_trainable_bytes: float
    """The same for f_c and f_s."""
    client_flops: float
    """One forward of f_c on the batch."""
    whole_flops: float
    """One forward of f_c and f_s (the LM head included)."""
    client_act_bytes: float
    """What f_c's autograd graph keeps for its backward."""
    whole_act_bytes: float
    """What the whole model's graph keeps (an LM's logits, their softmax and its gradient included)."""
    z_bytes: float
    """One activation z."""
    transient_bytes: float
    """The largest short-lived tensors of a forward without autograd, beside z."""


def lm_costs(spec: ProfileSpec) -> ModelCosts:
    """An LM's costs from its config alone (no weight is read)."""
    from hosfl_dist.models.sources import model_config, resolve

    text = model_config(resolve(spec.model, spec.gguf_file, key="--model")).get_text_config()
    d, n_layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    inner = getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None) or 4 * d
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or d // heads
    block = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * inner  # q, o; k, v; gated MLP
    embed = vocab * d
    client_params, whole_params = embed + spec.cut * block, 2 * embed + n_layers * block  # f_s's head is untied
    size = DTYPES[spec.dtype].itemsize
    tokens = spec.batch * spec.seq
    z, mlp = tokens * d * F32, tokens * inner * F32
    scores = spec.batch * heads * spec.seq**2 * F32  # (B, H, T, T)
    per_block = 6 * z + 3 * mlp + 2 * scores  # norms, q/k/v/o, residuals; the MLP's inner tensors; scores, probs
    logits = 3 * tokens * vocab * F32  # logits, their softmax and its gradient
    trainable = 0.0 if spec.lora else F32
    return ModelCosts(
        client_bytes=client_params * size,
        whole_bytes=whole_params * size,
        client_trainable_bytes=client_params * trainable,
        whole_trainable_bytes=whole_params * trainable,
        client_flops=2 * tokens * spec.cut * block,
        whole_flops=2 * tokens * (n_layers * block + embed),
        client_act_bytes=spec.cut * per_block,
        whole_act_bytes=n_layers * per_block + logits,
        z_bytes=z,
        transient_bytes=2 * z + 2 * mlp + scores,
    )


def vision_costs(spec: ProfileSpec) -> ModelCosts:
    """A vision model's costs from one forward of the real (small) model, its layers' outputs summed by hooks."""
    from torch.utils.flop_counter import FlopCounterMode

    setup = build_setup(spec, whole=True)
    client, server = setup.split.client, setup.split.server
    outputs: dict[str, list[int]] = {"client": [], "server": []}

    def watch(part: str, module: nn.Module) -> list[Any]:
        def record(_m: nn.Module, _inputs: Any, out: Any) -> None:
            outputs[part].append(storage_bytes(flat(out)))

        return [m.register_forward_hook(record) for m in module.modules() if not list(m.children())]

    handles = watch("client", client) + watch("server", server)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        z = setup.split.client_forward(setup.inputs)["z"]
        client_flops = counter.get_total_flops()
        server(z)
    for h in handles:
        h.remove()
    client_bytes = storage_bytes(list(client.parameters()))
    whole_bytes = client_bytes + storage_bytes(list(server.parameters()))
    return ModelCosts(
        client_bytes=client_bytes,
        whole_bytes=whole_bytes,
        client_trainable_bytes=client_bytes,
        whole_trainable_bytes=whole_bytes,
        client_flops=client_flops,
        whole_flops=counter.get_total_flops(),
        client_act_bytes=sum(outputs["client"]),
        whole_act_bytes=sum(outputs["client"]) + sum(outputs["server"]),
        z_bytes=storage_bytes([z]),
        transient_bytes=2 * max(outputs["client"], default=0),
    )


def expected_costs(spec: ProfileSpec, modes: Sequence[str]) -> tuple[ModelCosts, dict[str, Expectation]]:
    """The model's costs and, per mode, the rough peak and FLOPs of one step (what each mode holds is in this
    module's docstring)."""
    c = lm_costs(spec) if spec.is_lm else vision_costs(spec)
    inference = c.client_bytes + c.z_bytes + c.transient_bytes
    held = (spec.P + 1 if spec.overlap else 1) * c.z_bytes  # λ, and the z̃ kept until it arrives with overlap
    table = {
        "inference": Expectation(inference, c.client_flops),
        # the replica's optimizer keeps two moments of θc between rounds; P+1 forwards
        "hosfl": Expectation(inference + held + 2 * c.client_trainable_bytes, (spec.P + 1) * c.client_flops),
        "sfl": Expectation(  # forward with autograd, backward (2x the forward), a gradient and AdamW's m and v
            c.client_bytes + c.client_act_bytes + 3 * c.client_trainable_bytes, 3 * c.client_flops
        ),
        "zo_sfl": Expectation(inference + c.z_bytes, 2 * c.client_flops),  # z₊ kept while z₋ is computed
        "full_local": Expectation(c.whole_bytes + c.whole_act_bytes + 3 * c.whole_trainable_bytes, 3 * c.whole_flops),
    }
    like = {m: m if m in table else _like(m) for m in modes}  # another method: the built-in its worker derives from
    return c, {m: table[like[m]] for m in modes}


def _like(method: str) -> str:
    """The built-in mode a method is measured as (module docstring)."""
    return "hosfl" if step_kind(method) == "round" else "zo_sfl" if zeroth_order(method) else "sfl"
