"""The launch scripts and the benchmark suite's command, without running a job or a long benchmark.

- ``python -m bench list`` names every benchmark with its figures, their targets and floors, read from the one
  declaration (bench/suite.py); ``python -m bench run`` writes ``<out>/<name>.json`` (default bench/out/, ignored by
  git) with every declared figure, ``met`` computed from the value, the target and its sense, and a record for a
  benchmark that failed; the benchmarks import bench.common, never edit sys.path;
- launch/torchrun.sh sets torchrun's own default OMP_NUM_THREADS=1 for NPROC > 1 (so torchrun does not warn about
  it) and keeps a value of the user's; it hands torchrun, and so every rank, one job token (HOSFL_JOB_TOKEN: a
  random one unless the user's) without printing it, and the job's store to rank 0.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import DEFAULT_OUT, Figure
from bench.suite import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_list_names_every_benchmark_with_its_figures_targets_and_floors():
    got = bench("list")
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    for b in BENCHMARKS.values():
        head = next(i for i, line in enumerate(lines) if line.startswith(f"{b.name} ("))
        assert lines[head + 1].strip() == " ".join(["python", "-m", b.module, *b.options])
        block = lines[head + 2 : head + 2 + len(b.figures)]
        for f, line in zip(b.figures, block):
            assert line.split()[0] == f.name and f.meaning in line
            assert f"target {f.target_text()}" in line
            assert ("floor measured" if isinstance(f.floor, str) else f"floor {f.floor_text()}") in line
        for how in {f.floor for f in b.figures if isinstance(f.floor, str)}:
            assert f"    floor measured: {how}" in lines
    assert {"zo_step", "zo_step_tuned", "zo_step_noise_cache", "gpu_zo_step", "gpu_zo_step_cuda_rng", "zo_step_batched",
            "gpu_zo_step_batched", "zo_step_compile", "gpu_zo_step_compile", "server_step", "server_loss", "memory",
            "agg_traffic", "dist", "elastic", "overlap", "threads", "cpu_hygiene", "checkpoint_cost", "generation",
            "scale", "peer"} == set(BENCHMARKS)  # fmt: skip
    for b in BENCHMARKS.values():
        assert (", needs a CUDA GPU)" in next(x for x in lines if x.startswith(f"{b.name} ("))) == b.gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_server_step_benchmark_stops_in_one_line_without_cuda_unless_asked_for_the_cpu(tmp_path):
    got = subprocess.run([sys.executable, "-m", "bench.server_step", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert got.returncode == 2 and "--device cuda: torch sees no CUDA device here" in got.stderr.splitlines()[-1]
    assert not (tmp_path / "server_step.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without CUDA")
def test_a_gpu_benchmark_is_skipped_without_cuda_and_the_run_goes_on(tmp_path):
    got = bench("run", "server_step", "agg_traffic", "--out", str(tmp_path), "--", "--widths", "16")
    assert got.returncode == 0, got.stderr
    assert "== server_step: skipped (it needs a CUDA device; torch sees none here)" in got.stdout
    assert "server_step: no record in" in got.stdout and not (tmp_path / "server_step.json").exists()
    assert json.loads((tmp_path / "agg_traffic.json").read_text())["error"] is None


@pytest.mark.slow  # about 40 s: three short runs of the quickstart
@pytest.mark.multiprocess
def test_the_elastic_benchmark_measures_the_three_runtimes_and_their_runs_agree(tmp_path):
    got = subprocess.run([sys.executable, "-m", "bench.elastic_bench", "--budget", "512", "--repeat", "1",
                          "--eval-samples", "200", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    record = json.loads((tmp_path / "elastic.json").read_text())
    figures = record["figures"]
    assert record["error"] is None
    for name in ("in_process_samples_per_s", "torchrun_samples_per_s", "elastic_samples_per_s", "elastic_vs_torchrun"):
        assert figures[name]["value"] > 0, name
    assert figures["same_final_metrics"]["value"] is True  # nothing drops: the three compute one run
    assert "elastic / torchrun:" in got.stdout


@pytest.mark.parametrize(
    ("target", "sense", "value", "met"),
    [(1.15, "<=", 1.2, False), (1.15, "<=", 1.15, True), (20, "=", 20.0, True), (20, "=", 24, False),
     (0.9, ">=", 0.95, True), (True, "=", False, False), (None, "<=", 3.0, None), (1.0, "<=", None, None)],
)  # fmt: skip
def test_met_compares_the_value_with_the_target_in_its_sense(target, sense, value, met):
    assert Figure("f", "x", "a figure", target, sense).met(value) is met


def test_run_writes_a_record_of_every_declared_figure(tmp_path):
    """agg_traffic at one width (two one-round runs): its two figures measured, the others null."""
    got = bench("run", "agg_traffic", "--out", str(tmp_path), "--", "--widths", "16")
    assert got.returncode == 0, got.stderr[-3000:]
    record = json.loads((tmp_path / "agg_traffic.json").read_text())
    assert record["command"] == f"python -m bench.agg_traffic --widths 16 --out {tmp_path}"
    assert record["via"] == f"python -m bench run agg_traffic --out {tmp_path} -- --widths 16"
    assert record["error"] is None and record["benchmark"] == "agg_traffic"
    assert len(record["load_average"]["before"]) == len(record["load_average"]["after"]) == 3
    declared = BENCHMARKS["agg_traffic"].figures
    assert list(record["figures"]) == [f.name for f in declared]
    for f in declared:
        fig = record["figures"][f.name]
        assert {"value", "unit", "target", "floor", "met"} <= set(fig)
        assert fig["unit"] == f.unit and fig["target"] == f.target and fig["met"] == f.met(fig["value"])
    measured = {k: v["value"] for k, v in record["figures"].items() if v["value"] is not None}
    assert measured == {"hosfl_dc160": 20, "sfl_dc160": 640}  # 4·P and 4·d_c bytes
    assert record["figures"]["hosfl_dc160"]["met"] is True and record["figures"]["hosfl_dc320"]["met"] is None
    assert "agg_traffic.hosfl_dc160: 20 B/client/round  target 20 met" in got.stdout
    table = bench("table", str(tmp_path)).stdout.splitlines()
    assert "| agg_traffic | hosfl_dc160 | 20 | B/client/round | = 20 |  | met |" in table
    assert "| agg_traffic | hosfl_dc320 | – | B/client/round | = 20 |  |  |" in table


def test_a_failed_benchmark_gets_a_record_saying_why_and_the_run_exits_1(tmp_path):
    got = bench("run", "agg_traffic", "--out", str(tmp_path), "--", "--widths", "wide")
    assert got.returncode == 1
    record = json.loads((tmp_path / "agg_traffic.json").read_text())
    assert record["error"].startswith("exit 2: ") and "invalid int value: 'wide'" in record["error"]
    assert all(f["value"] is None and f["met"] is None for f in record["figures"].values())
    assert "FAILED (exit 2" in got.stdout


def test_run_refuses_a_name_outside_the_suite_and_names_the_suite():
    got = bench("run", "nosuch")
    assert got.returncode == 2 and "no benchmark nosuch: the suite has zo_step, zo_step_tuned" in got.stderr


def test_records_go_to_an_untracked_folder_by_default():
    assert DEFAULT_OUT == ROOT / "bench" / "out"
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "bench/out/zo_step.json"], cwd=ROOT)
        assert ignored.returncode == 0, "bench/out/ must be ignored by git"


def test_every_declared_module_measures_and_names_its_figures_without_editing_sys_path():
    """Each benchmark's module exists with main() and figures(); no file of bench/ edits sys.path."""
    for b in BENCHMARKS.values():
        path = ROOT / (b.module.replace(".", "/") + ".py")
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        assert {"main", "figures"} <= defined, path
    for path in (ROOT / "bench").glob("*.py"):
        assert "sys.path" not in path.read_text(), path


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


