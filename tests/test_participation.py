"""Participation (docs/participation.md): the seeded plan of who is sampled, dropped, late, counted and delivers; what
each stage of a drop does to HO-SFL's server step and to v̄; skipped rounds; the records (participation.jsonl, the
metrics rows' participants, summary.json's participation) and their replay; the baselines; refusals in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hosfl_dist import algorithms
from hosfl_dist.algorithms import AlgorithmSpec, algorithm_names, get_algorithm
from hosfl_dist.algorithms import hosfl as hosfl_mod
from hosfl_dist.algorithms.participation import AFTER_UPLOAD, BEFORE_UPLOAD, ParticipationPlan
from hosfl_dist.config import load_config
from hosfl_dist.core.seeding import sample_clients
from hosfl_dist.errors import ConfigError
from hosfl_dist.run import main
from hosfl_dist.runfolder.identity import comparable_config
from hosfl_dist.runtime.build import round_plan
from hosfl_dist.runtime.checks import load_run_config
from hosfl_dist.runtime.server_compute import GroupCompute
from tiny import TINY_OVERRIDES, read_run, run_in_process

DROPPING = ["clients.dropout=0.3", "clients.dropout_stage=mixed", "clients.over_select=0.5", "server.min_clients=1"]
"""Every kind of round at once: drops at both stages, late clients, rounds skipped or not."""


def plan_of(*overrides: str) -> ParticipationPlan:
    return round_plan(load_config(None, [*TINY_OVERRIDES, *overrides])).participation


# -- the plan ------------------------------------------------------------------------------------------------------
def test_without_dropout_or_over_selection_every_round_is_the_k_clients_drawn_before():
    plan, cfg = plan_of(), load_config(None, TINY_OVERRIDES)
    assert not plan.emulated
    for t in range(50):
        p = plan.round(t)
        assert list(p.sampled) == sample_clients(cfg.job.seed, t, 6, 3) == list(p.counted) == list(p.delivered)
        assert p.complete and not p.dropped and not p.late


def test_drops_are_drawn_per_client_and_round_and_move_no_other_draw():
    plans = [plan_of(f"clients.dropout={q}") for q in (0.0, 0.3, 0.6)]
    rounds = range(400)
    for t in rounds:  # the sample is the same draw; a client dropped at 0.3 is dropped at 0.6 (one uniform per client)
        assert plans[0].round(t).sampled == plans[1].round(t).sampled == plans[2].round(t).sampled
        assert set(plans[1].round(t).dropped) <= set(plans[2].round(t).dropped)
    rate = sum(len(plans[1].round(t).dropped) for t in rounds) / (3 * len(rounds))
    assert abs(rate - 0.3) < 0.05
    assert all(s == BEFORE_UPLOAD for t in rounds for s in plans[1].round(t).dropped.values())
    mixed = plan_of("clients.dropout=0.3", "clients.dropout_stage=mixed")
    stages = [s for t in rounds for s in mixed.round(t).dropped.values()]
    assert 0.35 < stages.count(AFTER_UPLOAD) / len(stages) < 0.65


def test_over_selection_samples_more_and_counts_the_first_k_arrivals():
    plan = plan_of("clients.over_select=0.5")  # ⌈3·1.5⌉ = 5 of 6
    for t in range(30):
        p = plan.round(t)
        assert len(p.sampled) == 5 and len(p.counted) == 3 and len(p.late) == 2
        assert sorted(p.arrived[:3]) == list(p.counted) and sorted(p.arrived[3:]) == list(p.late)
    assert plan_of("clients.per_round=10", "clients.total=20", "clients.over_select=0.1").size == 11


def test_a_round_with_fewer_uploads_than_min_clients_is_skipped():
    plan = plan_of("clients.dropout=0.5")  # server.min_clients = K = 3: any drop before upload skips the round
    for t in range(100):
        p = plan.round(t)
        assert p.skipped == bool(p.dropped)
        assert not p.skipped or (p.counted == () and p.delivered == () and p.late == ())


# -- HO-SFL: each stage's effect --------------------------------------------------------------------------------------
def forced(tmp_path: Path, fates: dict[int, dict[int, str]], *overrides: str) -> list[str]:
    """A participation.jsonl where round t drops the clients ``fates[t]`` maps to a stage (the others deliver), and the
    overrides that replay it."""
    cfg = load_config(None, [*TINY_OVERRIDES, *overrides])
    plan = round_plan(cfg).participation
    lines = []
    for t in range(40):
        sampled = list(plan.round(t).sampled)
        drops = {sampled[i]: s for i, s in fates.get(t, {}).items()}
        arrived = [m for m in sampled if drops.get(m) != BEFORE_UPLOAD]
        lines.append(json.dumps(plan.settle(t, sampled, arrived, drops).record()))
    path = tmp_path / "forced.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return [*overrides, f"clients.participation={path}"]


def spy_round_0(monkeypatch) -> dict[str, list]:
    """What round 0's server step and scalar aggregation see."""
    seen: dict[str, list] = {"uploads": [], "rows": []}
    fb, mean = GroupCompute.forward_backward, hosfl_mod.mean_over_clients

    def forward_backward(self, uploads, counts):
        seen["uploads"].append(sorted(uploads))
        return fb(self, uploads, counts)

    def mean_over_clients(rows):
        seen["rows"].append(rows.clone())
        return mean(rows)

    monkeypatch.setattr(GroupCompute, "forward_backward", forward_backward)
    monkeypatch.setattr(hosfl_mod, "mean_over_clients", mean_over_clients)
    return seen


