"""Client memory profiler (paper App. C.5): one step of each method's own client code, the server replaced by a
stand-in, for any supported model, cut, batch and sequence length.

The modes and what each runs are in :mod:`hosfl_dist.measure.modes`; the stand-in server in
:mod:`hosfl_dist.measure.standin`; how bytes are counted in :mod:`hosfl_dist.measure.tracker`: on every device an
allocation tracker (a TorchDispatchMode) records the bytes of every tensor storage created while the step runs and
drops them when the storage is freed, on top of the resident state registered before the step (parameters,
buffers, optimizer state held between rounds, the input batch). It is deterministic. It sees every tensor an aten op
returns, but not scratch buffers a kernel allocates internally (oneDNN/BLAS workspaces). On CUDA the caching
allocator's ``max_memory_allocated`` is reported as well (that is the primary figure there). Process RSS (peak
VmHWM, reset through /proc/self/clear_refs) is reported beside the count: it includes the Python interpreter,
libraries and allocator caches, and is only meaningful with one mode per process (the CLI's default).

Before the first mode the CLI says which modes will run and what each should roughly cost (peak tensor memory and
compute time, from the model's shape: :func:`hosfl_dist.measure.modes.expected_costs`), then one line as each mode
starts and ends (its elapsed time and peak), on stderr.

    python -m hosfl_dist.measure.memory --model tiny:llama --cut 2 --batch 32 --seq 128 --out out/memory

The committed measurements, their commands and what they show: results/memory/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.cli.guard import check_destination, check_device, guarded
from hosfl_dist.logs import init_logging
from hosfl_dist.measure.modes import MODES, VISION_INPUTS, ProfileSpec, check_modes, expected_costs, make_step
from hosfl_dist.measure.tracker import measure

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MIB = 1024**2
PROCESS_OVERHEAD = 0.6 * 1024**3
"""RSS of a profiling process beyond its tensors: the interpreter, torch and transformers (on CPU)."""


def profile_mode(spec: ProfileSpec, mode: str, steps: int = 1) -> dict[str, Any]:
    """Build the client for ``mode`` in this process and measure one step (see :func:`measure`)."""
    return {"mode": mode, **measure(make_step(mode, spec), spec.device, steps)}


def _child_command(spec: ProfileSpec, mode: str, steps: int, out: Path, threads: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hosfl_dist.measure.memory",
        "--model",
        spec.model,
        "--cut",
        str(spec.cut),
        "--width",
        str(spec.width),
        "--input-shape",
        ",".join(map(str, spec.input_shape)),
        "--classes",
        str(spec.classes),
        "--batch",
        str(spec.batch),
        "--seq",
        str(spec.seq),
        "--P",
        str(spec.num_perturbations),
        "--mu",
        repr(spec.mu),
        "--client-optim",
        spec.client_optim,
        "--momentum",
        repr(spec.momentum),
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
        "--threads",
        str(threads),
        *(arg for module in spec.plugins for arg in ("--plugin", module)),
    ]


def say(line: str) -> None:
    """A progress line, logged (the console's stderr; stdout carries the table): a mode can take minutes."""
    logger.info(line)


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", MIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def seconds(s: float) -> str:
    return "<0.1 s" if s < 0.1 else f"{s:.1f} s"


def matmul_flops_per_s(device: str) -> float:
    """Float32 matmul throughput here (best of three 1024^3 products): turns FLOP estimates into seconds."""
    a = torch.randn(1024, 1024, device=device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ a
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None


def plan(spec: ProfileSpec, modes: Sequence[str], isolate: bool, steps: int = 1) -> list[str]:
    """What will run and roughly what it costs (from the model's shape: nothing is trained), said before the
    first mode starts."""
    how = "each in its own process" if isolate else "in this process"
    what = f"cut {spec.cut}, batch {spec.batch}" + (f", seq {spec.seq}" if spec.is_lm else "") + f", P={spec.P}"
    lines = [f"profiling {len(modes)} mode(s) of {spec.model} ({what}), {how}: {', '.join(modes)}"]
    try:
        costs, expected = expected_costs(spec, modes)
    except HosflError:  # the model cannot be named: the profile would fail the same way
        raise
    except (OSError, ValueError, KeyError, AttributeError) as exc:  # an unusual config: the estimate is advisory
        return [*lines, f"(no cost estimate for this model: {type(exc).__name__}: {exc})"]
    rate, memory = matmul_flops_per_s(spec.device), machine_memory()
    lines += [
        f"model: f_c {size(costs.client_bytes)} of weights, f_c + f_s {size(costs.whole_bytes)}; one forward of f_c "
        f"{costs.client_flops / 1e9:.3g} GFLOP; here ~{rate / 1e9:.0f} GFLOP/s"
        + (f" and {size(memory)} of memory" if memory else ""),
        "rough expectation per mode (live tensors, within ~2x; a process adds ~0.6 GiB of RSS; the compute of "
        f"{steps} step(s), without loading the model, which each mode's process does again):",
    ]
    for mode, e in expected.items():
        warn = "  <- more than this machine's memory" if memory and e.peak_bytes + PROCESS_OVERHEAD > memory else ""
        lines.append(f"  {mode:<11} ~{size(e.peak_bytes):>10}   ~{seconds(steps * e.step_flops / rate):>8}{warn}")
    return lines


def profile(
    spec: ProfileSpec,
    modes: Sequence[str] = MODES,
    isolate: bool = True,
    steps: int = 1,
    threads: int = 0,
    label: str = "",
) -> dict[str, Any]:
    """Measure every mode (each in a fresh process with ``isolate``, so RSS figures are its own) and the ratios;
    ``threads``: the torch threads of each mode's process (0: torch's default); ``label`` begins each progress line
    (a scaling study's grid point)."""
    check_modes(modes, spec.plugins)
    results = {}
    prefix = f"{label}: " if label else ""
    for i, mode in enumerate(modes, 1):
        say(f"{prefix}[{i}/{len(modes)}] {mode}: started")
        t0 = time.perf_counter()
        if isolate:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "mode.json"
                proc = subprocess.run(_child_command(spec, mode, steps, path, threads), capture_output=True, text=True)
                if proc.returncode != 0:
                    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                    raise HosflError(f"{prefix}profiling mode {mode} failed: {tail}")
                results[mode] = json.loads(path.read_text())
        else:
            results[mode] = profile_mode(spec, mode, steps)
            gc.collect()
        r = results[mode]
        rss = f", {size(r['rss_peak_bytes'])} process RSS" if isolate and r.get("rss_peak_bytes") else ""
        say(f"{prefix}[{i}/{len(modes)}] {mode}: done in {time.perf_counter() - t0:.1f} s, peak "
            f"{size(r['peak_bytes'])} of live tensors{rss}")  # fmt: skip
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
COMPONENTS = (
    ("weights", lambda r: r["params_bytes"]),
    ("optimizer state", lambda r: r["optimizer_state_bytes"]),
    ("batch + buffers", lambda r: r["resident_bytes"] - r["params_bytes"] - r["optimizer_state_bytes"]),
    ("step working memory", lambda r: r["working_bytes"]),
)
"""What the counted peak is made of (they add up to ``peak_bytes``)."""


def figure(report: dict[str, Any]) -> Figure:
    """Two panels, both in MiB: the peak per mode (counted tensors, and process RSS where measured), and what the
    counted peak is made of on a log axis, so that components 1000x smaller than the weights still show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(report["modes"])
    rows = [report["modes"][m] for m in modes]
    x = np.arange(len(modes))
    fig, (totals, parts) = plt.subplots(1, 2, figsize=(1.6 * len(modes) + 5, 4.6), layout="constrained")

    peaks = {"live tensor storage (counted)": [r["peak_bytes"] / MIB for r in rows]}
    if report.get("isolated_processes") and all(r.get("rss_peak_bytes") for r in rows):  # RSS is the mode's own
        peaks["process peak RSS"] = [r["rss_peak_bytes"] / MIB for r in rows]
    width = 0.8 / len(peaks)
    ratios = report.get("ratio_to_inference", {})
    for i, (name, values) in enumerate(peaks.items()):
        bars = totals.bar(x + (i - (len(peaks) - 1) / 2) * width, values, width, label=name)
        if i == 0:
            texts = [f"{v:.1f}" + (f"\n×{ratios[m]:.2f}" if m in ratios else "") for m, v in zip(modes, values)]
            totals.bar_label(bars, texts, fontsize=7)
    totals.set_ylim(0, max(max(v) for v in peaks.values()) * 1.25)  # room for the labels inside the axes
    totals.set(ylabel="peak memory [MiB]", title="Peak per mode (label: MiB, ×inference)")
    totals.set_xticks(x, modes, rotation=15)
    totals.legend(fontsize=8, loc="upper left")
    totals.grid(axis="y", alpha=0.3)

    series = {name: [max(get(r), 0) / MIB for r in rows] for name, get in COMPONENTS}
    absent = [name for name, values in series.items() if not any(values)]
    shown = {name: values for name, values in series.items() if any(values)}
    width = 0.8 / max(len(shown), 1)
    for i, (name, values) in enumerate(shown.items()):
        parts.bar(x + (i - (len(shown) - 1) / 2) * width, values, width, label=name)
    smallest = min((v for values in shown.values() for v in values if v > 0), default=1.0)
    largest = max((v for values in shown.values() for v in values), default=1.0)
    parts.set_yscale("log")
    # the smallest non-zero part is a visible bar, not a sliver at the axis; headroom above the tallest bar (two
    # decades) keeps the legend off the bars
    parts.set_ylim(bottom=smallest / 3, top=max(largest, smallest) * 100)
    parts.set(ylabel="memory [MiB] (log)", title="What the counted peak holds")
    parts.set_xticks(x, modes, rotation=15)
    parts.legend(fontsize=8, loc="upper left", title="0 in every mode: " + ", ".join(absent) if absent else None,
                 title_fontsize=7)  # fmt: skip
    parts.grid(axis="y", alpha=0.3)

    s = report["spec"]
    what = f"{s['model']}, cut {s['cut']}, batch {s['batch']}"
    if s["model"] not in VISION_INPUTS:
        what += f", seq {s['seq']}" + ("" if s["lora"] else ", full fine-tuning")
    fig.suptitle(f"Client peak memory: {what}, P={s['P']}")
    return fig


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------- CLI
def _shape(text: str) -> tuple[int, ...]:
    """--input-shape C,H,W as a tuple (empty: the model's default); ConfigError naming the flag otherwise."""
    try:
        shape = tuple(int(v) for v in text.split(",")) if text.strip() else ()
    except ValueError:
        shape = (0,)
    if shape and (len(shape) != 3 or min(shape) < 1):
        raise ConfigError(f"--input-shape must be C,H,W (three positive integers), got {text!r}")
    return shape


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hosfl_dist.measure.memory",
        description="Client peak memory per training mode, with a stand-in server (paper App. C.5).",
    )
    p.add_argument(
        "--model",
        default="tiny:llama",
        help="tiny:<arch> | arch:<name> | pkg:<package> | HF dir | small_cnn | conv_mlp | resnet18",
    )
    p.add_argument("--cut", type=int, default=2, help="client depth (decoder blocks / conv blocks / stages)")
    p.add_argument("--width", type=int, default=16, help="small_cnn / conv_mlp: model.width")
    p.add_argument("--input-shape", default="", metavar="C,H,W",
                   help="vision models: one sample's shape (default: Fashion-MNIST's, CIFAR-10's for resnet18)")
    p.add_argument("--classes", type=int, default=10, help="vision models: classes (with --input-shape)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (LMs)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}, or any "
                   "other registered method (algorithm.name, a --plugin's included)")  # fmt: skip
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (as job.plugins): the methods it registers are modes")  # fmt: skip
    p.add_argument("--P", type=int, default=0, help="perturbations (0: 2 for LMs, 5 for vision, as in App. B)")
    p.add_argument("--mu", type=float, default=1e-3)
    p.add_argument("--client-optim", default="adamw", help="clients.optim.name: adamw or sgd")
    p.add_argument("--momentum", type=float, default=0.0, help="clients.optim.momentum of sgd")
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
    init_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        spec = ProfileSpec(
            model=args.model,
            cut=args.cut,
            width=args.width,
            input_shape=_shape(args.input_shape),
            classes=args.classes,
            batch=args.batch,
            seq=args.seq,
            num_perturbations=args.P,
            mu=args.mu,
            client_optim=args.client_optim,
            momentum=args.momentum,
            lora=args.lora,
            dtype=args.dtype,
            device=args.device,
            gguf_file=args.gguf,
            seed=args.seed,
            overlap=args.overlap,
            plugins=tuple(args.plugin),
        )
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        check_device(args.device)
        if not args.single_mode_json:
            check_destination(Path(args.out), below=False)  # memory.json and memory.png never go into a run's folder
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        if args.single_mode_json:  # child of an isolated run: one mode, raw figures
            Path(args.single_mode_json).write_text(json.dumps(profile_mode(spec, modes[0], args.steps)))
            return 0
        check_modes(modes, spec.plugins)  # before the plan, which builds the model's costs
        for line in plan(spec, modes, args.isolate, args.steps):
            say(line)
        report = profile(spec, modes, isolate=args.isolate, steps=args.steps, threads=args.threads)
    except HosflError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the memory profile stopped by Ctrl-C; nothing was written: run the same command again",
              file=sys.stderr)  # fmt: skip
        return 130
    out = Path(args.out)
    report["command"] = "python -m hosfl_dist.measure.memory " + " ".join(argv if argv is not None else sys.argv[1:])

    def write() -> int:
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(report, out / "memory.png")
        return 0

    code = guarded("writing the memory profile", write, out)
    if code:
        return code
    print(f"{'mode':<11} {'peak MiB':>9} {'resident':>9} {'working':>9} {'x infer':>7} {'RSS MiB':>8} {'step s':>7}")
    for m, r in report["modes"].items():
        ratio = report["ratio_to_inference"].get(m)
        rss = r.get("rss_peak_bytes")
        print(
            f"{m:<11} {r['peak_bytes'] / MIB:>9.2f} {r['resident_bytes'] / MIB:>9.2f} {r['working_bytes'] / MIB:>9.2f}"
            f" {ratio if ratio is not None else float('nan'):>7.3f} {rss / MIB if rss else float('nan'):>8.1f}"
            f" {r['step_s']:>7.3f}"
        )
    print(f"wrote {out / 'memory.json'} and {out / 'memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
