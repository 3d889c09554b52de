"""The schema of the typed configuration tree: one dataclass per section, each field with a one-line docstring.

A section's ``__post_init__`` checks what that section alone can tell (ranges, names, paths); what needs two
sections or the algorithm registry is checked where a run's config is built (:mod:`hosfl_dist.runtime.checks`).
A failed check raises :class:`FieldError`, a :class:`ConfigError` naming the key, the value and why; the loader
(:mod:`hosfl_dist.config.load`) prefixes the section's path to the key.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from hosfl_dist.errors import ConfigError

# algorithm.name, model.name, data.name and zo.estimator are names in registries a plug-in can add to
# (hosfl_dist.algorithms, hosfl_dist.models.registry, hosfl_dist.data.registry, hosfl_dist.core.estimators):
# hosfl_dist.runtime.checks checks them once the plug-ins are imported.
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
LOGGERS = ("jsonl", "tensorboard", "wandb")
MAX_PERTURBATIONS = 10_000
COMPILE_MODES = ("off", "default", "reduce-overhead")
"""zo.compile: eager, or a ``torch.compile`` mode."""
MIN_MU = 1e-9
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,99}")
"""A name that becomes one folder (job.name: runs/<job.name>/): no separator, no leading dot (., .., hidden)."""
MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""A Python module's dotted name (job.plugins, job.callbacks)."""
MAX_THREADS = 1024
"""Most intra-op threads of a process (job.threads, OMP_NUM_THREADS): more than any node's cores; 16,384 threads
failed to start here (libgomp: "Thread creation failed") and 100,000 ended in a segmentation fault."""
THREADS_PER_CPU = 4
"""job.threads may be at most this many times the CPUs of the machine that checks the config (os.cpu_count()): more
only contend for the cores, and past what the machine can start libgomp aborts the process ("Thread creation
failed") at its first parallel region, where no summary can say so."""


def thread_limit() -> int:
    """The most job.threads this machine takes: :data:`THREADS_PER_CPU` × os.cpu_count(), at most
    :data:`MAX_THREADS`."""
    return min(MAX_THREADS, THREADS_PER_CPU * (os.cpu_count() or 1))


MAX_WIDTH = 1024
"""Widest small_cnn / conv_mlp (model.width): small_cnn's second block has 2·width channels."""
MAX_LORA_RANK = 4096
"""Largest lora.r: the hidden size of the widest model the paper uses (Qwen3-8B); a rank of 2^31 is an allocation of
hundreds of GB that fails with a traceback."""
MAX_EVALUATIONS = 1_000_000
"""Most evaluations of a run (train.budget_samples / train.eval_every_samples): the schedule is a list."""
INT64 = 2**63
FLOAT32_MAX = 3.4028234663852886e38
PATH_MAX, NAME_MAX = 4096, 255
"""Longest path and path component Linux accepts (a longer one is an OSError wherever it is used)."""
TEXT_KEYS = ("data.template", "data.label_words")
"""String keys whose values may hold line breaks and tabs (prompts); no other string may hold a control character."""


