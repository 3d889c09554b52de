"""Bad input run as a user runs it: ``python -m hosfl_dist.run …`` or ``bash launch/torchrun.sh …`` prints exactly one
line, ``error: …`` naming the key or file and what is wrong with it, and exits with status 2: no traceback, no
warning, and under launch/torchrun.sh no torchrun started (it checks the input first).

tests/test_faults.py checks other refusals through ``main()`` inside the test process (an unusable job.out_dir, a
folder holding a run, broken data files, job.device=cuda without a GPU, ``--check``); this file covers the values
the config refuses and one broken data file (the error raised after torch and the data code are imported) through a
fresh interpreter, so what the user sees — imports, warnings, the exit status — is part of what is checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import ROOT, TINY_OVERRIDES

FASHION = Path("/usr/share/datasets/fashion-mnist")


def user_run(argv: list[str], launcher: str = "python") -> tuple[int, list[str]]:
    """The exit status and the lines printed (stdout and stderr together)."""
    if launcher == "python":
        cmd = [sys.executable, "-m", "hosfl_dist.run", *argv]
        env = None
    else:  # launch/torchrun.sh with this interpreter's environment (VENV) and three processes
        cmd = ["bash", "launch/torchrun.sh", *argv]
        env = {**os.environ, "VENV": sys.prefix, "NPROC": "3"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, (p.stdout + p.stderr).strip().splitlines()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["job.out_dir="], "error: invalid value for job.out_dir: None (expected a string)"),
        (["zo.rng_device=foo"], "error: invalid value for zo.rng_device: 'foo' (use cpu or cuda)"),
        (["zo.num_perturbations=100000"], "error: invalid value for zo.num_perturbations: 100000 (must be in "
                                          "1..10000 (perturbed forwards per client per round))"),
        (["job.seed=-1"], "error: invalid value for job.seed: -1 (must be >= 0)"),
        (["zo.mu=inf"], "error: invalid value for zo.mu: inf (must be a finite perturbation scale in [1e-09, 1]; "
                        "below it θ + μu rounds to θ in float32 and every scalar is 0)"),
        (["zo.mu=1e-30"], "error: invalid value for zo.mu: 1e-30 (must be a finite perturbation scale in [1e-09, 1];"
                          " below it θ + μu rounds to θ in float32 and every scalar is 0)"),
        (["clients.optim.lr=nan"], "error: invalid value for clients.optim.lr: nan (must be a finite number > 0)"),
    ],
    ids=["out_dir-empty", "rng_device", "P-too-large", "seed-negative", "mu-inf", "mu-tiny", "lr-nan"],
)  # fmt: skip
def test_a_refused_value_is_one_line_and_exit_2(tmp_path, args, line):
    assert user_run([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'run'}", *args]) == (2, [line])
    assert not (tmp_path / "run").exists()


def test_a_config_file_that_is_not_yaml_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job:\n  name: [unclosed\n")
    rc, lines = user_run(["--config", str(bad)])
    assert rc == 2 and lines == [
        f"error: config file {bad} is not valid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>'"
    ]


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"{FASHION} (Debian dataset-fashion-mnist) is not installed")
def test_a_truncated_data_file_is_one_line_and_exit_2(tmp_path):
    root = tmp_path / "fashion"
    shutil.copytree(FASHION, root)
    images = root / "t10k-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:5000])
    rc, lines = user_run(["--config", "configs/quickstart.yaml", f"data.root={root}", "train.budget_samples=128",
                          "job.progress=false", f"job.out_dir={tmp_path / 'run'}"])  # fmt: skip
    assert rc == 2 and lines == [
        f"error: {images}: cannot be read (Compressed file ended before the end-of-stream marker was reached)"
    ]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["server.rpc_timeout_s=inf"], "error: invalid value for server.rpc_timeout_s: inf (must be between 1 s and "
                                       "a week: every wait on a peer is bounded by a timeout)"),
        (["server.rpc_timeout_s=1e-9"], "error: invalid value for server.rpc_timeout_s: 1e-09 (must be between 1 s "
                                        "and a week: every wait on a peer is bounded by a timeout)"),
        (["zo.num_perturbations=0"], "error: invalid value for zo.num_perturbations: 0 (must be in 1..10000 "
                                     "(perturbed forwards per client per round))"),
        (["job.interface=nosuch0"], "error: job.interface=nosuch0: this node has no such interface (it has "),
    ],
    ids=["rpc_timeout-inf", "rpc_timeout-tiny", "P-zero", "interface"],
)  # fmt: skip
def test_launch_script_refuses_bad_input_in_one_line_before_torchrun_starts(tmp_path, args, line):
    """These values used to pass the launcher and fail in every process torchrun had started."""
    rc, lines = user_run([*args, f"job.out_dir={tmp_path / 'run'}"], launcher="torchrun.sh")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(line), lines
    assert not (tmp_path / "run").exists()
