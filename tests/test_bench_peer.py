"""``bench/peer.py`` at a tiny size: hosfl_dist's round beside the reference loop written there (not the authors'
code), both figures and their ratio in the record; the authors' code measured only when a command for it is given,
and one line saying so when not; the reference loop trains the same shapes as hosfl_dist's model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.peer import CONFIG, NOT_MEASURED, REFERENCE, ReferenceLoop, run_authors, same_model
from hosfl_dist.config import load_config
from tiny import ROOT

TINY = ["clients.total=4", "clients.per_round=2", "clients.batch_size=2", "zo.num_perturbations=2"]


def test_the_reference_loop_trains_both_sides_with_finite_losses_on_hosfl_dists_shapes():
    cfg = load_config(CONFIG, TINY)
    loop = ReferenceLoop.build(cfg)
    client = [p.detach().clone() for p in loop.client.parameters() if p.requires_grad]
    server = [p.detach().clone() for p in loop.server.parameters() if p.requires_grad]
    losses = [loop.round() for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses)))
    after_c = [p for p in loop.client.parameters() if p.requires_grad]
    after_s = [p for p in loop.server.parameters() if p.requires_grad]
    assert all(not torch.equal(a, b) for a, b in zip(client, after_c))  # every client tensor stepped from ĝ_c
    assert all(not torch.equal(a, b) for a, b in zip(server, after_s))
    assert same_model(cfg, loop)
    assert sum(p.numel() for p in after_c) == 681_152  # ResNet-18's stem and stages 1-2, BatchNorm frozen


def test_the_authors_figure_is_the_samples_their_command_processed_or_the_rate_it_printed(tmp_path):
    printed = run_authors(f"{sys.executable} -c 'print(\"epoch 1: 12.5 samples/s\")'", str(tmp_path), None, 60)
    assert printed["samples_per_s"] == 12.5
    counted = run_authors("true", str(tmp_path), 1000, 60)
    assert counted["samples_per_s"] == pytest.approx(1000 / counted["wall_s"])
    with pytest.raises(RuntimeError, match="printed no samples/s"):
        run_authors("echo done", str(tmp_path), None, 60)
    with pytest.raises(RuntimeError, match="exited 3"):
        run_authors("exit 3", str(tmp_path), None, 60)


@pytest.mark.slow  # two ResNet-18 runs in a subprocess: ~12 s on 2 shared cores
def test_one_invocation_records_ours_the_reference_and_their_ratio_and_says_the_authors_code_was_not_measured(tmp_path):
    cmd = [sys.executable, "-m", "bench.peer", "--rounds", "2", "--warmup", "1", "--repeat", "1", *TINY,
           "--out", str(tmp_path)]  # fmt: skip
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert NOT_MEASURED in got.stdout and f"reference ({REFERENCE})" in got.stdout
    record = json.loads((tmp_path / "peer.json").read_text())
    figures = {k: v["value"] for k, v in record["figures"].items()}
    assert figures["ours_samples_per_s"] > 0 and figures["reference_samples_per_s"] > 0
    turn = record["data"]["turns"][0]
    ratio = turn["ours"]["samples_per_s"] / turn["reference"]["samples_per_s"]
    assert figures["ours_vs_reference"] == pytest.approx(ratio, rel=1e-5)
    cpu = turn["ours"]["samples_per_cpu_s"] / turn["reference"]["samples_per_cpu_s"]
    assert figures["ours_vs_reference_cpu"] == pytest.approx(cpu, rel=1e-5)
    assert figures["authors_samples_per_s"] is None and figures["ours_vs_authors"] is None
    assert record["figures"]["ours_vs_authors"]["met"] is None and figures["same_model"] is True
    assert record["data"]["authors"] == NOT_MEASURED
    assert len(turn["reference"]["losses"]) == 2 and all(loss == loss for loss in turn["reference"]["losses"])
