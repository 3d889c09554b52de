"""frozen_client, HO-SFL with the client frozen: the server's trajectory is HO-SFL's with a client learning rate of 0,
bit for bit; only the activations go up; checkpoints resume exactly; torchrun equals the in-process run; the
experiment commands take it as a method."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.config import load_config
from hosfl_dist.errors import Interrupted
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.transport.wire import PAPER_CATEGORIES, UPLINK_ACTIVATIONS
from tiny import (
    TINY_OVERRIDES,
    assert_same_as,
    lm_overrides,
    read_run,
    rows_of,
    run_in_process,
    run_one_thread,
    stop_at,
    torchrun,
    write_text_files,
)

SHARED = ("round", "processed_samples", "eval_accuracy", "eval_loss", "train_loss", "best_eval_accuracy")
"""Metrics-row fields that depend on the server's trajectory and θc only (not on the traffic or the time)."""


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


SETTINGS = {  # a setting's overrides for a run in folder ``out``
    "vision": lambda out: [*TINY_OVERRIDES, f"job.out_dir={out}"],
    "tiny_llama": lambda out: lm_overrides(out / "run", write_text_files(_folder(out))),
}


def hosfl_with_client_lr_0(overrides: list[str]) -> InProcessRunner:
    """HO-SFL with clients.optim.lr = 0: the config refuses 0 (a run that trains nothing is a mistake), so it is set
    after validation. AdamW and SGD then leave every θc replica unchanged: θ·(1 − 0·wd) + (−0)·update = θ."""
    cfg = load_config(None, [*overrides, "algorithm.name=hosfl"])
    cfg.clients.optim.lr = 0.0
    runner = InProcessRunner(cfg).setup()
    runner.run()
    return runner


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def pair(request, tmp_path_factory):
    """(HO-SFL with client lr 0, frozen_client) on one setting: (runner, summary, rows) each."""
    make = SETTINGS[request.param]
    h = hosfl_with_client_lr_0(make(tmp_path_factory.mktemp("hosfl")))
    _, f_runner, f_summary, f_rows = run_in_process([*make(tmp_path_factory.mktemp("frozen")),
                                                         "algorithm.name=frozen_client"])  # fmt: skip
    h_rows, h_summary = read_run(Path(h.cfg.job.out_dir))
    return (h, h_summary, h_rows), (f_runner, f_summary, f_rows)


def test_the_server_trajectory_is_hosfl_with_client_lr_0_bit_for_bit(pair):
    (h, h_summary, h_rows), (f, f_summary, f_rows) = pair
    for key in ("rounds", "processed_samples"):
        assert f_summary[key] == h_summary[key]
    assert [{k: r.get(k) for k in SHARED} for r in f_rows] == [{k: r.get(k) for k in SHARED} for r in h_rows]
    assert f_summary["server_digest"] == h_summary["server_digest"]  # θs: the same updates from the same batches
    theta_c0 = f.server.client_params_at(f_summary["rounds"])
    for p, q in zip(h.server.client_params_at(h_summary["rounds"]), theta_c0, strict=True):
        assert torch.equal(p, q)  # HO-SFL's replicas did not move at lr 0: the client stayed at θc^0 there too
    assert f_summary["status"] == "completed" and len(set(f_summary["client_digests"].values())) == 1


def test_only_the_activations_go_up(pair):
    (_, h_summary, _), (_, f_summary, f_rows) = pair
    b = f_summary["comm"]["bytes"]
    assert {c for c in PAPER_CATEGORIES if b[c] > 0} == {UPLINK_ACTIVATIONS}
    assert b[UPLINK_ACTIVATIONS] == h_summary["comm"]["bytes"][UPLINK_ACTIVATIONS]  # the same z, the same dtype
    assert b["control"] == 0 and b["eval"] > 0  # no round reports; evaluation batches only
    assert f_summary["comm"]["training_total_bytes"] == b[UPLINK_ACTIVATIONS]
    assert get_algorithm("frozen_client").traffic == {UPLINK_ACTIVATIONS}


SMALL = [*TINY_OVERRIDES, "data.train_max_samples=240", "train.budget_samples=360", "checkpoint.interval_samples=120"]


