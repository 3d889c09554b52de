"""Client memory profiler: the paper's "Mocker" (App. C.5) for any supported model, cut, batch and sequence length.

The client runs one training step of a method alone; the server is replaced by a stand-in (:class:`Mocker`) that
takes the uploaded activation and returns a correctly shaped λ (or loss scalars), so the client's peak memory is
measured apart from the server's. Modes:

    inference   z = f_c(x) under no_grad (the floor every method pays)
    hosfl       HOSFLWorker.run_round for one sampled client, the stand-in answering λ: z, the P perturbed
                forwards z̃_p = f_c(x; θ + μu_p) (Eq. 12) each projected on λ (Eq. 13), and the tensorwise optimizer
                step from regenerated noise (Eq. 15-16)
    sfl         client backprop: forward with autograd, backward from the stand-in λ, AdamW step
    zo_sfl      two perturbed forwards (±μu) whose activations go to the stand-in for loss scalars, SPSA update
    full_local  the whole model (f_c and f_s) trained on the client: forward, loss, backward, AdamW step

What is counted. On every device: an allocation tracker (a TorchDispatchMode) that records the bytes of every tensor
storage created while the step runs and drops them when the storage is freed, on top of the resident state
registered before the step (parameters, buffers, optimizer state, the input batch). It is deterministic: the same
step gives the same count on every run. It sees every tensor an aten op returns, but not scratch buffers a kernel
allocates internally (oneDNN/BLAS workspaces). On CUDA the CUDA caching allocator's ``max_memory_allocated`` is
reported as well (that is the primary figure there). Process RSS (peak VmHWM, reset through /proc/self/clear_refs)
is reported beside the count: it includes the Python interpreter, libraries and allocator caches, and is only
meaningful with one mode per process (the CLI's default).

    python -m hosfl_dist.measure.memory --model tiny:llama --cut 2 --batch 32 --seq 128 --out results/memory/tiny
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hosfl_dist.errors import ConfigError, HosflError

MODES = ("inference", "hosfl", "sfl", "zo_sfl", "full_local")
VISION_INPUTS = {"small_cnn": ((1, 28, 28), 10), "resnet18": ((3, 32, 32), 10)}
"""Input shape and classes of the vision models: Fashion-MNIST for small_cnn, CIFAR-10 for ResNet-18."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MB = 1024**2


