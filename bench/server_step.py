"""The server's step on a GPU at the published shapes: tokens/s and model FLOPs utilisation (MFU).

    python -m bench.server_step [--arch qwen3-0.6b qwen3-1.7b qwen3-4b qwen3-8b] [--batch 8] [--seq 512] [--reps 10]
                                [--optimizer-impl auto [for_loop foreach fused]]

For each architecture (``model.source=arch:<name>``: the published config, weights drawn from ``job.seed``) the
split model is built the way a run builds it — bf16 base, cut 5, LoRA r=8 on q/v on both sides (the paper's), the
server part materialised on ``--device`` — and one HO-SFL server step is timed: f_s forward on the client's
activation, the causal LM loss over the whole vocabulary (SQuAD-style generation training: the largest head), the
backward down to λ = ∂ℓ/∂z, and θs's optimizer step (AdamW on the LoRA tensors). The activation is the client's
own output for one batch of random token ids (``--batch`` × ``--seq``), computed once; every token is a label, and
the head runs at the positions the loss reads, as the run's server does (the task's ``predict`` side input).
``--optimizer-impl`` times the same build with each of torch's optimizer implementations (``auto``, what runs use:
torch's choice, ``foreach`` on CUDA; ``for_loop``, what runs used before; ``foreach``; ``fused``), one row each, their
steps interleaved repetition by repetition.

    tokens/s = batch · seq / step time (median of --reps after 3 warm-up steps, timed to the GPU's last kernel)
    MFU      = model FLOPs / step time / the GPU's dense bf16 peak

Model FLOPs per step, with N_s the server's matmul parameters (its decoder blocks and lm_head), L_s its blocks, T
the tokens, S the sequence length and D the attention width (heads · head_dim): forward 2·N_s·T + 2·L_s·T·S·D
(QKᵀ and AV, causal: half of the 4·L_s·T·S·D of full attention); backward 2·N_s·T (through the frozen base only
the activations' gradients: one matmul per weight, not the two of a trained one) + 4·L_s·T·S·D (both operands of
QKᵀ and AV). In all 4·N_s·T + 6·L_s·T·S·D; the LoRA weights' gradients (under 0.1 %) are left out.
The peak is read from the GPU's name (H100 SXM / H200: 989 TFLOP/s dense bf16; H100 PCIe: 756; A100: 312); on an
unknown GPU (or the CPU, for trying the command) MFU is left out. Needs CUDA for its figures: without it the command
stops in one line unless ``--device cpu`` asks for the CPU (slowly; try a small shape).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench.common import Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.core.optim import OPTIMIZER_IMPLS

PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peaks (no sparsity), by a substring of the device name (the first match wins)."""


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def build(arch: str, cut: int, device: str, seed: int = 0):
    """The run's own split build (``models.build_split_model``) of ``arch:<arch>``, both parts, on ``device``."""
    from hosfl_dist.config import build_config
    from hosfl_dist.data import data_info
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    cfg = build_config(
        {
            "model": {"name": "hf", "source": f"arch:{arch}", "dtype": "bfloat16"},
            "data": {"name": "squad"},
            "split": {"cut": cut},
            "job": {"seed": seed, "device": device, "progress": False},
        }
    )
    return cfg, build_split_model(cfg, data_info(data_sections(cfg)), True)  # hosfl: a zeroth-order client


def step_flops(server: torch.nn.Module, tokens: int, seq: int) -> tuple[float, int]:
    """(model FLOPs of one server step, N_s) as the module docstring counts them."""
    n = 0
    for name, p in server.named_parameters():
        if p.dim() == 2 and "lora_" not in name and "embed" not in name:
            n += p.numel()
    attn = len(server.layers) * tokens * seq * _attention_width(server)  # L_s·T·S·D
    return 4 * n * tokens + 6 * attn, n


