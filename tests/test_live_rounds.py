"""Live rounds (docs/participation.md#live-rounds): the round gate at the server's endpoint decides who takes part
from who answers in time, and every method's own round runs over it unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from hosfl_dist.config import load_config
from hosfl_dist.errors import ProtocolError
from hosfl_dist.runtime import build
from hosfl_dist.runtime.gate import FixedMembers
from hosfl_dist.runtime.inprocess import InProcessRunner
from tiny import TINY_OVERRIDES, read_run, run_in_process, run_one_thread, torchrun

METHODS = ["hosfl", "frozen_client", "sfl", "fsl_sage", "zo_sfl", "mu_splitfed"]


def live_runner(overrides: list[str]) -> InProcessRunner:
    """An in-process runner whose one worker (hosting every client) opens and closes its rounds at a round gate."""
    r = InProcessRunner(load_config(None, overrides)).setup()
    gate = build.round_gate(r.cfg, r.server, r.endpoint, FixedMembers({0: range(r.cfg.clients.total)}), True)
    gate.start_at(0)
    draw = build.round_plan(r.cfg).participation
    r.worker.rounds = build.worker_rounds(r.cfg, r.worker.transport, r.meter, lambda t: tuple(draw.sampled(t)), True)
    return r


@pytest.mark.parametrize("method", METHODS)
def test_a_round_decided_at_the_gate_is_the_planned_round_when_every_client_answers(tmp_path, method):
    """Every sampled client arrives (no timeout, no over-selection): the gate decides what the plan draws, so the run
    is the planned run bit for bit, with the same traffic but for the leader's finish_round report (control)."""
    overrides = [*TINY_OVERRIDES, f"algorithm.name={method}"]
    _, _, planned, _ = run_in_process([*overrides, f"job.out_dir={tmp_path / 'planned'}"])
    live = live_runner([*overrides, f"job.out_dir={tmp_path / 'live'}"]).run()
    assert live["client_digests"] == planned["client_digests"] and live["server_digest"] == planned["server_digest"]
    assert {k: v for k, v in live["comm"]["bytes"].items() if k != "control"} == \
        {k: v for k, v in planned["comm"]["bytes"].items() if k != "control"}  # fmt: skip
    assert [json.loads(x) for x in (tmp_path / "live" / "participation.jsonl").read_text().splitlines()] == \
        [json.loads(x) for x in (tmp_path / "planned" / "participation.jsonl").read_text().splitlines()]  # fmt: skip


def test_over_selection_in_one_process_counts_the_first_arrivals_and_the_record_replays(tmp_path):
    """Over-selection at the gate: the first K uploads to arrive count (here the worker's send order), the others are
    late, their batches put back; the record replays in one process to the same digests."""
    overrides = [*TINY_OVERRIDES, "clients.over_select=0.5"]
    live = live_runner([*overrides, f"job.out_dir={tmp_path / 'live'}"]).run()
    assert live["participation"]["late"] > 0
    record = tmp_path / "live" / "participation.jsonl"
    _, _, replay, _ = run_in_process([*overrides, f"clients.participation={record}", f"job.out_dir={tmp_path / 'r'}"])
    assert replay["client_digests"]["worker_0"] == live["client_digests"]["worker_0"]
    assert replay["server_digest"] == live["server_digest"]


def test_the_gate_refuses_a_contribution_that_does_not_fit_in_one_line(tmp_path):
    r = live_runner([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'x'}"])
    r.front.open()
    gate = r.endpoint.gate
    for rows, said in (({0: torch.zeros(3)}, "before the round's uploads were decided"),
                       ({"x": torch.zeros(3)}, "a client id must be an integer")):  # fmt: skip
        with pytest.raises(ProtocolError, match=said):
            gate.close({"t": 0, "rows": rows}, None).wait()
    with pytest.raises(ProtocolError, match="must be an integer"):
        gate.close({"t": "0", "rows": {}}, None).wait()
    with pytest.raises(ProtocolError, match="ahead of the run"):
        gate.arrive("submit", {"t": 9, "client": 0}, None, lambda kw: None).wait()
    r.front.close()


def test_a_catch_up_from_a_round_behind_or_past_the_servers_is_refused(tmp_path):
    r = InProcessRunner(load_config(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'x'}"])).setup()
    server = r.server
    for since in (-7, 2**40, "3", True):
        with pytest.raises(ProtocolError, match=r"reports its replica at round"):
            server._window(0, server.round_plan.sampled(0)[0], since)


@pytest.mark.multiprocess
def test_torchrun_with_a_round_timeout_and_over_selection_replays_in_one_process(tmp_path):
    """server.round_timeout_s under torchrun: rounds decided live by real arrivals (over-selection counts the first
    uploads to arrive); the job completes and its participation.jsonl replays in one process to its digests."""
    live = [*TINY_OVERRIDES, "clients.over_select=0.5", "server.min_clients=2"]
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *live, "server.round_timeout_s=5",
                              f"job.out_dir={tmp_path / 'run'}"])  # fmt: skip
    assert rc == 0, out[-4000:]
    _, summary = read_run(tmp_path / "run")
    assert summary["status"] == "completed" and summary["participation"]["late"] + summary["participation"]["dropped"]
    _, replay = run_one_thread([*live, f"clients.participation={tmp_path / 'run' / 'participation.jsonl'}",
                                f"job.out_dir={tmp_path / 'replay'}"])  # fmt: skip
    assert set(replay["client_digests"].values()) == set(summary["client_digests"].values())
    assert replay["server_digest"] == summary["server_digest"]