# ------------------------------------------------------------------------------------------------ tensor tracker
class AllocationTracker(TorchDispatchMode):
    """Live bytes of tensor storages and their peak, counted at the aten level (deterministic).

    Every tensor an op returns is looked up by its storage: a storage not seen before is added with its size and a
    finaliser that subtracts it when the storage dies. Views and in-place results share a storage already counted,
    so they add nothing; a storage that grows in place (``resize_``) is re-counted at its new size. Tensors that
    exist before the step (weights, optimizer state, the batch) are added with :meth:`register`, so the count is
    "what the client holds": resident state plus everything allocated while the step runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.allocations = 0
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, tensors: Iterable[Tensor]) -> int:
        """Count the storages of existing tensors (once each); returns the bytes added."""
        before = self.current
        for t in tensors:
            self._track(t)
        return self.current - before

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def _track(self, t: Tensor) -> None:
        if not isinstance(t, Tensor) or t.is_meta or t.is_sparse:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (nested, functional wrappers)
            return
        key, nbytes = st._cdata, st.nbytes()
        with self._lock:
            old = self._live.get(key)
            if old is None:
                if nbytes == 0:
                    return
                self._live[key] = nbytes
                self.allocations += 1
                weakref.finalize(st, self._free, key)
            elif old != nbytes:  # resized in place
                self._live[key] = nbytes
            else:
                return
            self.current += nbytes - (old or 0)
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._track(t)
        return out


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of a counted tensor adds nothing)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor) and not t.is_meta:
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


# -------------------------------------------------------------------------------------------------- process RSS
def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int | None, int | None]:
    """(current RSS, peak RSS since the last reset) of this process, from /proc/self/status (psutil otherwise)."""
    try:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    fields[name] = int(value.split()[0]) * 1024
        return fields.get("VmRSS"), fields.get("VmHWM")
    except OSError:
        try:
            import psutil

            return psutil.Process().memory_info().rss, None
        except ImportError:
            return None, None


# --------------------------------------------------------------------------------------------------- what to run
@dataclass(frozen=True)
class ProfileSpec:
    """One client to profile: model, cut and batch shape, and the zeroth-order settings of HO-SFL / ZO-SFL."""

    model: str = "tiny:llama"
    """tiny:<arch> (random tiny LM), pkg:<python package holding a .gguf>, a local HF directory or .gguf path,
    small_cnn (Fashion-MNIST input) or resnet18 (CIFAR-10 input)."""
    cut: int = 2
    """Client depth: decoder blocks (LMs), conv blocks (small_cnn), residual stages (resnet18)."""
    batch: int = 32
    """Samples per client step (the paper's 32)."""
    seq: int = 128
    """Tokens per sequence (LMs only)."""
    num_perturbations: int = 0
    """P; 0 = the paper's default for the model (2 for LMs, 5 for vision, App. B)."""
    mu: float = 1e-3
    """μ of the perturbations."""
    lora: bool = True
    """LMs: LoRA r=8, α=16 on q_proj/v_proj (the paper's setting) with the base frozen; False = full fine-tuning."""
    dtype: str = "float32"
    """LM parameter dtype (float32, bfloat16, float16)."""
    device: str = "cpu"
    """Torch device of the client."""
    gguf_file: str = ""
    """GGUF file inside the model directory / package (default: the only .gguf file there)."""
    seed: int = 0
    """Weights, batch and stand-in values derive from it."""
    overlap: bool = False
    """hosfl: latency hiding (zo.overlap): the P perturbed forwards run before λ arrives and are all kept until it
    does; False (the config default): λ is received first and each z̃ is projected as soon as it is computed."""

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ConfigError(f"--batch must be >= 1, got {self.batch}")
        if self.seq < 2:
            raise ConfigError(f"--seq must be >= 2, got {self.seq}")
        if self.num_perturbations < 0:
            raise ConfigError(f"--P must be >= 1 (or 0 for the paper's default), got {self.num_perturbations}")
        if not self.mu > 0:
            raise ConfigError(f"--mu must be > 0, got {self.mu}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.model in VISION_INPUTS:
            from hosfl_dist.config import VISION_CUT_RANGE

            lo, hi = VISION_CUT_RANGE[self.model]
            if not lo <= self.cut <= hi:
                raise ConfigError(f"--cut {self.cut} is out of range for {self.model}: need {lo} <= cut <= {hi}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: CUDA is not available on this machine")

    @property
    def is_lm(self) -> bool:
        return self.model not in VISION_INPUTS

    @property
    def P(self) -> int:  # noqa: N802 - the paper's symbol
        return self.num_perturbations or (2 if self.is_lm else 5)


@dataclass
class Setup:
    """What the client holds for a mode: a module (f_c, or the whole model for full_local) and one batch."""

    module: nn.Module
    inputs: Any
    """x_m: a tensor, or a dict of tensors passed as keyword arguments (LMs: input_ids, attention_mask)."""
    labels: Tensor
    loss: Callable[[Any], Tensor] | None = None
    """full_local only: the loss of the whole model on the batch."""


def _resolve_lm_source(spec: ProfileSpec) -> tuple[str, str | None]:
    """(directory or hub id, gguf file) for load_causal_lm."""
    src = spec.model
    if src.startswith("pkg:"):
        name = src.removeprefix("pkg:")
        found = importlib.util.find_spec(name)  # locates the package without importing it
        if found is None or not found.submodule_search_locations:
            raise ConfigError(f"--model {src}: no installed package named {name!r}")
        src = list(found.submodule_search_locations)[0]
    if src.startswith("tiny:"):
        return src, None
    gguf = spec.gguf_file or None
    if gguf is None and os.path.isdir(src):
        files = sorted(f for f in os.listdir(src) if f.endswith(".gguf"))
        if len(files) > 1:
            raise ConfigError(f"--model {spec.model}: several .gguf files in {src} ({files}); pick one with --gguf")
        gguf = files[0] if files else None
    return src, gguf


_LM_CACHE: dict[tuple, nn.Module] | None = None
"""Loaded LMs kept while several modes are profiled in one process (see :func:`_lm_cache`); None: no cache."""


@contextlib.contextmanager
def _lm_cache() -> Iterator[None]:
    """Load each LM once for the modes profiled inside (a cached copy stays in memory, so no RSS figures then)."""
    global _LM_CACHE
    _LM_CACHE = {}
    try:
        yield
    finally:
        _LM_CACHE = None


def _load_lm(spec: ProfileSpec) -> nn.Module:
    """The full causal LM, loaded afresh (or a deep copy of the cached one inside :func:`_lm_cache`)."""
    from hosfl_dist.models.hf_split import load_causal_lm, tiny_causal_lm

    key = (spec.model, spec.gguf_file, spec.dtype, spec.seed)
    if _LM_CACHE is not None and key in _LM_CACHE:
        return copy.deepcopy(_LM_CACHE[key])
    src, gguf = _resolve_lm_source(spec)
    if src.startswith("tiny:"):
        model = tiny_causal_lm(src.removeprefix("tiny:"), seed=spec.seed).to(DTYPES[spec.dtype])
    else:
        model, _ = load_causal_lm(src, gguf_file=gguf, dtype=DTYPES[spec.dtype], local_files_only=True)
    if _LM_CACHE is None:
        return model
    _LM_CACHE.clear()
    _LM_CACHE[key] = model
    return copy.deepcopy(model)


def build_setup(spec: ProfileSpec, whole: bool = False) -> Setup:
    """The client part f_c (or, with ``whole``, the unsplit model and its loss) and one deterministic batch."""
    gen = torch.Generator().manual_seed(spec.seed)
    device = torch.device(spec.device)
    if not spec.is_lm:
        from hosfl_dist.models import vision

        shape, classes = VISION_INPUTS[spec.model]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            if spec.model == "small_cnn":
                client, server = vision.small_cnn_split(classes, shape, spec.cut, width=16)
            else:
                client, server = vision.resnet18_split(classes, shape[0], spec.cut, frozen_bn=True)
        x = torch.randn(spec.batch, *shape, generator=gen).to(device)
        y = torch.randint(0, classes, (spec.batch,), generator=gen).to(device)
        if whole:
            module = nn.ModuleDict({"client": client, "server": server}).to(device)
            return Setup(module, x, y, lambda inp: F.cross_entropy(module["server"](module["client"](inp)), y))
        return Setup(client.to(device), x, y)

    from hosfl_dist.config import LoraConfig
    from hosfl_dist.models.hf_split import apply_lora, num_decoder_layers, split_causal_lm

    model = _load_lm(spec)
    n_layers = num_decoder_layers(model)
    if not 1 <= spec.cut < n_layers:
        raise ConfigError(f"--cut {spec.cut} is out of range for {spec.model}: need 1 <= cut < {n_layers}")
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (spec.batch, spec.seq), generator=gen).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    lora = LoraConfig()  # the paper's r=8, α=16 on q_proj/v_proj (App. B)
    targets = sorted(set(lora.client_targets) | set(lora.server_targets))
    if whole:
        if spec.lora:
            apply_lora(model, targets, lora.r, lora.alpha, lora.dropout, seed=spec.seed)
        full = model.to(device)

        def lm_loss(inp: dict[str, Tensor]) -> Tensor:
            logits = full(**inp).logits  # (B, T, V)
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

        return Setup(full, inputs, ids, lm_loss)
    client, server = split_causal_lm(model, spec.cut)
    del model, server  # the client keeps only its blocks; the rest is freed here
    if spec.lora:
        apply_lora(client, list(lora.client_targets), lora.r, lora.alpha, lora.dropout, seed=spec.seed)
    return Setup(client.to(device), inputs, ids)


class Mocker:
    """Stand-in server (App. C.5): accepts the uploaded activation and returns a correctly shaped answer.

    Nothing is computed from the activation, so the client's memory is measured apart from the server's.
    """

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def gradient(self, z: Tensor) -> Tensor:
        """λ_m = ∂ℓ/∂z_m: same shape, dtype and device as z."""
        return torch.randn(z.shape, generator=self.gen, dtype=z.dtype).to(z.device)

    def receive(self, act: dict[str, Tensor]) -> None:
        """Inference: the activation is uploaded and nothing comes back."""

    def loss(self, z: Tensor) -> float:
        """ZO-SFL: the loss scalar the server returns for one uploaded activation."""
        return float(torch.rand((), generator=self.gen))


class _StandInTransport:
    """The worker's link with the stand-in in place of the server: client 0 is sampled every round, ``sync`` gives
    the round's seeds (one shared replica, so no history), ``submit`` answers λ from the :class:`Mocker` at once
    and keeps nothing it was sent."""

    def __init__(self, mocker: Mocker, seed: int, num_perturbations: int) -> None:
        from hosfl_dist.comm import CommMeter

        self.meter = CommMeter()
        self.mocker, self.seed, self.P = mocker, seed, num_perturbations

    def call(self, method: str, **kwargs: Any) -> Any:
        from hosfl_dist.zo import round_seeds

        if method == "plan":
            return {"sampled": torch.tensor([0])}
        if method == "sync":
            none = torch.zeros(0, self.P)
            seeds = torch.tensor(round_seeds(self.seed, kwargs["t"], self.P), dtype=torch.long)
            return {"seeds": seeds, "hist_seeds": none.long(), "hist_scalars": none}
        raise RuntimeError(f"the profiler's stand-in server does not answer {method!r}")

    def call_async(self, method: str, **kwargs: Any) -> _LateAnswer:
        if method != "submit":
            raise RuntimeError(f"the profiler's stand-in server does not answer {method!r}")
        z = kwargs["act"]["z"]
        return _LateAnswer(lambda: {"lam": self.mocker.gradient(z)})


class _LateAnswer:
    """λ made when the client waits for it: with latency hiding it arrives after the P perturbed forwards (the
    window W covers them), so it is not alive during them, as on a real link."""

    def __init__(self, make: Callable[[], dict[str, Tensor]]) -> None:
        self.make: Callable[[], dict[str, Tensor]] | None = make

    def wait(self) -> dict[str, Tensor]:
        make, self.make = self.make, None  # the answer holds no reference to the uploaded z afterwards
        if make is None:
            raise RuntimeError("the stand-in's answer was already taken")
        return make()


class _OneBatch:
    """The hosted client's data: the profiled batch, every round."""

    def __init__(self, x: Any, y: Tensor) -> None:
        self.batch = (x, y)

    def next_batch(self, client: int) -> tuple[Any, Tensor]:
        return self.batch


class _NoPeers:
    """Collective of a worker that is not the leader, so it keeps no evaluation replica."""

    is_leader = False

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return t


def _worker_config(spec: ProfileSpec) -> Any:
    from hosfl_dist.config import build_config

    return build_config(
        {
            # Only the zo/clients sections matter to the worker; model and data just have to be a valid pair.
            "model": {"name": "hf", "source": spec.model} if spec.is_lm else {"name": spec.model},
            "data": {"name": "sst2" if spec.is_lm else "synthetic"},
            "split": {"cut": spec.cut},
            "zo": {"num_perturbations": spec.P, "mu": spec.mu, "perturb_mode": "hooks", "overlap": spec.overlap},
            "clients": {"total": 1, "per_round": 1, "batch_size": spec.batch, "replicas": "shared"},
            "train": {"budget_samples": spec.batch},
            "job": {"seed": spec.seed, "device": spec.device, "progress": False},
        }
    )


def standin_worker(spec: ProfileSpec, setup: Setup, mocker: Mocker | None = None) -> Any:
    """An HOSFLWorker hosting client 0 whose server is the stand-in, with its optimizer state allocated.

    ``worker.run_round(t)`` is the code a real client runs for one sampled round (K = 1, so v̄ = v).
    """
    from hosfl_dist.algorithms.hosfl import HOSFLWorker
    from hosfl_dist.models import ClassificationTask, SplitModel

    split = SplitModel(setup.module, nn.Identity(), ClassificationTask())
    link = _StandInTransport(mocker or Mocker(spec.seed), spec.seed, spec.P)
    data = _OneBatch(setup.inputs, setup.labels)
    worker = HOSFLWorker(_worker_config(spec), split, data, [0], link, _NoPeers())
    rep = worker.replicas[0]
    rep.opt.step(rep.params, lambda i, p: torch.zeros_like(p))  # optimizer state as after round 0
    return worker


@dataclass
class ModeStep:
    """A mode ready to run: ``step()`` does one client step; ``resident`` is what the client holds between steps."""

    step: Callable[[], None]
    resident: list[Tensor]
    module: nn.Module
    trainable: list[Tensor]
    """The tensors the step updates (HO-SFL replicas hold them without requires_grad)."""
    optimizer_state: list[Tensor]
    activation_bytes: int = 0
    """Bytes of z, the activation uploaded per step (0 for full_local)."""


def _module_tensors(module: nn.Module) -> list[Tensor]:
    """Parameters, buffers and plain tensor attributes of every submodule."""
    out = list(module.parameters()) + list(module.buffers())
    for mod in module.modules():
        out += [v for v in vars(mod).values() if isinstance(v, Tensor)]
    return out


def _flat(obj: Any) -> list[Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, Tensor)]


