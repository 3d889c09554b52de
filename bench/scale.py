"""HO-SFL rounds of the paper's architectures at their real shapes on this machine: memory per rank and round time.

    python -m bench.scale --arch qwen3-8b --ranks 2                      # the 8B shape, one worker + 2 server ranks
    python -m bench.scale --arch qwen3-0.6b qwen3-1.7b qwen3-4b --ranks 1 2 --keep results/scale/scale.json
    python -m bench.scale --arch qwen3-0.6b --ranks 1 --batch 16 --seq 256 --micro-batch-tokens 1024 --checkpointing
    python -m bench.scale --arch qwen3-1.7b --ranks 2 --keep-gathered    # server.reshard_after_forward=false
    python -m bench.scale --table results/scale/scale.json                # print a kept file as a table

Each run is ``torchrun`` with S server ranks and one client worker on ``model.source=arch:<name>`` (the published
config, weights drawn from ``job.seed``; no download), bf16 base weights, cut 5, LoRA r=8 on q/v on both sides, the
offline sentiment data as SST-2 with sequences of ``--seq`` tokens. Reported per rank: the parameters it
materialised (summary.json ``memory``), its peak RSS (the kernel's VmHWM, from summary.json, and polled from outside
while the job runs), and the analytic budget of parameters (:func:`analytic`) — activations are reported separately
(K·B·T·D·2 bytes of z per round) and the interpreter with torch's libraries adds ~0.4 GB per process; and the round
time (the worker's
``run_round``, first round excluded when there is more than one) and the server's compute time per round. The runs
go into the record ``<out>/scale.json`` (its figures: the suite's setting, Qwen3-0.6B with S = 1 and 2); ``--keep
FILE`` also adds them to FILE, a list of runs keyed by their settings (a later run of the same settings replaces
the earlier one), which ``--table FILE`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, Recorder, options, proc_sample, torchrun_cmd
from bench.common import ranks as rank_pids
from bench.suite import BENCHMARKS

GB = 1e9


def run_overrides(args: argparse.Namespace, arch: str, ranks: int, out_dir: Path) -> list[str]:
    k, b = args.clients, args.batch
    return [
        "model.name=hf",
        f"model.source=arch:{arch}",
        "model.dtype=bfloat16",
        f"split.cut={args.cut}",
        "data.name=sentiment_multiemo",
        f"data.max_length={args.seq}",
        f"data.train_max_samples={max(64, 4 * k * b)}",
        f"data.eval_max_samples={args.eval_samples}",
        f"train.eval_batch_size={args.eval_samples}",
        f"clients.total={k}",
        f"clients.per_round={k}",
        f"clients.batch_size={b}",
        f"zo.num_perturbations={args.P}",
        f"train.budget_samples={args.rounds * k * b}",
        f"train.eval_every_samples={args.rounds * k * b}",
        f"server.ranks={ranks}",
        f"server.micro_batch_tokens={args.micro_batch_tokens}",
        f"server.activation_checkpointing={str(args.checkpointing).lower()}",
        f"server.reshard_after_forward={str(not args.keep_gathered).lower()}",
        "server.rpc_timeout_s=3600",
        "server.collective_timeout_s=3600",
        "job.progress=false",
        f"job.out_dir={out_dir}",
    ]


def budget(arch: str, cut: int, ranks: int) -> dict[str, float]:
    """Analytic bytes per role from the architecture (built on the meta device: nothing is allocated)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from hosfl_dist.models.archs import arch_config
    from hosfl_dist.models.hf_split import split_causal_lm

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(arch_config(arch), dtype=torch.bfloat16)
    client, server = split_causal_lm(model, cut, untie=True)

    def size(module: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    block = max(size(b) for b in server.layers)
    root = size(server.lm_head) + (size(server.norm) if server.norm is not None else 0)
    hidden = model.config.get_text_config().hidden_size
    return {"client": size(client), "server": size(server), "block": block, "root": root, "hidden": hidden}


def analytic(b: dict[str, float], role: str, ranks: int) -> int:
    """Parameter bytes a rank holds at its peak: f_c on a worker; f_s on a lone server; on a server rank of a group
    its shard of f_s, plus what FSDP2 gathers at once — the running decoder block and the next one (prefetched), or
    the whole lm_head (its own group) — plus the all-gather's copy of its own shard of that."""
    if role == "worker":
        return int(b["client"])
    if ranks == 1:
        return int(b["server"])
    gathered = max(2 * b["block"], b["root"])
    return int(b["server"] / ranks + gathered + gathered / ranks)


def poll_peaks(proc: subprocess.Popen, peaks: dict[int, int], stop: threading.Event) -> None:
    """Peak RSS of each rank process (torchrun's children, by rank), polled every 0.5 s; also the machine total."""
    while not stop.is_set():
        total = 0
        for rank, pid in rank_pids(proc.pid).items():
            sample = proc_sample(pid)
            rss = sample[1] if sample is not None else 0
            peaks[rank] = max(peaks.get(rank, 0), rss)
            total += rss
        peaks[-1] = max(peaks.get(-1, 0), total)
        stop.wait(0.5)


def run_one(args: argparse.Namespace, arch: str, ranks: int, command: str) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix=f"scale-{arch}-s{ranks}-"))
    cmd = torchrun_cmd(ranks + 1, ["-m", "hosfl_dist.run", *run_overrides(args, arch, ranks, out_dir)])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    stop = threading.Event()
    poller = threading.Thread(target=poll_peaks, args=(proc, peaks, stop), daemon=True)
    poller.start()
    out, _ = proc.communicate(timeout=args.timeout)
    stop.set()
    poller.join()
    wall = time.perf_counter() - start
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"status": "missing"}
    settings = {
        "arch": arch,
        "ranks": ranks,
        "cut": args.cut,
        "clients": args.clients,
        "batch": args.batch,
        "seq": args.seq,
        "P": args.P,
        "micro_batch_tokens": args.micro_batch_tokens,
        "checkpointing": args.checkpointing,
        "keep_gathered": args.keep_gathered,
        "command": command,
    }
    if proc.returncode != 0 or summary.get("status") != "completed":
        tail = "\n".join(out.splitlines()[-60:])
        peaks_gb = [round(v / GB, 2) for k, v in sorted(peaks.items()) if k >= 0]
        return {**settings, "failed": True, "rc": proc.returncode, "tail": tail, "polled_peak_rss_gb": peaks_gb,
                "polled_peak_total_rss_bytes": peaks.get(-1, 0), "wall_s": round(wall, 1)}  # fmt: skip
    b = budget(arch, args.cut, ranks)
    workers = summary["transport"]["workers"]
    w = next(iter(workers.values()))
    rounds = w["rounds"]
    round_s = (w["round_s"] - w["first_round_s"]) / (rounds - 1) if rounds > 1 else w["round_s"]
    submit_s = summary["transport"]["server"]["compute_s"].get("submit", 0.0) / max(rounds, 1)
    ranks_out = [{**entry, "analytic_bytes": analytic(b, entry["role"], ranks)} for entry in summary.get("memory", [])]
    tokens = args.clients * args.batch * args.seq
    return {
        **settings,
        "rounds": rounds,
        "round_s": round(round_s, 3),
        "server_submit_s_per_round": round(submit_s, 3),
        "server_tokens_per_s": round(tokens / submit_s, 1) if submit_s else None,
        "activation_bytes_per_round": tokens * b["hidden"] * 2,
        "memory": ranks_out,
        "polled_peak_rss_bytes": sorted((v for k, v in peaks.items() if k >= 0), reverse=True),
        "polled_peak_total_rss_bytes": peaks.get(-1, 0),
        "wall_s": round(wall, 1),
    }