@pytest.mark.parametrize("stage", [BEFORE_UPLOAD, AFTER_UPLOAD])
def test_hosfl_a_drop_before_upload_leaves_the_step_and_after_upload_only_the_mean(tmp_path, monkeypatch, stage):
    """Round 0 drops its second sampled client. Before its upload: neither θs's step nor v̄ has it. After its upload:
    θs's step has it (its λ was computed), v̄ is the mean over the two others (its row is NaN), and its replica stays
    behind and catches up by replay (the run's end-of-run audit checks every replica against the server's history)."""
    overrides = forced(tmp_path, {0: {1: stage}}, "server.min_clients=1")
    sampled = sample_clients(0, 0, 6, 3)
    seen = spy_round_0(monkeypatch)
    _, runner, summary, rows = run_in_process([*TINY_OVERRIDES, *overrides, f"job.out_dir={tmp_path / 'run'}"])
    assert summary["status"] == "completed"
    others = [sampled[0], sampled[2]]
    assert seen["uploads"][0] == (sampled if stage == AFTER_UPLOAD else others)
    v = seen["rows"][0]
    if stage == AFTER_UPLOAD:
        assert v.shape == (3, 3) and bool(torch.isnan(v[1]).all()) and bool(torch.isfinite(v[[0, 2]]).all())
    else:
        assert v.shape == (2, 3) and bool(torch.isfinite(v).all())
    torch.testing.assert_close(hosfl_mod.mean_over_clients(v), v[torch.isfinite(v).all(1)].mean(0))
    assert summary["participation"]["dropped"] == 1 and summary["participation"]["delivered"] == rows_total(rows)
    assert summary["processed_samples"] >= 240  # the budget, reached by the clients the server stepped with


def rows_total(rows: list[dict]) -> int:
    return sum(r["participants"] for r in rows)


def test_a_skipped_round_steps_nothing_and_is_recorded(tmp_path, monkeypatch):
    """Round 1 loses two of its three clients before their upload (server.min_clients=2): no θs step, no client step
    (θc's AdamW would move on a zero gradient), a NaN row in the history, skipped in the records; the run continues
    and every replica agrees at the end."""
    overrides = forced(tmp_path, {1: {0: BEFORE_UPLOAD, 2: BEFORE_UPLOAD}, 3: {0: AFTER_UPLOAD, 1: AFTER_UPLOAD,
                                                                             2: AFTER_UPLOAD}},
                       "server.min_clients=2", "clients.optim.name=adamw", "server.optim.name=adamw")  # fmt: skip
    steps = []
    real = GroupCompute.step
    monkeypatch.setattr(GroupCompute, "step", lambda self, kept, lr=None: (steps.append(kept), real(self, kept, lr)))
    _, runner, summary, rows = run_in_process([*TINY_OVERRIDES, *overrides, f"job.out_dir={tmp_path / 'run'}"])
    rounds = summary["rounds"]
    assert summary["participation"]["rounds_skipped"] == 1 and len(steps) == rounds - 1  # θs: one step a round left
    lines = [json.loads(x) for x in (tmp_path / "run" / "participation.jsonl").read_text().splitlines()]
    assert len(lines) == rounds and [x["round"] for x in lines if x["skipped"]] == [1]
    assert lines[3]["delivered"] == [] and len(lines[3]["counted"]) == 3  # θs stepped, no scalars arrived
    worker = runner.worker
    client_steps = worker.replicas[-1].opt.steps  # the evaluation replica, brought to the end by replay
    assert worker.replicas[-1].round == rounds and client_steps == rounds - 2
    assert summary["processed_samples"] == 240


