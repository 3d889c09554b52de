"""HO-SFL at the authors' code's CIFAR-10 setting, hosfl_dist beside a plain reference loop (and the authors' code
where someone has it), samples/s in one invocation.

    python -m bench.peer                                   # ~2-4 min on 2 shared cores: bench/out/peer.json
    python -m bench.peer --replicas per_client --rounds 12 --warmup 2 --repeat 2
    python -m bench.peer --peer-code ~/HO-SFL --peer-command "python main.py ..." --peer-samples 19200

The setting is ``configs/repro/resnet18_cifar10_code.yaml``, the one in which the authors' published code was run
beside hosfl_dist (results/cpu_repro/README.md, "ResNet-18 at the authors' code's settings"): ResNet-18 cut after
residual stage 2, M=100 clients, K=10 per round, batch 32, P=5, μ=1e-3, AdamW 1e-3 / 1e-4 on both sides,
``model.freeze_bn=code`` (the client's BatchNorm on fixed statistics, the server's on batch statistics, one server
pass per client), one thread. Three ways of running a round of it take turns, their order alternating from turn to
turn (ABBA) so that load from other processes falls on each alike:

- **ours**: ``hosfl_dist.train`` on that config with ``clients.replicas=shared`` (one client replica, always current,
  as the authors' code keeps one client model; ``--replicas per_client`` measures the default, whose catch-up replay
  grows with the rounds a client missed, up to M/K − 1 on average), i.e. the in-process runtime and trainer that
  ``python -m hosfl_dist.run`` runs, timed between the ends of its rounds (``on_round_end``);
- **reference**: a reference loop written here, not the authors' code: a single-process plain-PyTorch HO-SFL round
  in the paper's Algorithm 1-2 order, on a plain ResNet-18 of the same shapes (checked: the same trainable tensors on
  each side and the same z), one client model shared by every client as the authors' code does. Per sampled client:
  z = f_c(x), the server's forward/backward giving λ, P perturbed forwards (u_p drawn from seed s_p, added, removed
  after the forward), v_p = λᵀ(z̃_p − z); then the server's AdamW step on the mean gradient, v̄ = the mean scalars,
  ĝ_c = 1/(Pμ) Σ_p v̄_p u_p redrawn from the seeds and the client's AdamW step. Its own data loop over the same 8,000
  offline CIFAR-10 images (M IID shards);
- **authors**: the authors' code (github.com/HKU-WILL-Lab/HO-SFL), only where ``--peer-command`` is given: a shell
  command run in ``--peer-code`` with one thread (OMP_NUM_THREADS=MKL_NUM_THREADS=1) and ``--peer-timeout``; its
  samples/s is ``--peer-samples`` over its wall time (start-up and its evaluations included), or, without
  ``--peer-samples``, the last "<number> samples/s" or "samples/s: <number>" its output prints. Nothing of it is
  fetched or kept by this benchmark. Without ``--peer-command`` one line says that it was not measured.

Each way runs as a process of its own and is timed over two spans, and a ratio only ever divides one span by the
same span:

- **rounds**: K·B per round over the wall time from the end of the last warm-up round (``--warmup``) to the end of
  the last round, inside the process; the authors' code's is the last "samples/s" its output prints (what its
  training loop says of its rounds);
- **process**: every round's samples (warm-up included) over the process's wall time, from its start to its exit:
  interpreter and library start-up, data, model build and the evaluations included. Ours evaluates
  ``data.eval_max_samples=32`` test images before the first round and after the last, and the reference loop
  evaluates the same images at the same points; the authors' is ``--peer-samples`` over its command's wall time
  (with its own evaluations, whatever they are: a command that evaluates more costs more here).

One figure per turn and span; the record keeps every turn, the figures are medians, and each ratio is the median of
the per-turn ratios (both sides measured in the same turn, over the same span). Beside each, samples per CPU second
(``time.process_time`` in the process for the rounds; the finished processes' CPU time for the whole process): on
shared cores a one-thread process waits for a core while others run, which moves its wall time by tens of percent
from one turn to the next and its CPU time far less.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.common import ROOT, Recorder, commit, options
from bench.suite import BENCHMARKS
from hosfl_dist.cli.api import train
from hosfl_dist.config import Config, load_config
from hosfl_dist.config.schema import OptimConfig
from hosfl_dist.data.vision import load_cifar10_npz
from hosfl_dist.models.vision import resnet18_split
from hosfl_dist.runtime.callbacks import Callback

CONFIG = "configs/repro/resnet18_cifar10_code.yaml"
HISTORY = (
    "issue 37 quotes runs of similar length (19,200 samples) taking 337-522 s here against 473-756 s with the "
    "authors' code, on a shared machine at different times, never side by side"
)
NOT_MEASURED = (
    "authors' code (github.com/HKU-WILL-Lab/HO-SFL): not available here, not measured "
    "(--peer-code PATH --peer-command CMD to measure it in the same invocation)"
)
REFERENCE = "reference loop written here, not the authors' code"


# -- ours: the production path -----------------------------------------------------------------------------------------
class RoundClock(Callback):
    """When each round ended, and its samples (``on_round_end`` of the trainer)."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float, int]] = []

    def on_round_end(self, round: int, info: dict) -> None:  # noqa: A002 - the Callback's name for it
        self.ends.append((time.perf_counter(), time.process_time(), info["samples"]))