def _attention_width(server: torch.nn.Module) -> int:
    attn = server.layers[0].self_attn
    heads = getattr(attn, "num_heads", None) or getattr(getattr(attn, "config", None), "num_attention_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    if heads and head_dim:
        return int(heads) * int(head_dim)
    return attn.q_proj.out_features if hasattr(attn.q_proj, "out_features") else attn.q_proj.base_layer.out_features


def top_ops(step: Callable[[], float], dev: torch.device, rows: int = 25) -> None:
    """Two more steps under torch.profiler: the ops that took the most device (or CPU) time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        step()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)


def measure(
    arch: str, cut: int, batch: int, seq: int, reps: int, device: str, profile: bool = False, impls=("auto",)
) -> list[dict]:
    """One row per optimizer implementation in ``impls``, each timed on the same build of ``arch``."""
    from hosfl_dist.core.optim import build_torch_optimizer
    from hosfl_dist.models import server_forward
    from hosfl_dist.tasks.generation import lm_loss, predicted_positions

    dev = torch.device(device)
    gc.collect()  # the previous shape's model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    t_build = time.perf_counter()
    cfg, split = build(arch, cut, device)
    built_s = time.perf_counter() - t_build
    server = split.server
    server.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, split.spec.vocab, (batch, seq), generator=gen).to(dev)
    with torch.no_grad():
        act = split.client_forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    split.client = None  # the server holds no client
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    trainable = [p for p in server.parameters() if p.requires_grad]
    side = {"predict": predicted_positions(ids)}  # the task's server_inputs: the head at the positions the loss reads

    def sync() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def step_with(opt: torch.optim.Optimizer) -> Callable[[], float]:
        def step() -> float:
            t0 = sync()
            z = act["z"].detach().requires_grad_(True)
            logits = server_forward(server, {**act, **side, "z": z})
            loss = lm_loss(logits, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert z.grad is not None  # λ
            return sync() - t0

        return step

    steps = {impl: step_with(build_torch_optimizer(cfg.server.optim, trainable, impl)) for impl in impls}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    order = list(impls)
    for _ in range(reps):  # interleaved, each repetition in a rotated order: every implementation sees the same load
        for impl in order:
            times[impl].append(steps[impl]())
        order = order[1:] + order[:1]
    flops, n_s = step_flops(server, batch * seq, seq)
    peak = peak_flops(dev)
    rows = []
    for impl in impls:
        if profile:
            print(f"-- {arch}, optimizer {impl}", flush=True)
            top_ops(steps[impl], dev)
        med = statistics.median(times[impl])
        rows.append({
            "arch": arch,
            "optimizer_impl": impl,
            "cut": cut,
            "batch": batch,
            "seq": seq,
            "server_blocks": len(server.layers),
            "attention_width": _attention_width(server),
            "server_matmul_params": n_s,
            "trainable_params": sum(p.numel() for p in trainable),
            "build_s": round(built_s, 2),
            "step_s": {"median": med, "min": min(times[impl]), "max": max(times[impl]), "reps": reps},
            "tokens_per_s": batch * seq / med,
            "model_flops_per_step": flops,
            "achieved_tflops": flops / med / 1e12,
            "peak_flops": peak,
            "mfu": flops / med / peak if peak else None,
        })  # fmt: skip
        if dev.type == "cuda":  # of all the implementations' steps together (their states are small)
            rows[-1]["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(dev)
    return rows  # the model goes with this frame: the next shape is built after it is freed


def figures(data: dict) -> tuple[dict, dict]:
    values = {}
    for r in data["runs"]:
        if r.get("optimizer_impl", "auto") != "auto":
            continue  # an A/B row: in the record's runs, not a figure
        key = r["arch"].replace("-", "_").replace(".", "_")
        values[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        values[f"{key}_mfu"] = r["mfu"]
    return values, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"])
    p.add_argument("--cut", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (slow: try a small shape)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of two more steps per shape")
    p.add_argument(
        "--optimizer-impl",
        nargs="+",
        default=["auto"],
        choices=OPTIMIZER_IMPLS,
        help="time each of these torch optimizer implementations on the same build (default: auto)",
    )
    args = options(p).parse_args(argv)
    if args.batch < 1 or args.seq < 2 or args.reps < 1:
        p.error("--batch and --reps must be >= 1 and --seq >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(
            f"--device {args.device}: torch sees no CUDA device here (--device cpu runs it on the CPU, slowly: "
            "e.g. --arch qwen3-0.6b --batch 1 --seq 16)"
        )
    rec = Recorder(BENCHMARKS["server_step"], argv, args.via)
    dev = torch.device(args.device)
    runs = []
    rows = (
        r
        for arch in args.arch
        for r in measure(
            arch, args.cut, args.batch, args.seq, args.reps, args.device, args.profile, args.optimizer_impl
        )
    )
    for r in rows:
        arch = r["arch"]
        runs.append(r)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        mem = f", peak {r['peak_cuda_bytes'] / 2**30:.1f} GiB" if "peak_cuda_bytes" in r else ""
        print(
            f"{arch:12s} {r['optimizer_impl']:8s} B={args.batch} T={args.seq}: "
            f"step {r['step_s']['median'] * 1e3:.1f} ms, "
            f"{r['tokens_per_s']:,.0f} tokens/s, {r['achieved_tflops']:.1f} TFLOP/s, MFU {mfu}{mem} "
            f"(N_s {r['server_matmul_params'] / 1e9:.2f} B, built in {r['build_s']:.1f} s)",
            flush=True,
        )
    data = {
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "runs": runs,
    }
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