# -- records and replay --------------------------------------------------------------------------------------------
def test_records_and_a_replay_of_participation_jsonl_give_the_same_run(tmp_path):
    """participation.jsonl, the rows' participants and summary.json's participation agree; replaying the file
    (without dropout) gives the same rows, digests and traffic."""
    _, _, ref, ref_rows = run_in_process([*TINY_OVERRIDES, *DROPPING, f"job.out_dir={tmp_path / 'ref'}"])
    log = tmp_path / "ref" / "participation.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    part = ref["participation"]
    assert len(lines) == ref["rounds"] and set(part) == {"sampled", "delivered", "dropped", "late", "rounds_skipped",
                                                         "workers_lost", "workers_joined"}  # fmt: skip
    assert part["sampled"] == sum(len(x["sampled"]) for x in lines) == 5 * ref["rounds"]
    assert part["delivered"] == sum(len(x["delivered"]) for x in lines) == rows_total(ref_rows)
    assert part["dropped"] == sum(len(x["dropped"]) for x in lines) and part["dropped"] > 0
    assert part["late"] == sum(len(x["late"]) for x in lines) and part["late"] > 0
    assert part["workers_lost"] == part["workers_joined"] == 0
    refused = sum(len(x["arrived"]) for x in lines if x["skipped"])  # each client's round ends one way
    assert part["sampled"] == part["delivered"] + part["dropped"] + part["late"] + refused
    replay = ["clients.over_select=0.5", "server.min_clients=1", f"clients.participation={log}"]
    _, _, got, _ = run_in_process([*TINY_OVERRIDES, *replay, f"job.out_dir={tmp_path / 'replay'}"])
    ref_rows, ref = read_run(tmp_path / "ref")
    rows, got = read_run(tmp_path / "replay")
    assert rows == ref_rows and got["client_digests"] == ref["client_digests"]
    assert got["server_digest"] == ref["server_digest"] and got["comm"] == ref["comm"]
    assert (tmp_path / "replay" / "participation.jsonl").read_text() == log.read_text()
    assert got["inputs"]["clients.participation"]["sha256"]  # the replayed file is one of the run's inputs


def test_new_keys_at_their_defaults_leave_a_runs_identity_as_it_was():
    identity = comparable_config(load_config(None, TINY_OVERRIDES))
    assert {"dropout", "dropout_stage", "over_select", "participation"}.isdisjoint(identity["clients"])
    assert "min_clients" not in identity["server"]
    assert comparable_config(load_config(None, [*TINY_OVERRIDES, "clients.dropout=0.1"]))["clients"]["dropout"] == 0.1


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "line 1: not a JSON object"),
        ('{"round": 0}', "line 1: an object with the keys"),
        ('{"round": 0, "sampled": [0, 1, 2], "arrived": [0, 1, 2], "counted": [0, 1, 2], "delivered": [0, 1, 2], '
         '"dropped": {}, "late": [], "skipped": false}', "line 1: sampled [0, 1, 2], but this run's draw of round 0"),
    ],
)  # fmt: skip
def test_a_participation_file_that_does_not_fit_is_one_line(tmp_path, line, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match="invalid value for clients.participation") as err:
        load_run_config(None, [*TINY_OVERRIDES, f"clients.participation={path}"])
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_recorded_file_whose_rows_contradict_themselves_is_refused(tmp_path):
    good = round_plan(load_config(None, TINY_OVERRIDES)).participation.round(0).record()
    for key, value, needle in (("delivered", good["sampled"][:1], "delivered"), ("skipped", True, "skipped"),
                               ("dropped", {"9": BEFORE_UPLOAD}, "dropped")):  # fmt: skip
        path = tmp_path / f"{key}.jsonl"
        path.write_text(json.dumps({**good, key: value}) + "\n")
        with pytest.raises(ConfigError, match=needle):
            load_run_config(None, [*TINY_OVERRIDES, f"clients.participation={path}"])