@dataclass
class JobConfig:
    name: str = "hosfl"
    """Run name, shown in logs and the summary."""
    seed: int = 0
    """Run seed: data partition, client sampling, perturbation seeds and initial weights all derive from it."""
    out_dir: str = ""
    """Folder for config.yaml, metrics.jsonl, summary.json and checkpoints/ (created if missing). A folder that holds
    another run is refused unless job.resume=auto or job.overwrite=true. Empty: a new folder per run,
    runs/<job.name>/<start time>, with runs/<job.name>/latest pointing at it (under Slurm runs/<job.name>/slurm-<job
    id>, which a requeued job continues; job.resume=auto continues latest)."""
    threads: int = 0
    """Intra-op CPU threads of each process (torch.set_num_threads). 0 = auto: OMP_NUM_THREADS where it is set
    (torchrun sets 1), else 1 for a model under 10M parameters (the faster on a loaded machine:
    results/bench/README.md#threads) and, for a larger one, the cores other work leaves free (cores less the 1-minute
    load average, at least 1). Printed at start, with where the number came from. At most 4 × the CPUs of the
    machine that checks the config (os.cpu_count()) and 1024: more only contend, and OpenMP aborts a process that
    cannot start them."""
    device: str = "cpu"
    """Torch device for the models of this process ("cpu", "cuda", "cuda:1")."""
    progress: bool = True
    """Show a progress bar on stderr."""
    plots: bool = True
    """Draw curves.png in the run's folder when it completes (accuracy, losses and traffic against processed
    samples; python -m hosfl_dist.experiments.report RUN_DIR... draws any runs the same way)."""
    resume: Literal["never", "auto"] = "never"
    """auto: continue the run in job.out_dir from its newest checkpoint that verifies (or start it afresh where there is
    none), if it is the same run: the same config (but for how it is started), inputs and code; never: refuse a
    folder that holds another run unless job.overwrite is set."""
    allow_code_change: bool = False
    """job.resume=auto: continue a run whose checkpoint was written by other code (another version of hosfl_dist or
    changed source files); the results may then differ from an uninterrupted run. summary.json records it."""
    allow_environment_change: bool = False
    """job.resume=auto: continue a run whose checkpoint was written in another environment (other intra-op threads,
    whatever set them; another torch, transformers or peft; another CPU kernel set or GPU); the results may then
    differ from an uninterrupted run. summary.json records what changed."""
    allow_unsigned: bool = False
    """job.resume=auto: continue from a checkpoint whose manifest carries no signature (written by hand or by another
    tool, or stripped), if you trust whoever could write the folder; its identity is then taken as written.
    summary.json records it. A signature mismatch (a forgery, or another key) is refused whatever this says."""
    overwrite: bool = False
    """Replace the run that job.out_dir holds (its files and checkpoints) instead of refusing the folder."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where the metrics rows and the run's summary go (rank 0 only): jsonl (metrics.jsonl / summary.json, always on),
    tensorboard (job.out_dir/tensorboard, needs the tensorboard package), wandb (offline, job.out_dir/wandb, needs
    wandb)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported before anything is built (as python -m hosfl_dist.run --plugin MODULE does), e.g. one
    that registers a method (hosfl_dist.algorithms.register), a task (hosfl_dist.data.register_task) or a model
    (hosfl_dist.models.register_model) of its own: the registries, the config check, both runtimes, the studies and
    the profiler then know it (docs/python-api.md#plug-ins). Part of the run's identity."""
    callbacks: list[str] = field(default_factory=list)
    """Callbacks as module:Class (a subclass of hosfl_dist.Callback, built without arguments in each process that owns
    one of its events): on_train_start, on_round_end, on_evaluate, on_checkpoint, on_train_end
    (docs/python-api.md#callbacks). They watch the run, so they are not part of its identity; one that raises fails
    the run."""
    interface: str = "auto"
    """torchrun runtime: the network interface gloo and TensorPipe bind to (GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME).
    auto: loopback ("lo") when every rank runs on one node, otherwise what the environment sets (torch's choice
    when nothing is set); or a name, e.g. "ib0" or the interface of the Slurm head node's address."""

    def __post_init__(self) -> None:
        check(self.out_dir == "" or bool(self.out_dir.strip()), "out_dir", self.out_dir,
              "must name a folder (or be empty: runs/<job.name>/<start time>)")  # fmt: skip
        _check_path("out_dir", self.out_dir)
        check(NAME.fullmatch(self.name) is not None, "name", self.name, "it names the folder runs/<job.name>/: use "
              "up to 100 letters, digits and _ . + = @ -, not starting with a dot")  # fmt: skip
        check(self.threads >= 0, "threads", self.threads, "must be >= 0 (0 = auto)")
        check(self.threads <= MAX_THREADS, "threads", self.threads,
              f"must be at most {MAX_THREADS} (more threads than any node has cores fail to start)")  # fmt: skip
        check(self.threads <= thread_limit(), "threads", self.threads,
              f"must be at most {thread_limit()} on this machine ({THREADS_PER_CPU} × its {os.cpu_count() or 1} CPUs, "
              "os.cpu_count(): more only contend, and OpenMP aborts a process it cannot start them for)")  # fmt: skip
        check(self.seed >= 0, "seed", self.seed, "must be >= 0")
        check(DEVICE.fullmatch(self.device) is not None, "device", self.device, "use cpu, cuda or cuda:<index>")
        check(IFNAME.fullmatch(self.interface) is not None, "interface", self.interface,
              "use auto or an interface name such as lo, eth0, ib0")  # fmt: skip
        check(not (self.resume == "auto" and self.overwrite), "overwrite", self.overwrite, "job.resume=auto keeps "
              "the folder's run; choose one of the two")  # fmt: skip
        for module in self.plugins:
            check(MODULE.fullmatch(module) is not None, "plugins", self.plugins,
                  f"{module!r} is not a module name (e.g. mypkg.methods)")  # fmt: skip
        for spec in self.callbacks:
            module, _, cls = spec.partition(":")
            check(MODULE.fullmatch(module) is not None and cls.isidentifier(), "callbacks", self.callbacks,
                  f"{spec!r} is not module:Class (e.g. mypkg.watch:Collector)")  # fmt: skip
        unknown = [x for x in self.loggers if x not in LOGGERS]
        check(not unknown, "loggers", self.loggers, f"unknown logger {unknown[0] if unknown else ''!r}; choose from "
              f"{list(LOGGERS)}")  # fmt: skip


@dataclass
class AlgorithmConfig:
    name: str = "hosfl"
    """Training method: a name registered in hosfl_dist.algorithms (hosfl, sfl, splitlora, fsl_sage, zo_sfl,
    mu_splitfed; frozen_client: HO-SFL with the client frozen, the server-only reference)."""
    local_epochs: int = 1
    """E: local epochs per round of the methods that aggregate models (SFL, SplitLoRA, FSL-SAGE, ZO-SFL)."""
    server_update_interval: int = 5
    """FSL-SAGE: client steps between server updates (paper: 5)."""
    align_interval: int = 1
    """FSL-SAGE: rounds between auxiliary-model alignments (paper: 1; counted in rounds as in its reference code)."""
    server_steps: int = 2
    """MU-SplitFed τ: server updates per client update (paper: 2)."""
    global_lr: float = 0.3
    """MU-SplitFed global learning rate applied to the aggregated client update (paper: 0.3)."""

    def __post_init__(self) -> None:
        for key in ("local_epochs", "server_update_interval", "align_interval", "server_steps"):
            check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        check(self.global_lr > 0, "global_lr", self.global_lr, "must be > 0")


