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


def test_status_of_a_path_that_is_no_folder_is_one_line_and_exit_2(tmp_path, capsys):
    from hosfl_dist.run import main

    for path, why in ((tmp_path / "missing", "no such folder"), (ROOT / "README.md", "not a folder")):
        assert main(["--status", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [f"error: --status {path}: {why} (give a run's folder: job.out_dir, "
                                                  "or runs/<job.name>/latest)"]  # fmt: skip
    assert main(["--status", str(tmp_path)]) == 0  # a folder without a run: said, not refused
    assert capsys.readouterr().out.strip() == f"{tmp_path}: holds no run"


def help_examples(module: str) -> list[list[str]]:
    """The commands ``python -m MODULE --help`` ends with: each example's words after ``-m MODULE`` (a line ending in
    a backslash goes on on the next; a comment ends it)."""
    import shlex

    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout.split("\nexamples:\n", 1)[1].split("\n\n")[0].replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if f"hosfl_dist.{module.split('.')[-1]}" in words or module in words:
            commands.append(words[words.index("-m") + 2 :] if words[words.index("-m") + 1] == module else [])
    return [c for c in commands if c]


@pytest.mark.parametrize(
    "module",
    ["hosfl_dist.run", "hosfl_dist.export", "hosfl_dist.predict", "hosfl_dist.experiments.compare",
     "hosfl_dist.experiments.sweep"],
)  # fmt: skip
def test_help_ends_with_examples_that_parse_and_name_real_keys(module):
    """Every example in ``--help`` is a command its parser takes, with config keys and files that exist."""
    import importlib

    from hosfl_dist.config import load_config

    examples = help_examples(module)
    assert len(examples) >= 3, examples
    parse_args = importlib.import_module({"hosfl_dist.run": "hosfl_dist.cli.run", "hosfl_dist.predict":
                                          "hosfl_dist.cli.predict", "hosfl_dist.export": "hosfl_dist.export.cli"}
                                         .get(module, module)).parse_args  # fmt: skip
    for argv in examples:
        args = parse_args(argv)
        config = getattr(args, "config", None)
        if config is not None:
            assert (ROOT / config).is_file(), argv
        overrides = [*getattr(args, "sets", []), *getattr(args, "overrides", []),
                     *(o.partition(":")[2] for o in getattr(args, "method_set", []))]  # fmt: skip
        overrides += [g.split(",")[0] for g in getattr(args, "grid", None) or []]
        load_config(ROOT / config if config else None, overrides)  # every key named exists