def _torch_adamw(params: list[Tensor]) -> tuple[torch.optim.Optimizer, list[Tensor]]:
    """The paper's AdamW (App. B) with its state allocated, as after the first step of a run."""
    from hosfl_dist.config import OptimConfig
    from hosfl_dist.optim import build_torch_optimizer

    opt = build_torch_optimizer(OptimConfig(), params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt, [t for st in opt.state.values() for t in st.values() if isinstance(t, Tensor)]


def make_step(mode: str, spec: ProfileSpec, setup: Setup | None = None) -> ModeStep:
    """Build the client (unless ``setup`` is given) and the function that runs one step of ``mode`` on it."""
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if setup is None:
        setup = build_setup(spec, whole=mode == "full_local")
    mocker = Mocker(spec.seed)
    module, x = setup.module, setup.inputs
    module.train()  # dropout-free models here; train() only matters for frozen BN, which stays frozen

    if mode == "full_local":
        if setup.loss is None:
            raise ConfigError("full_local needs the whole model (build_setup(spec, whole=True))")
        trainable = [p for p in module.parameters() if p.requires_grad]
        opt, state = _torch_adamw(trainable)

        def full_step() -> None:
            setup.loss(x).backward()  # BP through f_c and f_s, activations of the whole model saved
            opt.step()
            opt.zero_grad(set_to_none=True)

        return ModeStep(full_step, [*_module_tensors(module), *state, *_flat(x)], module, trainable, state)

    from hosfl_dist.models import ClassificationTask, SplitModel

    split = SplitModel(module, nn.Identity(), ClassificationTask())
    with torch.no_grad():
        act_bytes = storage_bytes([split.client_forward(x)["z"]])

    if mode == "inference":

        def inference_step() -> None:
            with torch.no_grad():
                act = split.client_forward(x)
            mocker.receive(act)  # uploaded

        return ModeStep(inference_step, [*_module_tensors(module), *_flat(x)], module, [], [], act_bytes)

    if mode == "sfl":
        trainable = [p for p in module.parameters() if p.requires_grad]
        opt, state = _torch_adamw(trainable)

        def sfl_step() -> None:
            act = split.client_forward(x)  # autograd keeps what BP needs
            lam = mocker.gradient(act["z"].detach())
            act["z"].backward(lam)  # client BP from λ
            opt.step()
            opt.zero_grad(set_to_none=True)

        return ModeStep(sfl_step, [*_module_tensors(module), *state, *_flat(x)], module, trainable, state, act_bytes)

    from hosfl_dist.optim import TensorwiseOptimizer
    from hosfl_dist.zo import perturbed, reconstruct, round_seeds, trainable_slots

    if mode == "hosfl":
        worker = standin_worker(spec, setup, mocker)
        rep = worker.replicas[0]
        state = rep.opt.state_tensors()
        rounds = iter(range(1, 1 << 62))

        def hosfl_step() -> None:
            worker.run_round(next(rounds))  # HOSFLWorker's own round, the stand-in in place of the server

        resident = [*_module_tensors(module), *state, *_flat(x)]
        return ModeStep(hosfl_step, resident, module, list(rep.params), state, act_bytes)

    # zo_sfl: SPSA on the client with the server's loss, two uploads per step (App. B baselines)
    slots = trainable_slots(module)
    params = [mod._parameters[name] for mod, name in slots]
    for p in params:
        p.requires_grad_(False)
    zopt = TensorwiseOptimizer(_worker_config(spec).clients.optim, params)
    zopt.step(params, lambda i, p: torch.zeros_like(p))
    state = zopt.state_tensors()
    rounds = iter(range(1, 1 << 62))

    def zo_sfl_step() -> None:
        seed = round_seeds(spec.seed, next(rounds), 1)[0]
        losses = []
        with torch.no_grad():
            for sign in (1.0, -1.0):
                with perturbed(slots, seed, sign * spec.mu):
                    z = split.client_forward(x)["z"]
                losses.append(mocker.loss(z))  # uploaded; the server answers ℓ(θ ± μu)
                del z
        coeff = (losses[0] - losses[1]) / (2 * spec.mu)  # ĝ = (ℓ₊ − ℓ₋)/(2μ) · u
        zopt.step(params, lambda i, p: reconstruct(p, i, [seed], [coeff]))

    return ModeStep(zo_sfl_step, [*_module_tensors(module), *state, *_flat(x)], module, params, state, act_bytes)


# -------------------------------------------------------------------------------------------------- measurement
@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Frees happen by reference counting only while measuring, so the count does not depend on GC timing."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def measure(ms: ModeStep, device: str = "cpu", steps: int = 1) -> dict[str, Any]:
    """Run ``steps`` client steps under the tracker and return the peak figures (bytes) and the step time."""
    cuda = device.startswith("cuda")
    with _gc_paused():
        tracker = AllocationTracker()
        tracker.register(ms.resident)
        resident = tracker.current
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            cuda_resident = torch.cuda.memory_allocated(device)
        rss_reset = reset_peak_rss()
        rss_before, _ = rss_bytes()
        times = []
        with tracker:
            for _ in range(steps):
                t0 = time.perf_counter()
                ms.step()
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
        _, rss_peak = rss_bytes()
    params = list(ms.module.parameters())
    out: dict[str, Any] = {
        "peak_bytes": tracker.peak,
        "resident_bytes": resident,
        "working_bytes": tracker.peak - resident,
        "params_bytes": storage_bytes(params),
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in ms.trainable),
        "optimizer_state_bytes": storage_bytes(ms.optimizer_state),
        "activation_bytes": ms.activation_bytes,
        "allocations": tracker.allocations,
        "step_s": min(times),
        "rss_before_bytes": rss_before,
        "rss_peak_bytes": rss_peak if rss_reset else None,
    }
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cuda_resident_bytes"] = cuda_resident
    return out


