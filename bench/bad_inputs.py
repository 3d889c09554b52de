"""Every bad input of the faults issue, run as a user would, with the line it prints and its exit code.

In-process runs (``python -m hosfl_dist.run``) and, for the values that used to escape under torchrun,
``launch/torchrun.sh`` (which checks the input before torchrun starts the processes). Writes
results/faults/bad_inputs.md.

    python bench/bad_inputs.py
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FASHION = Path("/usr/share/datasets/fashion-mnist")
QUICK = ["--config", "configs/quickstart.yaml", "train.budget_samples=128", "job.progress=false"]


def broken_fashion(work: Path, name: str, mutate) -> str:
    """A copy of Fashion-MNIST with one file broken; returns data.root."""
    root = work / name
    shutil.copytree(FASHION, root)
    mutate(root)
    return str(root)


def truncate_gz(root: Path) -> None:
    f = root / "t10k-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes()[:5000])


def truncate_raw(root: Path) -> None:
    f = root / "t10k-images-idx3-ubyte.gz"
    raw = gzip.decompress(f.read_bytes())
    f.unlink()
    (root / "t10k-images-idx3-ubyte").write_bytes(raw[: len(raw) // 2])


def two_byte_labels(root: Path) -> None:
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00"))


def label_out_of_range(root: Path) -> None:
    f = root / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(f.read_bytes()))
    raw[8 + 17] = 12
    f.write_bytes(gzip.compress(bytes(raw)))


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="hosfl-bad-"))
    (work / "a_file").write_text("")
    held = work / "held"
    held.mkdir()
    (held / "summary.json").write_text('{"status": "completed"}')
    (work / "bad.yaml").write_text("job:\n  name: [unclosed\n")
    cases = [
        ("truncated IDX (gz)", [f"data.root={broken_fashion(work, 'gz', truncate_gz)}"]),
        ("truncated IDX (raw)", [f"data.root={broken_fashion(work, 'raw', truncate_raw)}"]),
        ("2-byte label file", [f"data.root={broken_fashion(work, 'lab', two_byte_labels)}"]),
        ("label out of range", [f"data.root={broken_fashion(work, 'rng', label_out_of_range)}"]),
        ("job.out_dir an existing file", [f"job.out_dir={work / 'a_file'}"]),
        ("job.out_dir under a file", [f"job.out_dir={work / 'a_file' / 'sub'}"]),
        ("job.out_dir the system refuses", ["job.out_dir=/proc/hosfl"]),
        ("job.out_dir=''", ["job.out_dir="]),
        ("job.out_dir holding a run", [f"job.out_dir={held}"]),
        ("job.device=cuda without a GPU", ["job.device=cuda"]),
        ("zo.rng_device=foo", ["zo.rng_device=foo"]),
        ("zo.num_perturbations=100000", ["zo.num_perturbations=100000"]),
        ("job.seed=-1", ["job.seed=-1"]),
        ("zo.mu=inf", ["zo.mu=inf"]),
        ("zo.mu=1e-30", ["zo.mu=1e-30"]),
        ("clients.optim.lr=nan", ["clients.optim.lr=nan"]),
        ("YAML syntax error", ["--config", str(work / "bad.yaml")]),
    ]
    torchrun_cases = [
        ("server.rpc_timeout_s=inf", ["server.rpc_timeout_s=inf"]),
        ("server.rpc_timeout_s=1e-9", ["server.rpc_timeout_s=1e-9"]),
        ("zo.num_perturbations=0", ["zo.num_perturbations=0"]),
        ("job.interface=nosuch0", ["job.interface=nosuch0"]),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lines = [
        "`python bench/bad_inputs.py` — each bad input, the output of the run and its exit code",
        "",
        "| input | runtime | exit code | output lines | output |",
        "|---|---|---|---|---|",
    ]
    for name, args in cases:
        argv = [*args, *QUICK[2:]] if args[:1] == ["--config"] else [*QUICK, *args]
        p = subprocess.run([sys.executable, "-m", "hosfl_dist.run", *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
        out = p.stderr.strip().splitlines()
        lines.append(f"| {name} | in-process | {p.returncode} | {len(out)} | `{out[-1] if out else ''}` |")
        print(lines[-1], flush=True)
    for name, args in torchrun_cases:
        p = subprocess.run(["bash", "launch/torchrun.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
        out = (p.stdout + p.stderr).strip().splitlines()
        lines.append(f"| {name} | launch/torchrun.sh | {p.returncode} | {len(out)} | `{out[-1] if out else ''}` |")
        print(lines[-1], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    results = ROOT / "results" / "faults"
    results.mkdir(parents=True, exist_ok=True)
    (results / "bad_inputs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