def rates(ends: list[tuple[float, float, int]], warmup: int) -> dict[str, float]:
    """Samples of the rounds after the warm-up over the wall time (and the process's CPU time) from the last warm-up
    round's end to the last end."""
    measured, start = ends[warmup:], ends[warmup - 1]
    samples = sum(n for _, _, n in measured)
    return {
        "samples_per_s": samples / (measured[-1][0] - start[0]),
        "samples_per_cpu_s": samples / (measured[-1][1] - start[1]),
    }


def run_ours(cfg: Config, rounds: int, warmup: int) -> dict:
    """ours' rounds in this process (the child of :func:`run_process`)."""
    clock = RoundClock()
    with tempfile.TemporaryDirectory(prefix="peer_") as tmp:
        run = train(load_config(cfg, [f"job.out_dir={tmp}/run"]), callbacks=[clock])
        last = {k: v for k, v in run.metrics[-1].items() if k.startswith(("eval_", "train_"))}
    assert len(clock.ends) == rounds, f"ran {len(clock.ends)} rounds, asked for {rounds}"
    return {**rates(clock.ends, warmup), "last_metrics": last}


# -- reference: a plain-PyTorch HO-SFL loop (written here, not the authors' code) --------------------------------------
class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def plain_resnet18_split(num_classes: int, cut: int) -> tuple[nn.Sequential, nn.Sequential]:
    """torchvision's ResNet-18 layout with plain modules, cut after residual stage ``cut``: (f_c, f_s)."""
    stages, c_in = [], 64
    for i, w in enumerate((64, 128, 256, 512)):
        stages.append(nn.Sequential(Block(c_in, w, 1 if i == 0 else 2), Block(w, w, 1)))
        c_in = w
    stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    client = nn.Sequential(*stem, *stages[:cut])
    server = nn.Sequential(*stages[cut:], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))
    for m in [*client.modules(), *server.modules()]:  # freeze_bn=code: BatchNorm's affine parameters do not train
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(False)
    return client.eval(), server.train()  # the client's BatchNorm on fixed statistics, the server's on the batch's


def trainable(module: nn.Module) -> list[Tensor]:
    return [w for w in module.parameters() if w.requires_grad]