@pytest.mark.parametrize("extra", [[], ["server.optim.schedule=cosine", "server.optim.warmup_rounds=2"]],
                         ids=["constant", "server-schedule"])  # fmt: skip
def test_resume_after_a_stop_is_bit_identical(tmp_path, monkeypatch, extra):
    """As tests/test_faults.py checks every other method: SIGTERM mid-run, then job.resume=auto finishes the run with
    the uninterrupted run's rows, digests and traffic (the server's schedule included: it is HO-SFL's)."""
    cfg = [*SMALL, "algorithm.name=frozen_client", *extra]
    _, _, ref, _ = run_in_process([*cfg, f"job.out_dir={tmp_path / 'ref'}"])
    out = tmp_path / "run"
    stop_at(monkeypatch, "frozen_client", 1)
    with pytest.raises(Interrupted, match=r"SIGTERM after round 2; checkpoint .*round-00000002"):
        run_in_process([*cfg, f"job.out_dir={out}"])
    monkeypatch.undo()
    _, _, got, _ = run_in_process([*cfg, f"job.out_dir={out}", "job.resume=auto"])
    assert rows_of(out) == rows_of(tmp_path / "ref")
    assert got["client_digests"] == ref["client_digests"] and got["server_digest"] == ref["server_digest"]
    assert got["comm"] == ref["comm"] and got["resumed_from"].endswith("round-00000002")


@pytest.mark.slow  # 8 s: compare itself is in tests/test_experiments.py
def test_compare_adds_it_as_a_row(tmp_path, capsys):
    from hosfl_dist.experiments.compare import main

    out = tmp_path / "cmp"
    assert main(["--config", "configs/quickstart.yaml", "--methods", "hosfl,frozen_client", "--out", str(out),
                 *TINY_OVERRIDES]) == 0  # fmt: skip
    table = json.loads((out / "table.json").read_text())
    rows = {r["variant"]: r for r in table["rows"]}
    assert set(rows) == {"hosfl", "frozen_client"}
    assert rows["frozen_client"]["processed_samples"] == rows["hosfl"]["processed_samples"]
    assert rows["frozen_client"]["training_total_bytes"] < rows["hosfl"]["training_total_bytes"]


# -- torchrun ----------------------------------------------------------------------------------------------------------
TORCHRUN = [*TINY_OVERRIDES, "server.rpc_timeout_s=60", "algorithm.name=frozen_client"]


@pytest.mark.multiprocess
def test_torchrun_equals_in_process(tmp_path):
    """1 server + 2 client workers against the in-process run with one intra-op thread: every metrics row, both
    digests and the traffic, bit for bit."""
    ref_rows, ref = run_one_thread([*TORCHRUN, f"job.out_dir={tmp_path / 'ref'}"])
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *TORCHRUN, f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    rows, summary = read_run(tmp_path / "run")
    assert summary["status"] == "completed" and summary["engine"] == "torchrun"
    assert rows == ref_rows and summary["comm"] == ref["comm"]
    assert summary["server_digest"] == ref["server_digest"]
    assert set(summary["client_digests"]) == {"worker_1", "worker_2"}
    assert set(summary["client_digests"].values()) == set(ref["client_digests"].values())


@pytest.mark.multiprocess
@pytest.mark.slow  # two launches, about 40 s
def test_torchrun_sigterm_checkpoints_and_a_resume_finishes_identically(tmp_path, monkeypatch):
    """tests/test_restart.py's fault for this method: SIGTERM to the launcher at round 5 of 10, then the same command
    with job.resume=auto."""
    from test_restart import launch

    rc, out, _ = launch(tmp_path, monkeypatch, "term:5", "frozen_client")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert rc != 0 and summary["status"] == "interrupted", (summary, out[-3000:])
    checkpoint = Path(summary["checkpoint"]).name
    rc, out, _ = launch(tmp_path, monkeypatch, "term:5", "frozen_client", extra=["job.resume=auto"])
    assert rc == 0, out[-3000:]
    ref = run_one_thread([*TORCHRUN, "checkpoint.interval_samples=48", f"job.out_dir={tmp_path / 'ref'}"])
    summary = assert_same_as(tmp_path / "run", copy.deepcopy(ref))
    assert summary["resumed_from"].endswith(checkpoint)
