"""The launch scripts and the benchmark driver, without running a job or a bench.

- bench/run_all.py writes into bench/out/ (ignored by git) unless told --update-results, the only way to rewrite the
  committed reference results in bench/results/; a bench it does not run is reused from the folder it writes to;
- launch/torchrun.sh sets torchrun's own default OMP_NUM_THREADS=1 for NPROC > 1 (so torchrun does not warn about
  it) and keeps a value of the user's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


def test_run_all_writes_the_committed_results_only_with_update_results(tmp_path):
    run_all = _run_all()
    assert run_all.output_dir() == Path("bench/out")
    assert run_all.output_dir(update_results=True) == Path("bench/results")
    assert run_all.output_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="--update-results"):
        run_all.output_dir(RESULTS)
    with pytest.raises(ValueError, match="give one"):
        run_all.output_dir(tmp_path, update_results=True)
    assert run_all.bench_argv("agg_traffic", Path("bench/out")) == [
        "bench/agg_traffic.py",
        "--out",
        "bench/out/agg_traffic.json",
    ]
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "bench/out/bench.md"], cwd=ROOT)
        assert ignored.returncode == 0, "bench/out/ must be ignored by git"


def test_run_all_dry_run_names_the_folder_and_writes_nothing(capsys):
    run_all = _run_all()
    before = _snapshot(RESULTS)
    assert run_all.main(["--only", "agg_traffic", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "output folder: bench/out\n" in out
    assert "run    agg_traffic: python bench/agg_traffic.py --out bench/out/agg_traffic.json" in out
    assert "reuse  overlap: bench/out/overlap.json" in out
    assert run_all.main(["--only", "agg_traffic", "--dry-run", "--update-results"]) == 0
    out = capsys.readouterr().out
    assert "output folder: bench/results (the committed reference results)" in out
    assert "--out bench/results/agg_traffic.json" in out
    assert _snapshot(RESULTS) == before


def test_run_all_reuses_from_the_folder_it_writes_to(tmp_path, capsys):
    """Every bench skipped: the summary is built from the JSON in --out alone, and bench/results is not touched."""
    run_all = _run_all()
    before = _snapshot(RESULTS)
    shutil.copy(RESULTS / "agg_traffic.json", tmp_path / "agg_traffic.json")
    assert run_all.main(["--out", str(tmp_path), "--skip", *run_all.BENCHES]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["benches"]["agg_traffic"] == {"ok": True, "reused": True}
    assert "no earlier result in " + str(tmp_path) in report["benches"]["overlap"]["why"]
    agg = [r for r in report["rows"] if r["metric"].startswith("aggregation uplink")]
    assert agg and {r["verdict"] for r in agg} == {"met"}
    assert {r["command"] for r in agg} == {f"python bench/agg_traffic.py --out {tmp_path / 'agg_traffic.json'}"}
    md = (tmp_path / "bench.md").read_text()
    assert "not a pass/fail of the product" in md and "| vs target |" in md
    assert _snapshot(RESULTS) == before


@pytest.mark.parametrize(
    ("nproc", "user_value", "seen"),
    [("3", None, "1"), ("3", "4", "4"), ("1", None, "unset")],
)
def test_torchrun_sh_sets_torchruns_default_thread_count_itself(tmp_path, nproc, user_value, seen):
    """A stand-in python records what each call of launch/torchrun.sh sees: the --check call, then torchrun's."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/bin/sh\necho "${{OMP_NUM_THREADS-unset}} $*" >> {log}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(VENV=str(venv), NPROC=nproc)
    if user_value is not None:
        env["OMP_NUM_THREADS"] = user_value
    subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "train.rounds=1"], env=env, check=True)
    check, launch = log.read_text().splitlines()
    assert "--check" in check and check.split()[0] == (user_value or "unset")
    assert "torch.distributed.run" in launch and launch.split()[0] == seen
