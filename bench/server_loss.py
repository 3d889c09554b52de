"""The server's LM loss over the whole vocabulary, in one piece and in chunks (``server.loss_chunk_tokens``): peak
memory and time of the server's forward/backward at a Qwen3-like shape that fits on a CPU.

    python -m bench.server_loss [--chunks 0 256] [--batch 4] [--seq 256] [--reps 3] [--threads 1] [--out bench/out]

The model is a random Qwen3 with the real vocabulary (151,936 tokens) and small blocks (hidden 256, 4 blocks, cut
2, so the server holds 2 blocks, the final norm and the untied lm_head), LoRA r=8 on q/v on the server as runs put
it (lm_head frozen). One client upload of ``--batch`` × ``--seq`` random tokens, every token a label (SQuAD-style
generation training with the longest answer), goes through the production server compute
(:class:`~hosfl_dist.runtime.server_compute.GroupCompute`: the task's side inputs, f_s, the per-sample loss sums,
the backward to λ), with ``loss_chunk_tokens`` set on the task and the server as ``models.lm.build`` sets them from
the config. Each setting of ``--chunks`` (0: the unchunked path, one (N, V) logits tensor) is measured in turn:

    peak    = the largest live bytes of tensor storages during one forward/backward, above what was alive before it
              (weights, the upload), counted at the aten level (``hosfl_dist.measure.tracker.AllocationTracker``)
    time    = median over --reps passes after one warm-up, settings interleaved, the thread's CPU clock

and the loss and λ of each chunked setting are compared with the unchunked one (max |difference|).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from bench.common import Recorder, options
from bench.suite import BENCHMARKS

SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
CUT = 2


def build() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(f_c, f_s) of the Qwen3-like shape, LoRA r=8 on the server's q/v (everything else frozen)."""
    from hosfl_dist.models.hf_load import tiny_causal_lm
    from hosfl_dist.models.hf_split import apply_lora, split_causal_lm

    model = tiny_causal_lm("qwen3", **SHAPE)
    client, server = split_causal_lm(model, CUT, untie=True)
    apply_lora(server, ["q_proj", "v_proj"], r=8, alpha=16, seed=1)
    return client, server


def measure(chunks: list[int], batch: int, seq: int, reps: int) -> list[dict]:
    from hosfl_dist.algorithms.compute import Upload
    from hosfl_dist.config import ServerConfig
    from hosfl_dist.measure.tracker import AllocationTracker
    from hosfl_dist.models.sources import tiny_tokenizer
    from hosfl_dist.runtime.server_compute import GroupCompute
    from hosfl_dist.tasks.generation import GenerationTask

    client, server = build()
    server.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        z = client(input_ids=ids, attention_mask=mask)["z"]  # (B, T, D)
    del client
    upload = {0: Upload({"z": z, "attention_mask": mask}, ids)}
    task = GenerationTask(tiny_tokenizer(), "right", max_positions=None)
    counts = {0: float(task.sample_counts(ids).sum())}
    computes = {c: GroupCompute(server, task, ServerConfig(loss_chunk_tokens=c)) for c in chunks}

    def run(chunk: int) -> tuple[float, float, dict]:
        server.loss_chunk_tokens = task.loss_chunk_tokens = chunk  # what models.lm.build sets from the config
        gc.collect()
        t0 = time.thread_time()
        passes = computes[chunk].forward_backward(upload, counts)
        return time.thread_time() - t0, passes.losses[0], passes.lams[0]

    rows = {c: {"chunk_tokens": c, "times": []} for c in chunks}
    for c in chunks:  # warm-up, and the peak of one pass under the tracker
        run(c)
        gc.collect()
        tracker = AllocationTracker()
        resident = tracker.register([*server.parameters(), z, mask, ids])
        with tracker:
            _, loss, lam = run(c)
        rows[c].update(peak_bytes=tracker.peak - resident, loss=loss, lam=lam)
        computes[c].optimizer.zero_grad(set_to_none=True)
    order = list(chunks)
    for _ in range(reps):
        for c in order:
            rows[c]["times"].append(run(c)[0])
        order = order[1:] + order[:1]
    ref = rows[chunks[0]]
    out = []
    for c in chunks:
        r = rows[c]
        out.append({
            "chunk_tokens": c,
            "tokens": int(counts[0]),
            "peak_bytes": r["peak_bytes"],
            "step_s": statistics.median(r["times"]),
            "times_s": r["times"],
            "loss": r["loss"],
            "loss_diff": abs(r["loss"] - ref["loss"]),
            "lam_max_diff": float((r["lam"] - ref["lam"]).abs().max()),
        })  # fmt: skip
    return out


def figures(data: dict) -> tuple[dict, dict]:
    rows = {r["chunk_tokens"]: r for r in data["runs"]}
    base = rows.get(0)
    values: dict = {}
    if base is not None:
        values["peak_mb_unchunked"] = base["peak_bytes"] / 2**20
        values["step_s_unchunked"] = base["step_s"]
    chunked = [r for c, r in rows.items() if c]
    if chunked:
        r = chunked[0]
        values["peak_mb_chunked"] = r["peak_bytes"] / 2**20
        values["step_s_chunked"] = r["step_s"]
        if base is not None:
            values["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
            values["time_ratio"] = r["step_s"] / base["step_s"]
    return values, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 256],
                   help="server.loss_chunk_tokens settings, the first the reference (default: 0 256)")  # fmt: skip
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: 2 shared cores)")
    args = options(p).parse_args(argv)
    if any(c < 0 for c in args.chunks) or len(set(args.chunks)) != len(args.chunks):
        p.error("--chunks: distinct values >= 0")
    rec = Recorder(BENCHMARKS["server_loss"], argv, args.via)
    torch.set_num_threads(args.threads)
    runs = measure(args.chunks, args.batch, args.seq, args.reps)
    for r in runs:
        print(
            f"loss_chunk_tokens={r['chunk_tokens']:<5d} N={r['tokens']} peak {r['peak_bytes'] / 2**20:8.1f} MiB  "
            f"step {r['step_s']:.2f} s (CPU)  loss {r['loss']:.6f} (|Δ| {r['loss_diff']:.1e})  "
            f"λ max |Δ| {r['lam_max_diff']:.1e}",
            flush=True,
        )
    data = {"shape": SHAPE, "cut": CUT, "batch": args.batch, "seq": args.seq, "reps": args.reps,
            "threads": torch.get_num_threads(), "runs": runs}  # fmt: skip
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