def draw(params: list[Tensor], seed: int) -> list[Tensor]:
    """u_p ~ N(0, I) regenerated from its seed s_p, tensor by tensor."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


@dataclass
class ReferenceLoop:
    """HO-SFL rounds in one process, Algorithm 1 top to bottom: one client model shared by all clients."""

    client: nn.Module
    server: nn.Module
    images: Tensor  # (N, 3, 32, 32) uint8
    labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    mean: Tensor
    std: Tensor
    clients: int
    per_round: int
    batch: int
    P: int
    mu: float
    client_optim: torch.optim.Optimizer
    server_optim: torch.optim.Optimizer
    rng: torch.Generator

    @classmethod
    def build(cls, cfg: Config) -> ReferenceLoop:
        data = load_cifar10_npz(cfg.data.root)
        client, server = plain_resnet18_split(data.num_classes, cfg.split.cut)

        def adamw(module: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
            if o.name != "adamw" or o.schedule != "constant" or o.warmup_rounds:
                raise ValueError("the reference loop steps AdamW at a constant rate (the authors' code's setting)")
            return torch.optim.AdamW(trainable(module), o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)

        return cls(
            client, server, data.train_x, data.train_y, data.test_x, data.test_y,
            torch.tensor(data.mean).view(1, 3, 1, 1), torch.tensor(data.std).view(1, 3, 1, 1),
            cfg.clients.total, cfg.clients.per_round, cfg.clients.batch_size, cfg.zo.num_perturbations, cfg.zo.mu,
            adamw(client, cfg.clients.optim), adamw(server, cfg.server.optim),
            torch.Generator().manual_seed(cfg.job.seed),
        )  # fmt: skip

    def sample(self, m: int) -> tuple[Tensor, Tensor]:
        """B samples of client m's IID shard (every M-th image from m)."""
        shard = torch.arange(m, len(self.labels), self.clients)
        idx = shard[torch.randperm(len(shard), generator=self.rng)[: self.batch]]
        return self.normalised(self.images[idx]), self.labels[idx]

    def normalised(self, images: Tensor) -> Tensor:
        return (images.float() / 255 - self.mean) / self.std

    def evaluate(self, n: int) -> float:
        """The accuracy of f_s(f_c(x)) on the first ``n`` test images, as ours evaluates ``data.eval_max_samples``."""
        self.server.eval()
        with torch.no_grad():
            hits = (self.server(self.client(self.normalised(self.test_images[:n]))).argmax(-1) == self.test_labels[:n])
        self.server.train()
        return hits.float().mean().item()

    def round(self) -> float:
        """One round; the mean of the K clients' losses."""
        K, P, mu = self.per_round, self.P, self.mu
        seeds = torch.randint(0, 2**62, (P,), generator=self.rng).tolist()  # s_p^t, broadcast
        sampled = torch.randperm(self.clients, generator=self.rng)[:K].tolist()  # S_t
        theta_c, theta_s = trainable(self.client), trainable(self.server)
        v = torch.empty(K, P)
        losses = []
        self.server_optim.zero_grad(set_to_none=True)
        for k, m in enumerate(sampled):
            x, y = self.sample(m)
            with torch.no_grad():
                z = self.client(x)  # z_m = f_c(x_m; θc), Eq. 1
            z.requires_grad_()
            loss = F.cross_entropy(self.server(z), y)
            loss.backward()  # ∇θs accumulates; λ_m = ∂ℓ_m/∂z_m, Eq. 11
            lam = z.grad.flatten()
            losses.append(loss.item())
            with torch.no_grad():
                for i, s in enumerate(seeds):  # ZOScalar, Algorithm 2
                    u = draw(theta_c, s)
                    torch._foreach_add_(theta_c, u, alpha=mu)
                    z_p = self.client(x)  # z̃_mp = f_c(x_m; θc + μu_p)
                    torch._foreach_sub_(theta_c, u, alpha=mu)
                    v[k, i] = lam @ (z_p.flatten() - z.detach().flatten())  # v_mp = λᵀ(z̃ − z), Eq. 12
        torch._foreach_div_([w.grad for w in theta_s], K)  # the mean of the K clients' gradients
        self.server_optim.step()
        v_bar = v.mean(0)  # v̄_p, Eq. 14
        with torch.no_grad():
            g_hat = [torch.zeros_like(w) for w in theta_c]
            for i, s in enumerate(seeds):  # ĝ_c = 1/(Pμ) Σ_p v̄_p u_p, Eq. 15
                torch._foreach_add_(g_hat, draw(theta_c, s), alpha=float(v_bar[i]) / (P * mu))
        for w, g in zip(theta_c, g_hat):
            w.grad = g
        self.client_optim.step()  # Eq. 16, with the client's AdamW
        return sum(losses) / K


