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

    python -m hosfl_dist.measure.memory --model tiny:llama --cut 2 --batch 32 --seq 128 --out results/memory/tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.measure.modes import MODES, VISION_INPUTS, ProfileSpec, make_step
from hosfl_dist.measure.tracker import measure

MB = 1024**2


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
    for mode in modes:
        print(f"profiling {mode} ({spec.model}, cut {spec.cut}, batch {spec.batch})", file=sys.stderr, flush=True)
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
    ax.set(ylabel="client peak memory (MiB of live tensor storage)", title=f"Client peak memory: {what}, P={s['P']}")
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
