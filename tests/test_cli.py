"""The command line: one-line errors for bad input (no traceback wall), dry runs, and a short real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hosfl_dist.run", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["data.name=fashion_mnist", "data.root=/nonexistent/fmnist"], "data.root /nonexistent/fmnist does not exist"),
        (["model.name=resnet99"], "model.name: 'resnet99'"),
        (["zo.bogus=1"], "unknown key zo.bogus in section zo"),
        (["clients.per_round=0"], "clients.per_round: 0"),
        (["data.name=cifar10_npz", "data.root=/nonexistent/c10"], "CIFAR-10 npz not found"),
        (["--config", "configs/missing.yaml"], "config file not found"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, needle):
    res = cli("--dry-run", *args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.stderr


def test_dry_run_prints_resolved_config_and_builds():
    res = cli("--dry-run", "--config", "configs/quickstart.yaml", "zo.num_perturbations=8", "data.name=synthetic")
    assert res.returncode == 0, res.stderr
    assert "num_perturbations: 8" in res.stdout
    built = json.loads(res.stdout.split("# built:", 1)[1])
    assert built["client_trainable_params"] > 0 and built["server_trainable_params"] > 0


def test_short_run_writes_outputs(tmp_path, tiny_overrides):
    res = cli(*tiny_overrides)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "run"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"round", "processed_samples", "eval_accuracy", "train_loss", "comm"} <= set(rows[-1])
    assert rows[-1]["processed_samples"] == 240
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["processed_samples"] == 240
    assert (out / "config.yaml").is_file()
    server = summary["transport"]["server"]  # in one process too: the server's calls and compute per method
    assert server["calls"]["submit"] == summary["rounds"] and server["compute_s"]["submit"] > 0
    assert server["threads"] == 1


def test_a_bad_config_fails_before_torch_is_imported():
    """A typo is reported at once, not after the seconds (tens under load) that importing torch takes."""
    code = (
        "import sys; from hosfl_dist.run import main; rc = main(['zo.bogus=1', 'clients.total=0']); "
        "print(rc, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr.startswith("error: 2 errors in the config: (1) unknown key zo.bogus in section zo")
    assert "; (2) invalid value for clients.total: 0 (must be >= 1)" in done.stderr  # both at once, on one line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CUDA config on a machine without CUDA")
def test_a_cuda_config_dry_runs_on_a_cpu_node_and_its_check_refuses_in_one_line(tiny_overrides, capsys):
    """A GPU job resolved on a login node: --dry-run builds it on the CPU; --check says the node has no CUDA."""
    from hosfl_dist.run import main

    assert main([*tiny_overrides, "job.device=cuda", "--dry-run"]) == 0
    assert '"client_params"' in capsys.readouterr().out
    assert main([*tiny_overrides, "job.device=cuda", "--check"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: job.device=cuda but this machine has no CUDA device (torch.cuda.is_available() is False)"
    )