@pytest.mark.parametrize("user_token", [None, "u" * 40])
def test_torchrun_sh_hands_every_rank_one_token_and_prints_it_nowhere(tmp_path, user_token):
    """The stand-in python records the token each call sees; torchrun passes its environment to every rank."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/bin/sh\necho "$HOSFL_JOB_TOKEN $TORCH_DISABLE_SHARE_RDZV_TCP_STORE $1 $2" >> {log}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HOSFL_JOB_TOKEN", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env.update(VENV=str(venv), NPROC="3")
    if user_token is not None:
        env["HOSFL_JOB_TOKEN"] = user_token
    runs = [
        subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    lines = log.read_text().splitlines()
    assert len(lines) == 4 and all(r.returncode == 0 for r in runs)
    launches = [line.split() for line in lines if "torch.distributed.run" in line]
    assert [store for _, store, *_ in launches] == ["1", "1"]  # the job's store on rank 0, on loopback
    tokens = [token for token, *_ in launches]
    if user_token is None:  # each job its own, 256 random bits
        assert all(len(t) == 64 and int(t, 16) >= 0 for t in tokens) and tokens[0] != tokens[1]
    else:
        assert tokens == [user_token, user_token]
    assert not any(t in r.stdout + r.stderr for t in tokens for r in runs)