@dataclass
class ModelConfig:
    name: str = "small_cnn"
    """Model: small_cnn, conv_mlp (a conv block and two hidden fully connected layers: the quickstart's), resnet18, hf
    (a Hugging Face decoder LM), or one a plug-in registers
    (hosfl_dist.models.register_model, docs/python-api.md#plug-ins)."""
    source: str = ""
    """hf: hub name, local HF directory, directory holding model.gguf_file, pkg:<package>, tiny:<arch> (random, for
    tests), arch:<name> (a published shape, random weights), or <prefix>:<name> of a plug-in
    (hosfl_dist.models.sources.register_source)."""
    gguf_file: str = ""
    """hf: GGUF file name inside model.source (loaded and dequantised by transformers)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """hf: dtype of the frozen base weights. Trainable tensors (LoRA adapters) and optimizer state stay float32."""
    pretrained: str = ""
    """Local path to a state dict with pretrained weights of the whole vision model: ResNet-18 in torchvision's layout
    (an ImageNet file, or what python -m hosfl_dist.experiments.pretrain saves), small_cnn and conv_mlp in the layout
    that command saves. A classifier head of another number of classes is dropped (a new one is initialised); empty =
    random."""
    reset_head: bool = False
    """With model.pretrained: initialise a new classifier head even when the file's has as many classes (fine-tuning
    on other classes than the pretraining's, e.g. data.classes 5-9 after 0-4)."""
    freeze_bn: Literal["all", "code", "client", "none"] | bool = "code"
    """BatchNorm of resnet18 (small_cnn and conv_mlp have none: ignored). all: statistics and affine parameters frozen
    on both sides, running statistics everywhere (the paper's text, App. B.2). code: the authors' published code, per
    method: affine parameters frozen on both sides; the server part in train mode in training rounds (batch
    statistics, running statistics updated: the K clients pass one by one, each its own batch) and in eval mode in
    evaluation; a first-order client (sfl, fsl_sage) likewise, its running statistics downloaded, uploaded and
    averaged with θc; a zeroth-order client (hosfl, zo_sfl, mu_splitfed, frozen_client) on fixed running statistics.
    client: as code with every client on fixed running statistics. none: as client, with the affine parameters
    trainable on both sides. true = all, false = none (older configs)."""
    width: int = 16
    """Channels of the first block of small_cnn (doubled per block) and of conv_mlp's conv block (its hidden layers
    have 4·width units)."""

    def __post_init__(self) -> None:
        check(self.name != "hf" or bool(self.source), "source", self.source, "model.name=hf needs a source")
        if isinstance(self.freeze_bn, bool):  # the boolean of older configs: frozen everywhere, or trainable
            self.freeze_bn = "all" if self.freeze_bn else "none"
        check(self.freeze_bn in ("all", "code", "client", "none"), "freeze_bn", self.freeze_bn,
              "choose one of ['all', 'code', 'client', 'none'] (or true = all, false = none)")  # fmt: skip
        check(1 <= self.width <= MAX_WIDTH, "width", self.width, f"must be in 1..{MAX_WIDTH} (channels)")
        _check_path("source", self.source)
        _check_path("pretrained", self.pretrained)
        check(self.gguf_file == "" or _is_file_name(self.gguf_file), "gguf_file", self.gguf_file,
              "a file name inside model.source, not a path")  # fmt: skip


@dataclass
class SplitConfig:
    cut: int = 1
    """Depth kept on the client: conv blocks (small_cnn), blocks of conv_mlp (1: the conv block, 2: and the first
    hidden layer), residual stages (resnet18), decoder blocks (hf)."""


