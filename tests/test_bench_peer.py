"""``bench/peer.py`` at a tiny size: hosfl_dist's round beside the reference loop written there (not the authors'
code), both figures and their ratio in the record; the authors' code measured only when a command for it is given,
and one line saying so when not; the reference loop trains the same shapes as hosfl_dist's model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.peer import CONFIG, NOT_MEASURED, REFERENCE, ReferenceLoop, medians, run_authors, same_model
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


def test_the_authors_figure_is_the_rate_it_printed_over_its_rounds_and_the_samples_it_processed_over_its_process(
    tmp_path,
):
    printed = run_authors(f"{sys.executable} -c 'print(\"epoch 1: 12.5 samples/s\")'", str(tmp_path), None, 60)
    assert printed["samples_per_s"] == 12.5 and printed["process"] is None  # its rounds' rate: no process figure
    counted = run_authors("true", str(tmp_path), 1000, 60)
    assert counted["samples_per_s"] is None  # its whole process: no rounds figure
    assert counted["process"]["samples_per_s"] == pytest.approx(1000 / counted["wall_s"])
    both = run_authors(f"{sys.executable} -c 'print(\"12.5 samples/s\")'", str(tmp_path), 1000, 60)
    assert both["samples_per_s"] == 12.5 and both["process"]["samples"] == 1000
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
    whole = turn["ours"]["process"]["samples_per_s"] / turn["reference"]["process"]["samples_per_s"]
    assert figures["ours_vs_reference_process"] == pytest.approx(whole, rel=1e-5)
    for w in ("ours", "reference"):  # every round's samples (K·B each) over the process's wall time
        process = turn[w]["process"]
        assert process["samples"] == 2 * 2 * 2 and process["samples_per_s"] == pytest.approx(8 / process["wall_s"])
    assert len(turn["reference"]["accuracy"]) == 2  # evaluated where ours is: before the first round, after the last
    assert "whole process against whole process" in got.stdout
    assert figures["authors_samples_per_s"] is None and figures["ours_vs_authors"] is None
    assert figures["ours_vs_authors_process"] is None
    assert record["figures"]["ours_vs_authors"]["met"] is None and figures["same_model"] is True
    assert record["data"]["authors"] == NOT_MEASURED
    assert len(turn["reference"]["losses"]) == 2 and all(loss == loss for loss in turn["reference"]["losses"])


def test_a_ratio_divides_a_span_by_the_same_span_and_only_where_both_sides_have_it():
    """Rounds against rounds, whole process against whole process: the authors' whole process is never the
    denominator of our rounds' rate (nor the other way round)."""
    def way(rounds, process, cpu=None):
        return {"samples_per_s": rounds, "samples_per_cpu_s": cpu,
                "process": None if process is None else {"samples_per_s": process, "samples_per_cpu_s": None}}

    turns = [{"ours": way(200.0, 100.0, 210.0), "reference": way(160.0, 90.0, 150.0), "authors": way(None, 50.0)},
             {"ours": way(180.0, 90.0, 190.0), "reference": way(180.0, 90.0, 190.0), "authors": way(None, 60.0)}]
    med = medians(turns, ["ours", "reference", "authors"])
    assert med["ours_vs_reference"] == pytest.approx((200 / 160 + 1) / 2)
    assert med["ours_vs_reference_cpu"] == pytest.approx((210 / 150 + 1) / 2)
    assert med["ours_vs_reference_process"] == pytest.approx((100 / 90 + 1) / 2)
    assert med["ours_vs_authors_process"] == pytest.approx((2 + 1.5) / 2) and med["authors_process"] == 55.0
    assert "ours_vs_authors" not in med and "authors" not in med  # no rounds figure of theirs: no rounds ratio
    assert "ours_vs_reference_process_cpu" not in med  # not measured on one side