def same_model(cfg: Config, loop: ReferenceLoop) -> bool:
    """Whether the reference's f_c and f_s have hosfl_dist's trainable tensors (shapes, in order) and z."""
    ours = resnet18_split(loop.server[-1].out_features, 3, cfg.split.cut, cfg.model.freeze_bn)
    for part, mine in zip(ours, (loop.client, loop.server)):
        if [w.shape for w in trainable(part)] != [w.shape for w in trainable(mine)]:
            return False
    x = torch.zeros(1, 3, 32, 32)
    with torch.no_grad():
        return ours[0].eval()(x).shape == loop.client(x).shape


def run_reference(cfg: Config, rounds: int, warmup: int) -> dict:
    """The reference's rounds in this process (the child of :func:`run_process`), evaluated where ours is: before the
    first round and after the last, on ``data.eval_max_samples`` test images."""
    torch.manual_seed(cfg.job.seed)
    loop = ReferenceLoop.build(cfg)
    accuracy = [loop.evaluate(cfg.data.eval_max_samples)]
    ends, losses = [], []
    for _ in range(rounds):
        losses.append(loop.round())
        ends.append((time.perf_counter(), time.process_time(), loop.per_round * loop.batch))
    accuracy.append(loop.evaluate(cfg.data.eval_max_samples))
    return {**rates(ends, warmup), "losses": losses, "accuracy": accuracy, "same_model": same_model(cfg, loop)}


CHILD = {"ours": run_ours, "reference": run_reference}
"""The ways run in a process of their own, with ``--child WAY``."""


def run_process(way: str, settings: list[str], samples: int) -> dict:
    """``way`` in a process of its own (``python -m bench.peer --child WAY``, one thread): its rounds as it timed them,
    and ``process``, its ``samples`` over the process's wall time and CPU time, from its start to its exit."""
    with tempfile.TemporaryDirectory(prefix="peer_child_") as tmp:
        out = Path(tmp) / "child.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
        cmd = [sys.executable, "-m", "bench.peer", "--child", way, "--child-out", str(out), *settings]
        start, cpu = time.perf_counter(), _children_cpu()
        got = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
        if got.returncode != 0:
            raise RuntimeError(f"{way} exited {got.returncode}: {(got.stdout + got.stderr)[-2000:]}")
        result = json.loads(out.read_text())
    result["process"] = {"samples": samples, "wall_s": wall, "cpu_s": cpu, "samples_per_s": samples / wall,
                         "samples_per_cpu_s": samples / cpu if cpu > 0 else None}  # fmt: skip
    return result


# -- authors: their code, where someone has it -------------------------------------------------------------------------
RATE = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*samples/s|samples/s\s*[:=]\s*([0-9]+(?:\.[0-9]*)?)")