@dataclass
class LoraConfig:
    r: int = 8
    """LoRA rank (paper: 8)."""
    alpha: int = 16
    """LoRA scaling α (paper: 16)."""
    dropout: float = 0.0
    """LoRA dropout."""
    client_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Modules of the client part that get LoRA adapters (empty: client part frozen)."""
    server_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Modules of the server part that get LoRA adapters (empty: server part frozen except what is listed)."""

    def __post_init__(self) -> None:
        check(1 <= self.r <= MAX_LORA_RANK, "r", self.r, f"must be in 1..{MAX_LORA_RANK}")
        check(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        check(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")


@dataclass
class ZOConfig:
    num_perturbations: int = 5
    """P: perturbed client forwards (and scalars uploaded) per client per round."""
    mu: float = 1e-3
    """μ: perturbation scale of the two-point estimator."""
    estimator: str = "gaussian"
    """The zeroth-order estimator (hosfl, zo_sfl, mu_splitfed; the registry of hosfl_dist.core.estimators, a
    plug-in's included): gaussian (u ~ N(0, I), the paper's) or rademacher (u uniform on {−1, +1}^d: unbiased too,
    with |u|² = d exactly). It draws the perturbations and rebuilds the update from the seeds, on every replica."""
    rng_device: str = "cpu"
    """Device of the noise generator. Every client must use the same stream: CPU and CUDA generators differ."""
    overlap: Literal["auto"] | bool = "auto"
    """Latency hiding (paper §3.4, HO-SFL): after a worker's uploads have left, the P perturbed forwards of each client
    whose λ has not arrived run at once and their z̃ are kept until it does (P·|z| more memory per such client), so the
    server's step and the clients' forwards overlap. Results are the same bits either way. auto: on in a round where
    P·|z| over the worker's clients of that round fits in zo.overlap_memory_mb; true / false: always / never (false:
    the client's peak stays at inference + |λ|)."""
    overlap_memory_mb: float = 256.0
    """zo.overlap=auto: the most memory, in MiB, the kept z̃ of one worker's clients may take in a round."""
    noise_cache_mb: float = 0.0
    """HO-SFL: the most memory, in MiB, a worker may keep the round's float32 draws of u in (P·d_c·4 bytes for all of
    them). Every client of a round perturbs with the round's P seeds and the update draws them again, so a worker
    that keeps them draws each once per round instead of once per client and once more per replica it updates;
    what does not fit is drawn every time. The numbers are the same either way. 0 (the default) keeps none, so a
    client holds no θc-sized buffer beside its replica (memory at inference level, whatever d_c is)."""
    perturb_mode: Literal["hooks", "copy"] = "hooks"
    """hooks: perturb one module at a time during the forward (inference-level memory); copy: perturbed copy of θc."""
    perturb_batch: int = 1
    """HO-SFL: perturbed forwards run together as one batched forward (``torch.func.vmap`` over k stacked copies of
    θc + μu_p; what no trainable tensor touches is computed once). 1 (the default): one at a time, at inference-level
    memory. k > 1: k at a time (P or more: all P in one), for k× the forward's activations, k·|θc| perturbed tensors
    and the k z̃ of the batch; worth it where the device has parallelism to spare (a GPU, where one forward of the
    k× batch costs little more than one forward: results/gpu/README.md, "The ZO step with its perturbed forwards
    batched"), not on a 2-core CPU. The client's model must run under vmap (a run that cannot says so at its first
    round). The scalars may differ in their last bits from one-at-a-time forwards (other kernels), so it is part of
    the run's identity."""
    batch_clients: bool = False
    """HO-SFL: a worker's clients of a round in one pass: their z in one forward of their concatenated batches, and
    for each seed (or ``zo.perturb_batch`` of them) one perturbed forward whose rows each client projects with its own
    λ (every current replica holds θc^t and the round's clients share its P seeds). Uploads stay per client. K_w×
    the forward's activations at once for a worker with K_w clients in the round, fewer and larger kernels: for a
    device a forward of one client's batch leaves idle (a GPU), not a CPU (no faster on 2 cores:
    results/bench/changes.md#batch_clients). Refused where f_c normalises with batch statistics. A round whose
    clients' inputs do not stack (text batches trimmed to different lengths) or that has one client runs client by
    client. The scalars may differ in their last bits from client-by-client forwards, and depend on which clients
    share a worker, so it is part of the run's identity."""
    compile: Literal["off", "default", "reduce-overhead"] = "off"
    """HO-SFL: the client's no-grad forwards of the ZO step (z and every z̃) through ``torch.compile`` in this mode
    (reduce-overhead: CUDA graphs, job.device=cuda only), for a small client whose step is launch-bound on a GPU.
    Needs zo.perturb_mode=copy and zo.perturb_batch=1 (a compiled f_c does not run hooks added after it was compiled:
    with hooks every z̃ would be z) and weights stored in the compute dtype. The first round compiles (seconds to
    minutes); evaluation stays eager. The scalars may differ in their last bits from eager forwards (other kernels),
    so it is part of the run's identity."""
    compute_dtype: Literal["auto", "float32", "model"] = "auto"
    """dtype of the zeroth-order client's forwards (z and every z̃): float32 keeps half-precision weights stored as
    they are and upcasts one module at a time; model = model.dtype; auto = float32 unless model.dtype is float32."""

    HALF_PRECISION_MU_FLOOR = {"bfloat16": 1e-2, "float16": 1e-2}
    """Smallest μ for forwards computed in a half-precision dtype: at μ = 1e-3 the scalars' relative error against
    float64 is of order 1 in bfloat16 and in float16 (measured in results/scale/zo_precision.md)."""

    def __post_init__(self) -> None:
        check(1 <= self.num_perturbations <= MAX_PERTURBATIONS, "num_perturbations", self.num_perturbations,
              f"must be in 1..{MAX_PERTURBATIONS} (perturbed forwards per client per round)")  # fmt: skip
        check(math.isfinite(self.mu) and MIN_MU <= self.mu <= 1, "mu", self.mu,
              f"must be a finite perturbation scale in [{MIN_MU:g}, 1]; below it θ + μu rounds to θ in float32 and "
              "every scalar is 0")  # fmt: skip
        check(DEVICE.fullmatch(self.rng_device) is not None, "rng_device", self.rng_device, "use cpu or cuda")
        check(math.isfinite(self.overlap_memory_mb) and self.overlap_memory_mb >= 0, "overlap_memory_mb",
              self.overlap_memory_mb, "must be a finite number of MiB >= 0")  # fmt: skip
        check(math.isfinite(self.noise_cache_mb) and self.noise_cache_mb >= 0, "noise_cache_mb",
              self.noise_cache_mb, "must be a finite number of MiB >= 0")  # fmt: skip
        check(isinstance(self.perturb_batch, int) and not isinstance(self.perturb_batch, bool)
              and self.perturb_batch >= 1, "perturb_batch", self.perturb_batch,
              "must be an integer >= 1: the perturbed forwards batched together (1: one at a time)")  # fmt: skip
        check(isinstance(self.batch_clients, bool), "batch_clients", self.batch_clients, "expected true or false")
        check(self.compile == "off" or self.perturb_mode == "copy", "compile", self.compile,
              f"needs zo.perturb_mode=copy, not {self.perturb_mode} (a compiled f_c does not run the hooks that "
              "perturb it, so every z̃ would be z)")  # fmt: skip
        check(self.compile == "off" or self.perturb_batch == 1, "compile", self.compile,
              f"compiles one-at-a-time forwards; use zo.perturb_batch=1, not {self.perturb_batch}")  # fmt: skip

    def overlap_on(self, held_bytes: float) -> bool:
        """Whether a round overlaps (:attr:`overlap`), where keeping its z̃ takes ``held_bytes`` (P·Σ|z_m|)."""
        if self.overlap == "auto":
            return held_bytes <= self.overlap_memory_mb * 2**20
        return bool(self.overlap)

    def precision_problem(self, model_dtype: str, uploads_both: bool = False) -> str | None:
        """Why μ is too small for a zeroth-order client over ``model_dtype`` weights, or None.

        A half-precision forward rounds z and z̃_p by ~2^-9 (bfloat16) / 2^-12 (float16) of their size, while they
        differ by ~μ: below the floor the scalars are mostly rounding noise. That happens when the client computes
        in model.dtype (zo.compute_dtype=model), and, whatever it computes in, when both activations travel in
        model.dtype and the server takes their difference (``uploads_both``: ZO-SFL's z±, MU-SplitFed's).
        Torch-free, so a config can be refused before anything is built.
        """
        floor = self.HALF_PRECISION_MU_FLOOR.get(model_dtype)
        if floor is None or self.mu >= floor:
            return None
        if uploads_both:
            why = f"the client uploads z₊ and z₋ in model.dtype={model_dtype}, whose rounding swamps z₊ − z₋"
            fix = "use model.dtype=float32"
        elif self.compute_dtype == "model":
            why = f"zo.compute_dtype=model runs the client's forwards in model.dtype={model_dtype}, whose rounding "
            why += "swamps z̃ − z"
            fix = "use zo.compute_dtype=auto for float32 forwards over the stored weights"
        else:
            return None
        return f"invalid value for zo.mu: {self.mu:g} ({why} below μ = {floor:g}; raise zo.mu or {fix})"


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer: adamw (decoupled weight decay) or sgd (with optional momentum)."""
    lr: float = 1e-5
    """Learning rate η."""
    weight_decay: float = 5e-4
    """Weight decay (decoupled for adamw, L2 added to the gradient for sgd)."""
    beta1: float = 0.9
    """AdamW β1."""
    beta2: float = 0.999
    """AdamW β2."""
    eps: float = 1e-8
    """AdamW ε."""
    momentum: float = 0.0
    """SGD momentum."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate over the run's rounds after the warmup: constant, linear or cosine decay to final_lr_ratio·lr
    (hosfl; computed from the round, so a replica replaying round τ uses round τ's rate)."""
    warmup_rounds: int = 0
    """Rounds of linear warmup from lr/warmup_rounds to lr."""
    final_lr_ratio: float = 0.0
    """The learning rate at the last round, as a fraction of lr (linear and cosine schedules)."""

    def __post_init__(self) -> None:
        check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be a finite number > 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1/beta2", (self.beta1, self.beta2), "must be in [0, 1)")
        check(self.eps > 0, "eps", self.eps, "must be > 0")
        check(0 <= self.momentum < 1, "momentum", self.momentum, "must be in [0, 1)")
        check(self.warmup_rounds >= 0, "warmup_rounds", self.warmup_rounds, "must be >= 0")
        check(0 <= self.final_lr_ratio <= 1, "final_lr_ratio", self.final_lr_ratio, "must be in [0, 1]")

    @property
    def scheduled(self) -> bool:
        return self.schedule != "constant" or self.warmup_rounds > 0


@dataclass
class ClientsConfig:
    total: int = 100
    """M: logical clients, each with its own data shard and model replica."""
    per_round: int = 10
    """K: clients sampled per round."""
    batch_size: int = 32
    """Samples per client step."""
    replicas: Literal["per_client", "shared"] = "per_client"
    """per_client: every logical client keeps its own θc and catches up by replaying history (Algorithm 3).
    shared: one replica per process, always current (the published code's shortcut; identical results, faster)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Client optimizer (applied to the reconstructed gradient ĝ_c)."""
    dropout: float = 0.0
    """Probability that a sampled client fails to deliver its round, drawn per round and client from job.seed (the
    same draw in every runtime; no other random stream moves): docs/participation.md."""
    dropout_stage: Literal["before_upload", "after_upload", "mixed"] = "before_upload"
    """When a dropped client fails: before_upload (it sends nothing), after_upload (its upload reaches the server's
    step; what follows it never arrives: HO-SFL's scalars, a baseline's θc_m), or mixed (each drop picks one,
    seeded)."""
    over_select: float = 0.0
    """ε: sample ⌈K·(1+ε)⌉ clients and step on the first K uploads that arrive (seeded order); the others are late,
    answered "not this round"."""
    participation: str = ""
    """A participation.jsonl a run wrote, replayed instead of the seeded draw of drops and arrivals (the same S_t,
    checked line by line); empty: draw them."""

    def __post_init__(self) -> None:
        check(self.total >= 1, "total", self.total, "must be >= 1")
        check(self.per_round >= 1, "per_round", self.per_round, "must be >= 1")
        check(
            self.per_round <= self.total,
            "per_round",
            self.per_round,
            f"K must not exceed clients.total (M={self.total})",
        )
        check(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        check(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1): a client that always drops "
              "never trains")  # fmt: skip
        check(math.isfinite(self.over_select) and self.over_select >= 0, "over_select", self.over_select,
              "must be >= 0")  # fmt: skip
        sampled = math.ceil(round(self.per_round * (1.0 + self.over_select), 9))
        check(sampled <= self.total, "over_select", self.over_select, f"samples ⌈K·(1+ε)⌉ = {sampled} clients, more "
              f"than clients.total (M={self.total})")  # fmt: skip
        _check_path("participation", self.participation)


@dataclass
class ServerConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Server optimizer (ordinary backprop on θs)."""
    ranks: int = 1
    """Ranks of the server group under torchrun (ranks 0..S-1 shard θs with FSDP; rank 0 is the RPC front)."""
    rpc_timeout_s: float = 300.0
    """Timeout of one client->server RPC, in seconds (the rendezvous and an idle server rank's wait too)."""
    collective_timeout_s: float = 600.0
    """Timeout of one collective among the client workers or the server ranks (all_reduce, barrier), in seconds."""
    min_clients: int = 0
    """A round steps only with at least this many uploads; fewer is a skipped round (recorded in participation.jsonl
    and summary.json, nothing stepped). 0 = clients.per_round (K)."""
    round_timeout_s: float = 0.0
    """Rounds decided live (elastic runs, ``--serve``; under torchrun when > 0): after a round's first upload (and
    again after its first scalars) the server waits at most this long for the others, then steps with what arrived
    (at least ``server.min_clients``) and answers the late ones "not this round". 0 = wait for every client of a
    live worker (docs/participation.md)."""
    worker_timeout_s: float = 30.0
    """Elastic runs (``--serve``): a client worker silent for this long (no call, no heartbeat) is lost: its round's
    clients count as dropped and its logical clients move to the workers still there; a worker whose server is
    silent this long stops waiting on it."""
    rejoin_timeout_s: float = 300.0
    """Elastic runs (``--join``): how long a worker whose server went away waits for it to come back (restarted with
    ``job.resume=auto``) and rejoins; after that it exits with one line and a non-zero status."""
    min_workers: int = 1
    """Elastic runs (``--serve``): the first round starts once this many client workers have joined (Flower's
    ``min_available_clients``); later rounds go on with whoever is there."""
    micro_batch_tokens: int = 0
    """Largest number of tokens (samples for vision models) one server forward/backward holds: a round's activations
    are processed in micro-batches of whole samples and their gradients accumulated (same mean). 0 = the whole
    round (or a server rank's share of it) in one pass."""
    loss_chunk_tokens: int = 0
    """Hugging Face decoder LMs on a generation task: the server's LM loss over chunks of at most this many predicted
    tokens, each chunk's (tokens, vocab) logits made, scored and dropped (a frozen head's gradient taken with them; a
    trained head's logits recomputed for the backward), so float32 logits of the whole batch never exist (on a
    151,936-token vocabulary, 0.58 MiB a token). Loss and gradients equal the unchunked path up to float rounding.
    0 = off (one logits tensor); other tasks and models ignore it."""
    activation_checkpointing: bool = False
    """Recompute each server decoder block in the backward instead of keeping its activations (hf models)."""
    reshard_after_forward: bool = True
    """server.ranks > 1: FSDP2 frees each block's gathered weights after its forward and gathers them again for its
    backward (true: a rank holds its shard plus one block at a time). false keeps them from a pass's forward to its
    backward: one all-gather per block and pass instead of two, for the whole of f_s unsharded on every rank during
    the pass. The same bits either way."""

    def __post_init__(self) -> None:
        check(self.ranks >= 1, "ranks", self.ranks, "must be >= 1")
        for key in ("rpc_timeout_s", "collective_timeout_s"):
            check(1 <= getattr(self, key) <= 7 * 86400, key, getattr(self, key),
                  "must be between 1 s and a week: every wait on a peer is bounded by a timeout")  # fmt: skip
        check(self.micro_batch_tokens >= 0, "micro_batch_tokens", self.micro_batch_tokens, "must be >= 0 (0 = off)")
        check(self.loss_chunk_tokens >= 0, "loss_chunk_tokens", self.loss_chunk_tokens, "must be >= 0 (0 = off)")
        check(self.min_clients >= 0, "min_clients", self.min_clients, "must be >= 0 (0 = clients.per_round)")
        check(math.isfinite(self.round_timeout_s) and 0 <= self.round_timeout_s <= 86400, "round_timeout_s",
              self.round_timeout_s, "must be between 0 (wait for all) and a day")  # fmt: skip
        check(self.min_workers >= 1, "min_workers", self.min_workers, "must be >= 1")
        check(math.isfinite(self.worker_timeout_s) and 1 <= self.worker_timeout_s <= 86400, "worker_timeout_s",
              self.worker_timeout_s, "must be between 1 s and a day")  # fmt: skip
        check(math.isfinite(self.rejoin_timeout_s) and 0 <= self.rejoin_timeout_s <= 7 * 86400, "rejoin_timeout_s",
              self.rejoin_timeout_s, "must be between 0 (do not wait) and a week")  # fmt: skip


def link_delay_s(nbytes: int, mbps: float, rtt_ms: float) -> float:
    """One-way delay of a message: serialisation ``nbytes * 8 / (mbps * 1e6)`` plus half the round-trip time."""
    if mbps <= 0:
        raise ConfigError(f"link bandwidth must be > 0 Mbps, got {mbps}")
    if nbytes < 0 or rtt_ms < 0:
        raise ConfigError(f"nbytes and rtt_ms must be >= 0, got nbytes={nbytes}, rtt_ms={rtt_ms}")
    return nbytes * 8 / (mbps * 1e6) + rtt_ms / 2e3


@dataclass
class LinkConfig:
    """A client's link to the server; defaults are the 5G setting of the paper's App. C.1. The same section drives
    the latency model (hosfl_dist.measure.latency) and the emulated link (comm.inject_delay)."""

    uplink_mbps: float = 30.0
    """Client->server bandwidth in Mbit/s (paper App. C.1: 30 Mbps 5G uplink)."""
    downlink_mbps: float = 200.0
    """Server->client bandwidth in Mbit/s (paper: 200 Mbps)."""
    rtt_ms: float = 30.0
    """Round-trip time in ms; each one-way message pays half of it (paper: 30 ms)."""

    def __post_init__(self) -> None:
        check(self.uplink_mbps > 0, "uplink_mbps", self.uplink_mbps, "must be > 0")
        check(self.downlink_mbps > 0, "downlink_mbps", self.downlink_mbps, "must be > 0")
        check(self.rtt_ms >= 0, "rtt_ms", self.rtt_ms, "must be >= 0")

    def uplink_s(self, nbytes: int) -> float:
        """One-way delay of an idle uplink for a message of ``nbytes``."""
        return link_delay_s(nbytes, self.uplink_mbps, self.rtt_ms)

    def downlink_s(self, nbytes: int) -> float:
        """One-way delay of an idle downlink for a message of ``nbytes``."""
        return link_delay_s(nbytes, self.downlink_mbps, self.rtt_ms)


@dataclass
class CommConfig(LinkConfig):
    inject_delay: bool = False
    """Delay every client<->server message by its link time (bytes / bandwidth + RTT/2), in either runtime, to
    measure latency hiding; the link is this section's uplink_mbps / downlink_mbps / rtt_ms."""
    speed_spread: float = 0.0
    """Elastic runs with comm.inject_delay: clients on links of different speeds (stragglers). Client m's bandwidths
    are uplink_mbps / downlink_mbps times exp(speed_spread · z_m), z_m a standard normal drawn from (job.seed, m):
    log-normal around the section's link. 0 = every client on the same link."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(math.isfinite(self.speed_spread) and 0 <= self.speed_spread <= 5, "speed_spread", self.speed_spread,
              "must be between 0 (one link for all) and 5")  # fmt: skip


@dataclass
class DataConfig:
    name: str = "fashion_mnist"
    """Dataset: fashion_mnist, cifar10_npz (the offline CIFAR-10 test images), cifar10, cifar100, synthetic; the text
    tasks sst2, rte, wsc, squad, sentiment_multiemo, custom (model.name=hf); or one a plug-in registers
    (hosfl_dist.data.register_task, docs/python-api.md#plug-ins)."""
    root: str = ""
    """Where the dataset lives; empty = the dataset's default location."""
    partition: Literal["iid", "dirichlet"] = "iid"
    """How training samples are spread over the M clients."""
    alpha: float = 1.0
    """Dirichlet concentration α for partition=dirichlet (smaller = more heterogeneous)."""
    augment: bool = False
    """Random crop + horizontal flip on training batches (CIFAR)."""
    train_max_samples: int = 0
    """Use at most this many training samples (0 = all)."""
    eval_max_samples: int = 0
    """Evaluate on at most this many held-out samples (0 = all)."""
    classes: list[int] = field(default_factory=list)
    """Vision data sets: keep only the examples of these classes (training and held-out splits, before
    data.train_max_samples / data.eval_max_samples) and relabel them 0..len-1 in this order; the model's head has
    len(classes) outputs. Empty = every class."""
    source: Literal["local", "hub"] = "local"
    """Text tasks: read local files (data.train_path / data.eval_path) or the Hugging Face hub (needs network)."""
    train_path: str = ""
    """Text tasks: local JSONL/CSV/parquet training file (sentiment_multiemo: default shared/data file)."""
    eval_path: str = ""
    """Text tasks: local JSONL/CSV/parquet evaluation file."""
    columns: dict[str, str] = field(default_factory=dict)
    """Text tasks: canonical field -> column of the local file (e.g. {sentence: text, label: label})."""
    max_length: int = 128
    """Text tasks: tokens per example (prompt truncated from the left of its main text)."""
    padding_side: Literal["left", "right"] = "right"
    """Text tasks: which side gets the padding."""
    task: Literal["", "classification", "generation"] = ""
    """data.name=custom: the kind of the user's task (classification: label words at the prompt's end, accuracy;
    generation: the answer after the prompt, SQuAD F1 / exact match)."""
    template: str = ""
    """data.name=custom: the prompt, with str.format fields naming the file's columns, e.g.
    "{premise}\nQuestion: {hypothesis}? Answer:"."""
    label_words: list[str] = field(default_factory=list)
    """data.name=custom, classification: label i is verbalised by word i (e.g. [" yes", " maybe", " no"]); the file's
    labels are 0..n-1 or the words themselves."""

    CLASSES = {"fashion_mnist": 10, "cifar10_npz": 10, "cifar10": 10, "cifar100": 100, "synthetic": 4}
    """Classes of each vision data set (data.classes is checked against them before anything is loaded)."""

    def __post_init__(self) -> None:
        check(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        check(self.train_max_samples >= 0, "train_max_samples", self.train_max_samples, "must be >= 0")
        check(self.eval_max_samples >= 0, "eval_max_samples", self.eval_max_samples, "must be >= 0")
        if self.classes:
            n = self.CLASSES.get(self.name)
            dup = sorted({c for c in self.classes if self.classes.count(c) > 1})
            check(not dup, "classes", self.classes, f"class {dup[0] if dup else ''} is listed twice")
            bad = [c for c in self.classes if c < 0 or (n is not None and c >= n)]
            check(not bad, "classes", self.classes, f"class {bad[0] if bad else ''} is outside 0..{(n or 1) - 1}: "
                  f"data.name={self.name} has {n} classes")  # fmt: skip
            check(len(self.classes) >= 2, "classes", self.classes, "a classifier needs two or more classes")
        check(self.max_length >= 4, "max_length", self.max_length, "must be >= 4")
        for key in ("root", "train_path", "eval_path"):
            _check_path(key, getattr(self, key))
        generation = self.name == "squad" or (self.name == "custom" and self.task == "generation")
        check(self.partition == "iid" or not generation, "partition", self.partition,
              f"needs class labels; data.name={self.name} is a generation task: use iid")  # fmt: skip
        if self.name == "custom":
            check(bool(self.task), "task", self.task, "data.name=custom needs data.task: classification or generation")
            check(bool(self.template.strip()), "template", self.template,
                  "data.name=custom needs a prompt naming the file's columns, e.g. \"{text} It was\"")  # fmt: skip
            _check_template(self.template)
            check(self.source == "local", "source", self.source, "a custom task reads local files")
            if self.task == "classification":
                check(len(self.label_words) >= 2 and len(set(self.label_words)) == len(self.label_words),
                      "label_words", self.label_words, "a classification task needs two or more distinct label "
                      "words")  # fmt: skip
            else:
                check(not self.label_words, "label_words", self.label_words, "a generation task has no label words")
        else:
            for key in ("task", "template", "label_words"):
                check(not getattr(self, key), key, getattr(self, key), "applies to data.name=custom only (the "
                      f"{self.name} preset has its own)")  # fmt: skip


METRIC = re.compile(r"eval_[a-z0-9_]{1,60}|train_loss")
"""A metrics row's score an early stop can follow: an evaluation's (``eval_...``) or the train loss."""


@dataclass
class EarlyStoppingConfig:
    metric: str = ""
    """The metrics-row value that decides: eval_accuracy, eval_loss, a text task's eval_f1 or eval_exact_match, a
    plug-in task's own eval_..., or train_loss; empty: no early stopping (the run trains to its budget)."""
    patience: int = 3
    """Evaluations in a row without an improvement of more than min_delta over the best so far (from round 0's) after
    which the run stops: it evaluates, writes its final checkpoint and summary.json says stopped."""
    min_delta: float = 0.0
    """Smallest change over the best value so far that counts as an improvement, in the metric's units."""
    mode: Literal["auto", "max", "min"] = "auto"
    """max: higher is better; min: lower is better; auto: min for a metric whose name says loss, perplexity, error,
    mae or mse (as the studies' best columns), max otherwise."""

    def __post_init__(self) -> None:
        check(not self.metric or METRIC.fullmatch(self.metric) is not None, "metric", self.metric,
              "a metrics row's eval_<name> or train_loss, or empty for none")  # fmt: skip
        check(self.patience >= 1, "patience", self.patience, "must be >= 1 (evaluations)")
        check(math.isfinite(self.min_delta) and self.min_delta >= 0, "min_delta", self.min_delta,
              "must be a finite number >= 0")  # fmt: skip


@dataclass
class TrainConfig:
    budget_samples: int = 160_000
    """Stop once this many training samples have been processed by clients (paper App. B.5)."""
    eval_every_samples: int = 16_000
    """Evaluate on the held-out split every this many processed samples (and at the start and end)."""
    eval_batch_size: int = 256
    """Batch size of evaluation forwards."""
    eval_timeout_s: float = 3600.0
    """Longest an evaluation may take, in seconds; the workers that wait for the evaluating leader wait this long."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite activation, λ, loss or scalar: stop the run with an error naming the round, client and quantity,
    or skip that client's contribution to the round (counted as nonfinite_skipped in the metrics rows)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """End the run before its budget once its metric stops improving (off unless metric is set)."""

    def __post_init__(self) -> None:
        check(self.budget_samples >= 1, "budget_samples", self.budget_samples, "must be >= 1")
        check(self.eval_every_samples >= 1, "eval_every_samples", self.eval_every_samples, "must be >= 1")
        check(self.eval_batch_size >= 1, "eval_batch_size", self.eval_batch_size, "must be >= 1")
        check(1 <= self.eval_timeout_s <= 7 * 86400, "eval_timeout_s", self.eval_timeout_s,
              "must be between 1 s and a week")  # fmt: skip
        evaluations = self.budget_samples // self.eval_every_samples
        check(evaluations <= MAX_EVALUATIONS, "eval_every_samples", self.eval_every_samples,
              f"gives {evaluations:,} evaluations over train.budget_samples={self.budget_samples}; at most "
              f"{MAX_EVALUATIONS:,}")  # fmt: skip


@dataclass
class CheckpointConfig:
    interval_samples: int = 0
    """Save a checkpoint every this many processed samples (0: no checkpoints; SIGTERM still saves one)."""
    keep: int = 2
    """Complete checkpoints kept in job.out_dir/checkpoints (older ones are removed)."""
    final: bool = True
    """Also save a checkpoint after the last round, so a finished run's weights can be exported
    (python -m hosfl_dist.export): one more save (its size and time: results/bench/README.md#checkpoint_cost).
    false: only interval and stop checkpoints (a signal's, and a run stopped early writes its last one whatever this
    says)."""

    def __post_init__(self) -> None:
        check(self.interval_samples >= 0, "interval_samples", self.interval_samples, "must be >= 0 (0 = off)")
        check(self.keep >= 1, "keep", self.keep, "must be >= 1")


@dataclass
class Config:
    """The whole tree. Each section checks itself; what needs two sections or the algorithm registry is checked by
    :func:`hosfl_dist.runtime.checks.check_config` where a run's config is built."""

    job: JobConfig = field(default_factory=JobConfig)
    """Run-level settings."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Which training method."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model."""
    split: SplitConfig = field(default_factory=SplitConfig)
    """Where the model is cut."""
    zo: ZOConfig = field(default_factory=ZOConfig)
    """Zeroth-order estimator of the clients."""
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    """Client population and client optimizer."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Server optimizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and partition."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Budget and evaluation schedule."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters of hf models."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Injected link model (latency-hiding measurements)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints for exact resume."""


class FieldError(ConfigError):
    """A failed check inside a section; the loader prefixes the section path to `key`."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        super().__init__(f"invalid value for {key}: {shown(value)} ({why})")
        self.key, self.value, self.why = key, value, why


def check(ok: bool, key: str, value: Any, why: str) -> None:
    """Refuse ``value`` of ``key`` (relative to its section, or dotted from the root) unless ``ok``."""
    if not ok:
        raise FieldError(key, value, why)


def shown(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters: a message names a value, it does not echo a file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text):,} characters)"


def _is_file_name(name: str) -> bool:
    """Whether ``name`` is one path component that stays in its folder (no separator, not . or ..)."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and len(name.encode()) <= NAME_MAX


def _check_path(key: str, path: str) -> None:
    """A path the system can take: at most PATH_MAX characters in components of at most NAME_MAX bytes."""
    check(len(path) <= PATH_MAX, key, path, f"a path of at most {PATH_MAX} characters")
    long = [p for p in path.split("/") if len(p.encode()) > NAME_MAX]
    check(not long, key, path, f"a path component is longer than {NAME_MAX} bytes")


def _check_template(template: str) -> None:
    """data.template: str.format fields that name the file's columns (what the custom task reads)."""
    import string

    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise FieldError("template", template, str(exc)) from None
    check(bool(names) and all(f.isidentifier() for f in names), "template", template, "name the file's columns as "
          "{column} fields, e.g. \"{premise}\\nQuestion: {hypothesis}? Answer:\"")  # fmt: skip