def profile_mode(spec: ProfileSpec, mode: str, steps: int = 1) -> dict[str, Any]:
    """Build the client for ``mode`` in this process and measure one step (see :func:`measure`)."""
    return {"mode": mode, **measure(make_step(mode, spec), spec.device, steps)}


def _child_command(spec: ProfileSpec, mode: str, steps: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hosfl_dist.measure.memory",
        "--model",
        spec.model,
        "--cut",
        str(spec.cut),
        "--batch",
        str(spec.batch),
        "--seq",
        str(spec.seq),
        "--P",
        str(spec.num_perturbations),
        "--mu",
        repr(spec.mu),
        "--lora" if spec.lora else "--no-lora",
        "--dtype",
        spec.dtype,
        "--device",
        spec.device,
        "--gguf",
        spec.gguf_file,
        "--seed",
        str(spec.seed),
        "--overlap" if spec.overlap else "--no-overlap",
        "--steps",
        str(steps),
        "--modes",
        mode,
        "--single-mode-json",
        str(out),
    ]


def profile(spec: ProfileSpec, modes: Sequence[str] = MODES, isolate: bool = True, steps: int = 1) -> dict[str, Any]:
    """Measure every mode (each in a fresh process with ``isolate``, so RSS figures are its own) and the ratios."""
    for m in modes:
        if m not in MODES:
            raise ConfigError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    results = {}
    with contextlib.nullcontext() if isolate else _lm_cache():
        for mode in modes:
            if isolate:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "mode.json"
                    proc = subprocess.run(_child_command(spec, mode, steps, path), capture_output=True, text=True)
                    if proc.returncode != 0:
                        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                        raise RuntimeError(f"profiling mode {mode} failed: {tail}")
                    results[mode] = json.loads(path.read_text())
            else:
                results[mode] = profile_mode(spec, mode, steps)
                gc.collect()
    ref = results.get("inference", {}).get("peak_bytes")
    ratios = {m: r["peak_bytes"] / ref for m, r in results.items()} if ref else {}
    rss_ref = results.get("inference", {}).get("rss_peak_bytes") if isolate else None
    rss_ratios = (
        {m: r["rss_peak_bytes"] / rss_ref for m, r in results.items() if r.get("rss_peak_bytes")} if rss_ref else {}
    )
    return {
        "spec": {**asdict(spec), "P": spec.P},
        "counting": (
            "peak_bytes: live tensor-storage bytes (resident weights, optimizer state and batch, plus every storage "
            "an aten op creates during the step), counted by a TorchDispatchMode; kernel-internal scratch buffers "
            "are not seen. rss_peak_bytes: process VmHWM after a reset, one mode per process."
            + (" cuda_peak_bytes: torch.cuda.max_memory_allocated." if spec.device.startswith("cuda") else "")
        ),
        "isolated_processes": isolate,
        "modes": results,
        "ratio_to_inference": ratios,
        "rss_ratio_to_inference": rss_ratios,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------------------- plot
def plot(report: dict[str, Any], path: str | Path) -> None:
    """Stacked bars per mode: weights, optimizer state, batch, and the working memory of the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    rows = [report["modes"][m] for m in modes]
    params = [r["params_bytes"] / MB for r in rows]
    state = [r["optimizer_state_bytes"] / MB for r in rows]
    other = [(r["resident_bytes"] - r["params_bytes"] - r["optimizer_state_bytes"]) / MB for r in rows]
    work = [r["working_bytes"] / MB for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(modes) + 3, 4.5))
    bottom = [0.0] * len(modes)
    for values, label in (
        (params, "weights"),
        (state, "optimizer state"),
        (other, "batch + buffers"),
        (work, "step working memory"),
    ):
        ax.bar(modes, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ratios = report.get("ratio_to_inference", {})
    for i, m in enumerate(modes):
        text = f"{bottom[i]:.1f} MiB" + (f"\n×{ratios[m]:.2f}" if m in ratios else "")
        ax.text(i, bottom[i], text, ha="center", va="bottom", fontsize=8)
    s = report["spec"]
    what = f"{s['model']}, cut {s['cut']}, batch {s['batch']}"
    if s["model"] not in VISION_INPUTS:
        what += f", seq {s['seq']}" + ("" if s["lora"] else ", full fine-tuning")
    ax.set(ylabel="client peak memory (MiB, tensor count)", title=f"Client peak memory: {what}, P={s['P']}")
    ax.set_ylim(top=max(bottom) * 1.2)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------- CLI
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hosfl_dist.measure.memory",
        description="Client peak memory per training mode, with a stand-in server (paper App. C.5).",
    )
    p.add_argument("--model", default="tiny:llama", help="tiny:<arch> | pkg:<package> | HF dir | small_cnn | resnet18")
    p.add_argument("--cut", type=int, default=2, help="client depth (decoder blocks / conv blocks / stages)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (LMs)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--P", type=int, default=0, help="perturbations (0: 2 for LMs, 5 for vision, as in App. B)")
    p.add_argument("--mu", type=float, default=1e-3)
    p.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True, help="LMs: LoRA r=8 on q,v")
    p.add_argument("--dtype", default="float32", help="LM parameter dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gguf", default="", help="GGUF file name inside the model directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--overlap", action=argparse.BooleanOptionalAction, default=False, help="hosfl: perturbed forwards before λ"
    )
    p.add_argument("--steps", type=int, default=1, help="client steps measured per mode (peak over them)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=True, help="one process per mode (RSS figures)"
    )
    p.add_argument("--out", default="out/memory", help="directory for memory.json and memory.png")
    p.add_argument("--single-mode-json", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        spec = ProfileSpec(
            model=args.model,
            cut=args.cut,
            batch=args.batch,
            seq=args.seq,
            num_perturbations=args.P,
            mu=args.mu,
            lora=args.lora,
            dtype=args.dtype,
            device=args.device,
            gguf_file=args.gguf,
            seed=args.seed,
            overlap=args.overlap,
        )
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        if args.single_mode_json:  # child of an isolated run: one mode, raw figures
            Path(args.single_mode_json).write_text(json.dumps(profile_mode(spec, modes[0], args.steps)))
            return 0
        report = profile(spec, modes, isolate=args.isolate, steps=args.steps)
    except HosflError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["command"] = "python -m hosfl_dist.measure.memory " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "memory.png")
    print(f"{'mode':<11} {'peak MiB':>9} {'resident':>9} {'working':>9} {'x infer':>7} {'RSS MiB':>8} {'step s':>7}")
    for m, r in report["modes"].items():
        ratio = report["ratio_to_inference"].get(m)
        rss = r.get("rss_peak_bytes")
        print(
            f"{m:<11} {r['peak_bytes'] / MB:>9.2f} {r['resident_bytes'] / MB:>9.2f} {r['working_bytes'] / MB:>9.2f}"
            f" {ratio if ratio is not None else float('nan'):>7.3f} {rss / MB if rss else float('nan'):>8.1f}"
            f" {r['step_s']:>7.3f}"
        )
    print(f"wrote {out / 'memory.json'} and {out / 'memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