# -- the baselines ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alg", ["frozen_client", "sfl", "fsl_sage", "zo_sfl", "mu_splitfed"])
def test_every_baseline_runs_rounds_without_all_its_clients(tmp_path, alg):
    """Drops at both stages, late clients, skipped rounds: the run completes (every worker's θc equals the
    server's), and its records agree."""
    _, _, summary, rows = run_in_process([*TINY_OVERRIDES, *DROPPING, f"algorithm.name={alg}",
                                          f"job.out_dir={tmp_path / 'run'}"])  # fmt: skip
    part = summary["participation"]
    assert summary["status"] == "completed" and part["dropped"] and part["late"]
    assert part["delivered"] == rows_total(rows) and summary["processed_samples"] >= 240


def test_a_baseline_averages_theta_c_over_who_delivered(tmp_path, monkeypatch):
    """SFL, round 0's second client dropped after its upload: θc^1 is the FedAvg of the two others' θc_m; θs's is
    over all three copies (its requests trained its copy)."""
    from hosfl_dist.algorithms import exchange

    calls = []
    real = exchange.aggregate
    def aggregate(base, models, weights, global_lr=1.0):
        calls.append(len(models))
        return real(base, models, weights, global_lr)

    monkeypatch.setattr(exchange, "aggregate", aggregate)
    overrides = forced(tmp_path, {0: {1: AFTER_UPLOAD}}, "server.min_clients=1", "algorithm.name=sfl")
    run_in_process([*TINY_OVERRIDES, *overrides, f"job.out_dir={tmp_path / 'run'}"])
    assert calls[:2] == [2, 3]  # round 0: θc over the delivered two, θs over the three copies


def test_a_method_that_cannot_drop_clients_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    hosfl = get_algorithm("hosfl")
    strict = AlgorithmSpec("strict", hosfl.server, hosfl.worker, True, hosfl.traffic)
    monkeypatch.setitem(algorithms._REGISTRY, "strict", strict)
    assert {n for n in algorithm_names() if not get_algorithm(n).drops_clients} == {"strict"}
    rc = main([*TINY_OVERRIDES, "algorithm.name=strict", "clients.dropout=0.3", f"job.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(
        "error: invalid value for clients.dropout: 0.3 (algorithm.name=strict cannot run a round without all its "
        "sampled clients; implemented for "), err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["clients.dropout=1"], "error: invalid value for clients.dropout: 1.0 (must be in [0, 1)"),
        (["clients.dropout=-0.1"], "error: invalid value for clients.dropout: -0.1 (must be in [0, 1)"),
        (["server.min_clients=4"], "error: invalid value for server.min_clients: 4 (a round counts at most "
                                   "clients.per_round=3 uploads"),
        (["server.min_clients=-1"], "error: invalid value for server.min_clients: -1 (must be >= 0"),
        (["clients.over_select=-1"], "error: invalid value for clients.over_select: -1.0 (must be >= 0)"),
        (["clients.over_select=1.5"], "error: invalid value for clients.over_select: 1.5 (samples ⌈K·(1+ε)⌉ = 8"),
        (["clients.dropout_stage=never"], "error: invalid value for clients.dropout_stage: 'never'"),
        (["clients.participation=/nonexistent/p.jsonl"], "error: invalid value for clients.participation: "
                                                         "'/nonexistent/p.jsonl' (cannot read it"),
    ],
)  # fmt: skip
def test_bad_participation_values_are_one_line_and_exit_2(tmp_path, capsys, args, needle):
    rc = main([*TINY_OVERRIDES, *args, f"job.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(needle), err
    assert not (tmp_path / "run").exists()


def test_over_select_rounds_k_times_one_plus_epsilon_up_exactly():
    assert [math.ceil(round(10 * (1 + e), 9)) for e in (0.1, 0.3, 0.05)] == [11, 13, 11]