def key(r: dict) -> str:
    text = "{arch} S={ranks} K={clients} B={batch} T={seq} mbt={micro_batch_tokens} ac={checkpointing}".format(**r)
    return text + (" kept" if r.get("keep_gathered") else "")  # server.reshard_after_forward=false


def reanalyse(results: list[dict]) -> None:
    """Recompute every record's analytic budget with the current :func:`analytic` (a meta-device build each)."""
    budgets: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        if r.get("failed"):
            continue
        b = budgets.setdefault((r["arch"], r["cut"]), budget(r["arch"], r["cut"], r["ranks"]))
        for m in r["memory"]:
            m["analytic_bytes"] = analytic(b, m["role"], r["ranks"])


def table(results: list[dict]) -> str:
    lines = [
        "| run | rank | role | param GB | peak RSS GB | analytic GB | round s | server tok/s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {key(r)} | – | failed (rc {r['rc']}) | | {r['polled_peak_rss_gb']} | | | |")
            continue
        for m in r["memory"]:
            lines.append(
                f"| {key(r)} | {m['rank']} | {m['role']} | {m['param_bytes'] / GB:.2f} | "
                f"{(m['peak_rss_bytes'] or 0) / GB:.2f} | {m['analytic_bytes'] / GB:.2f} | {r['round_s']} | "
                f"{r['server_tokens_per_s']} |"
            )
    return "\n".join(lines)