def _children_cpu() -> float:
    """CPU seconds of the finished child processes (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_authors(command: str, code: str, samples: int | None, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start, cpu = time.perf_counter(), _children_cpu()
    got = subprocess.run(command, shell=True, cwd=code, env=env, capture_output=True, text=True, timeout=timeout)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    out = got.stdout + got.stderr
    if got.returncode != 0:
        raise RuntimeError(f"--peer-command exited {got.returncode}: {out.strip().splitlines()[-1:] or ''}")
    printed = [float(a or b) for a, b in RATE.findall(out)]
    if samples is None and not printed:
        raise RuntimeError("--peer-command printed no samples/s and --peer-samples was not given")
    result: dict = {"wall_s": wall, "samples_per_s": None, "samples_per_cpu_s": None, "process": None}
    if printed:  # what its training loop says of its rounds: the rounds' span
        result.update(samples_per_s=printed[-1], how="rounds: the last samples/s it printed")
    if samples is not None:  # its whole process: start-up and its evaluations included
        result["process"] = {"samples": samples, "wall_s": wall, "cpu_s": cpu, "samples_per_s": samples / wall,
                             "samples_per_cpu_s": samples / cpu if cpu > 0 else None}  # fmt: skip
        result["how"] = ", ".join(filter(None, [result.get("how"), f"process: {samples} samples / its wall time"]))
    return result


# -- the invocation ----------------------------------------------------------------------------------------------------
def figures(data: dict) -> tuple[dict, dict]:
    """Medians of samples/s, and medians of the per-turn ratios."""
    names = BENCHMARKS["peer"].names
    med = data["medians"]
    values = {
        "ours_samples_per_s": med.get("ours"),
        "reference_samples_per_s": med.get("reference"),
        "ours_vs_reference": med.get("ours_vs_reference"),
        "ours_vs_reference_cpu": med.get("ours_vs_reference_cpu"),
        "ours_process_samples_per_s": med.get("ours_process"),
        "reference_process_samples_per_s": med.get("reference_process"),
        "ours_vs_reference_process": med.get("ours_vs_reference_process"),
        "ours_vs_reference_process_cpu": med.get("ours_vs_reference_process_cpu"),
        "authors_samples_per_s": med.get("authors"),
        "authors_process_samples_per_s": med.get("authors_process"),
        "ours_vs_authors": med.get("ours_vs_authors"),
        "ours_vs_authors_process": med.get("ours_vs_authors_process"),
        "same_model": data["same_model"],
    }
    return {k: v for k, v in values.items() if k in names}, {}


SPANS = {"": lambda r: r, "_process": lambda r: r.get("process")}
"""The spans a figure is over, by the suffix of its name: the rounds (a way's own timing), the whole process."""


def medians(turns: list[dict], ways: list[str]) -> dict[str, float]:
    """Per span: each way's median samples/s, and ours / each other way's, the median of the per-turn ratios (wall and
    CPU time), where every turn measured both over that span; a span one side lacks has no ratio."""
    med: dict[str, float] = {}
    for suffix, span in SPANS.items():
        for way in ways:
            got = [span(r[way]) for r in turns]
            if all(g and g.get("samples_per_s") for g in got):
                med[f"{way}{suffix}"] = statistics.median(g["samples_per_s"] for g in got)
        for other in ways[1:]:
            pairs = [(span(r["ours"]), span(r[other])) for r in turns]
            for kind, cpu in (("samples_per_s", ""), ("samples_per_cpu_s", "_cpu")):
                if all(a and b and a.get(kind) and b.get(kind) for a, b in pairs):
                    med[f"ours_vs_{other}{suffix}{cpu}"] = statistics.median(a[kind] / b[kind] for a, b in pairs)
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7, help="rounds per run, warm-up included [7]")
    p.add_argument("--warmup", type=int, default=1, help="rounds left out of the timing [1]")
    p.add_argument("--repeat", type=int, default=4, help="turns of every way of running (medians kept) [4]")
    p.add_argument("--replicas", choices=("shared", "per_client"), default="shared", help="ours: clients.replicas")
    p.add_argument("--config", default=CONFIG, help=f"the setting [{CONFIG}]")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the setting, both loops (clients.total=4)")
    p.add_argument("--peer-code", default=None, help="folder of the authors' code (the command's working directory)")
    p.add_argument("--peer-command", default=None, help="shell command that runs the authors' code at this setting")
    p.add_argument("--peer-samples", type=int, default=None, help="samples the command processes (else parsed)")
    p.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds the command may take [3600]")
    p.add_argument("--child", choices=tuple(CHILD), default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = options(p).parse_args(argv)
    if args.peer_code and not args.peer_command:
        p.error("--peer-code needs --peer-command (how to run it at this setting)")
    if not 1 <= args.warmup < args.rounds:
        p.error(f"--warmup {args.warmup} must be at least 1 and below --rounds {args.rounds}")
    torch.set_num_threads(1)
    base = load_config(args.config, list(args.overrides))
    per_round = base.clients.per_round * base.clients.batch_size
    cfg = load_config(base, [
        f"clients.replicas={args.replicas}", "job.threads=1", "job.progress=false", "checkpoint.final=false",
        f"train.budget_samples={args.rounds * per_round}", f"train.eval_every_samples={args.rounds * per_round}",
        "data.eval_max_samples=32",
    ])  # fmt: skip
    if args.child:  # one way's rounds, in the process its parent times whole
        result = CHILD[args.child](cfg, args.rounds, args.warmup)
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    rec = Recorder(BENCHMARKS["peer"], argv, args.via)
    settings = ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--replicas", args.replicas, "--config",
                args.config, *args.overrides]  # fmt: skip
    code = str(Path(args.peer_code or ROOT).expanduser().resolve())
    ways = ["ours", "reference"] + (["authors"] if args.peer_command else [])
    turns: list[dict] = []
    for turn in range(args.repeat):
        row: dict = {}
        for way in ways if turn % 2 == 0 else ways[::-1]:
            if way == "authors":
                row[way] = run_authors(args.peer_command, code, args.peer_samples, args.peer_timeout)
            else:
                row[way] = run_process(way, settings, args.rounds * per_round)
            print(f"turn {turn} {way:9s} " + "; ".join(
                f"{span}: {got['samples_per_s']:.1f} samples/s" + (f", {got['samples_per_cpu_s']:.1f} samples/CPU s"
                                                                   if got.get("samples_per_cpu_s") else "")
                for span, got in (("rounds", row[way]), ("process", row[way].get("process") or {}))
                if got.get("samples_per_s")), flush=True)  # fmt: skip
        turns.append(row)
    med = medians(turns, ways)
    data = {
        "setting": {"config": args.config, "overrides": list(args.overrides), "replicas": args.replicas,
                    "M": cfg.clients.total, "K": cfg.clients.per_round, "B": cfg.clients.batch_size,
                    "P": cfg.zo.num_perturbations, "mu": cfg.zo.mu, "cut": cfg.split.cut,
                    "freeze_bn": cfg.model.freeze_bn, "rounds": args.rounds, "warmup": args.warmup, "threads": 1},
        "reference": REFERENCE,
        "authors": ({"code": code, "commit": commit(Path(code)), "command": args.peer_command}
                    if args.peer_command else NOT_MEASURED),
        "history": HISTORY,
        "turns": turns,
        "medians": med,
        "same_model": all(r["reference"]["same_model"] for r in turns),
    }  # fmt: skip
    print(f"HO-SFL, {cfg.model.name} cut {cfg.split.cut}, M={cfg.clients.total} K={cfg.clients.per_round} "
          f"B={cfg.clients.batch_size} P={cfg.zo.num_perturbations}, 1 thread, {args.rounds - args.warmup} timed "
          f"rounds of {args.rounds}, medians of {args.repeat} turns")  # fmt: skip
    print(f"  ours (hosfl_dist in-process, clients.replicas={args.replicas}): {med['ours']:.1f} samples/s over the "
          f"rounds, {med['ours_process']:.1f} over the whole process")  # fmt: skip
    print(f"  reference ({REFERENCE}): {med['reference']:.1f} samples/s over the rounds, "
          f"{med['reference_process']:.1f} over the whole process; same model: "
          f"{str(data['same_model']).lower()}")  # fmt: skip
    print(f"  ours / reference, rounds against rounds: {med['ours_vs_reference']:.2f}x wall, "
          f"{med['ours_vs_reference_cpu']:.2f}x CPU time; whole process against whole process: "
          f"{med['ours_vs_reference_process']:.2f}x wall, {med['ours_vs_reference_process_cpu']:.2f}x CPU time "
          "(medians of the per-turn ratios)")  # fmt: skip
    if args.peer_command:
        for suffix, span in (("", "rounds against rounds"), ("_process", "whole process against whole process")):
            if f"ours_vs_authors{suffix}" in med:
                print(f"  ours / authors' code ({code}), {span}: {med[f'ours_vs_authors{suffix}']:.2f}x "
                      f"(theirs {med[f'authors{suffix}']:.1f} samples/s)")  # fmt: skip
            else:
                print(f"  ours / authors' code, {span}: not measured (their command gave no figure over that span: "
                      + ("it printed no samples/s)" if not suffix else "no --peer-samples)"))  # fmt: skip
    else:
        print(f"  {NOT_MEASURED}")
    print(f"  history: {HISTORY}")
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