def figures(data: dict) -> tuple[dict, dict]:
    """Peak RSS of the largest server rank and of the worker, with their analytic parameter bytes as floors, and the
    round time, per S, of the suite's setting (Qwen3-0.6B, K=2 B=1 T=16, cut 5, P=2, no micro-batches)."""
    values, floors = {}, {}
    suite = {"arch": "qwen3-0.6b", "cut": 5, "clients": 2, "batch": 1, "seq": 16, "P": 2, "micro_batch_tokens": 0}
    for r in data["runs"]:
        if r.get("failed") or any(r[k] != v for k, v in suite.items()) or r["checkpointing"] or r.get("keep_gathered"):
            continue
        s = r["ranks"]
        servers = [m for m in r["memory"] if m["role"] != "worker"]
        worker = next(m for m in r["memory"] if m["role"] == "worker")
        top = max(servers, key=lambda m: m["peak_rss_bytes"] or 0)
        values[f"s{s}_server_peak_rss_gb"] = (top["peak_rss_bytes"] or 0) / GB
        floors[f"s{s}_server_peak_rss_gb"] = top["analytic_bytes"] / GB
        values[f"s{s}_worker_peak_rss_gb"] = (worker["peak_rss_bytes"] or 0) / GB
        floors[f"s{s}_worker_peak_rss_gb"] = worker["analytic_bytes"] / GB
        values[f"s{s}_round_s"] = r["round_s"]
    names = BENCHMARKS["scale"].names
    return {k: v for k, v in values.items() if k in names}, {k: v for k, v in floors.items() if k in names}


def keep(path: Path, runs: list[dict]) -> None:
    """Add ``runs`` to the list in ``path``, replacing a run of the same settings."""
    saved = json.loads(path.read_text()) if path.is_file() else []
    for res in runs:
        saved = [r for r in saved if key(r) != key(res)] + [res]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["qwen3-0.6b"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="server ranks S")
    p.add_argument("--cut", type=int, default=5)
    p.add_argument("--clients", type=int, default=2, help="K = M: clients per round")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=0)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--keep-gathered", action="store_true",
                   help="server.reshard_after_forward=false: a server group keeps each block's gathered weights from "
                   "its forward to its backward")  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--keep", type=Path, help="also add the runs to this list of runs (e.g. results/scale/scale.json)")
    p.add_argument("--table", type=Path, metavar="FILE", help="print a list of runs kept with --keep, and exit")
    args = options(p).parse_args(argv)
    if args.table:
        saved = json.loads(args.table.read_text())
        reanalyse(saved)
        args.table.write_text(json.dumps(saved, indent=1) + "\n")
        print(table(saved))
        return 0
    rec = Recorder(BENCHMARKS["scale"], argv, args.via)
    runs = []
    for arch in args.arch:
        for ranks in args.ranks:
            res = run_one(args, arch, ranks, rec.command)
            runs.append(res)
            print(table([res]) if not res.get("failed") else res["tail"], flush=True)
    print(table(runs))
    if args.keep:
        keep(args.keep, runs)
    data = {"runs": runs}
    failed = [key(r) for r in runs if r.get("failed")]
    rec.write(args.out, data, *figures(data), error=f"failed: {', '.join(failed)}" if failed else None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
