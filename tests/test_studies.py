"""Studies under every launcher: worlds and their checks (pure), the report of runs that did not complete, a 2×2 sweep
as torchrun jobs against the same sweep in-process, and a Slurm job array (requeue, --no-wait, collect, a failed and a
missing point) on the local cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_experiments import finish_in_process
from test_slurm import SKIP_REASON, slurm_env  # noqa: F401  (a fixture)
from tiny import TINY_OVERRIDES, rows_of, run_one_thread

from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.experiments import collect, sweep
from hosfl_dist.experiments.launch.memory import estimate, node_bytes, rank_bytes, slurm_mem_gib
from hosfl_dist.experiments.launch.worlds import World, assign, misfit, parse_world, read_worlds

REPO = Path(__file__).resolve().parents[1]
TINY = [*TINY_OVERRIDES, "server.rpc_timeout_s=60"]
GRID = ["--grid", "zo.num_perturbations=2,3", "--grid", "clients.optim.lr=0.01,0.02"]
FSDP_POINT = "zo.num_perturbations=3,clients.optim.lr=0.02"
"""The point of the 2×2 grid whose server is a group of two ranks (3 processes); the others get 2."""


def empty_config(folder: Path) -> Path:
    (folder / "empty.yaml").write_text("{}\n")
    return folder / "empty.yaml"


# ------------------------------------------------------------------------------------------------------------------
# Pure tier: worlds, their rules, their checks, the memory floor


def test_a_world_rule_names_its_rows_processes_nodes_gpus_and_overrides():
    rule = parse_world("model.source=arch:qwen3-8b:6,server.ranks=2")
    assert rule.when == ("model.source=arch:qwen3-8b",) and rule.nproc == 6 and rule.overrides == ("server.ranks=2",)
    rule = parse_world("zo.mu=1e-3&split.cut=2:8,nodes=2,gpus=4,job.loggers=[jsonl,tensorboard]")
    assert rule.when == ("zo.mu=1e-3", "split.cut=2") and (rule.nproc, rule.nodes, rule.gpus) == (8, 2, 4)
    assert rule.overrides == ("job.loggers=[jsonl,tensorboard]",)  # a comma inside a value stays in it
    assert parse_world("*:3").when == ()
    for bad, said in [("x", "not of the form"), ("*:0", "NPROC must be >= 1"), ("*:2,foo=1", "'foo' is neither"),
                      ("*:2,nodes=x", "nodes must be a whole number")]:  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            parse_world(bad)


def test_a_point_given_twice_is_refused_and_ctrl_c_ends_a_study_in_one_line(tmp_path, monkeypatch, capsys):
    """--seeds 0,0 (or a grid value twice) would run one point twice and count it as two; Ctrl-C anywhere in a study
    is one line naming where its finished runs are, exit 130."""
    import argparse

    from hosfl_dist.experiments import cli

    with pytest.raises(ConfigError, match=r"--seeds: '0,0' gives 0 more than once"):
        cli.parse_list("0,0", "--seeds", int)
    with pytest.raises(ConfigError, match=r"--grid P: '1,2,01' gives 1 more than once"):
        cli.parse_list("1,2,01", "--grid P", int)
    assert cli.parse_list("1,2", "--grid P", int) == [1, 2]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_rows", interrupted)
    assert cli.run_experiment("compare", argparse.Namespace(out=str(tmp_path / "study")), [], None) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"interrupted: compare into {tmp_path / 'study'} stopped by Ctrl-C")
    assert err[0].endswith("run the same command again")


def test_rows_get_the_first_matching_world_else_nproc_else_their_server_group_and_one_worker(tmp_path):
    (tmp_path / "worlds.yaml").write_text(
        "- when: {zo.num_perturbations: 3}\n  nproc: 4\n  set: {server.ranks: 2}\n- when: '*'\n  nproc: 2\n"
    )
    variants = {
        "mu": [*TINY, "zo.mu=0.002"],  # written as 2e-3 in the rule below: matched on the resolved config
        "p3": [*TINY, "zo.num_perturbations=3"],  # TINY's own P: the YAML or the defaults may set what a rule names
        "p2": [*TINY, "zo.num_perturbations=2"],
    }
    rules = [parse_world("zo.mu=2e-3:3,server.ranks=2"), *read_worlds(str(tmp_path / "worlds.yaml"))]
    worlds = assign(None, variants, rules, None)
    assert worlds["mu"] == World(3, 1, 0, ("server.ranks=2",))
    assert worlds["p3"] == World(4, 1, 0, ("server.ranks=2",))
    assert worlds["p2"] == World(2)
    # no rule: --nproc, else server.ranks + 1
    assert assign(None, {"a": [*TINY, "server.ranks=2"]}, [], None)["a"].nproc == 3
    assert assign(None, {"a": TINY}, [], 5)["a"].nproc == 5
    # a CUDA run asks Slurm for a GPU per process of a node
    assert assign(None, {"a": [*TINY, "job.device=cuda"]}, [parse_world("*:4,nodes=2")], None)["a"].gpus == 2
    # a number in a rule is matched as written: job.name 0x10 is the text "0x10", not 16
    (tmp_path / "named.yaml").write_text("- when: {job.name: 0x10}\n  nproc: 3\n")
    named = assign(None, {"hex": [*TINY, "job.name=0x10"], "16": [*TINY, "job.name=16"]},
                   read_worlds(str(tmp_path / "named.yaml")), 2)  # fmt: skip
    assert named["hex"].nproc == 3 and named["16"].nproc == 2
    (tmp_path / "bad.yaml").write_text("- {when: {zo.mu: 1}, procs: 2}\n")
    with pytest.raises(ConfigError, match=r"world 1: unknown key\(s\) procs"):
        read_worlds(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match=r"--world 'zo.muu=1:2'.*unknown key zo.muu"):
        assign(None, {"a": TINY}, [parse_world("zo.muu=1:2")], None)


def test_a_world_must_fit_the_roles_its_nodes_and_its_devices():
    cfg = load_config(None, TINY)  # clients.total=6
    assert misfit(cfg, World(2), "torchrun") is None and misfit(cfg, World(7), "slurm") is None
    assert "8 client workers for clients.total=6" in misfit(cfg, World(9), "torchrun")
    fsdp = load_config(None, [*TINY, "server.ranks=2"])
    assert "server.ranks=2 server rank(s) plus at least one client worker need 3" in misfit(fsdp, World(2), "slurm")
    assert misfit(cfg, World(4, 2), "torchrun") == "2 nodes need --launcher slurm (--launcher torchrun runs on this " \
        "machine)"  # fmt: skip
    assert misfit(cfg, World(3, 2), "slurm") == "3 processes do not divide over 2 nodes"
    assert "asks Slurm for no GPU" in misfit(load_config(None, [*TINY, "job.device=cuda"]), World(2), "slurm")


def test_the_memory_floor_is_weights_and_optimizer_state_placed_by_the_role_map():
    cfg = load_config(None, [*TINY, "server.ranks=2", "clients.optim.name=sgd", "server.optim.name=adamw"])
    sizes = {"client": {"param_bytes": 1000, "trainable": 10}, "server": {"param_bytes": 8000, "trainable": 100}}
    server = 8000 + 100 * 8  # AdamW: two float32 moments per trainable parameter
    assert rank_bytes(cfg, sizes, World(1)) == [1000 + server]  # one process holds both parts; plain SGD: no state
    assert rank_bytes(cfg, sizes, World(4)) == [server // 2, server // 2, 1000, 1000]  # FSDP halves f_s
    assert node_bytes(rank_bytes(cfg, sizes, World(4, 2)), World(4, 2)) == [server, 2000]
    assert estimate(cfg, World(4, 2), sizes)["node_bytes"] == [server, 2000]
    assert slurm_mem_gib(["--time=1:00:00", "--mem=64G"]) == 64
    assert slurm_mem_gib(["--mem", "2048"]) == 2  # Slurm's default unit: MB
    assert slurm_mem_gib(["--mem=0"]) is None and slurm_mem_gib([]) is None  # the whole node: not known here
    with pytest.raises(ConfigError, match="not a size"):
        slurm_mem_gib(["--mem=lots"])


def test_an_array_asks_slurm_for_its_worlds_nodes_cpus_and_gpus_and_the_study_options_come_last(tmp_path):
    from hosfl_dist.experiments.launch.slurm import ARRAY_SCRIPT, folder_name, sbatch_argv

    world = World(8, 2, 4, ("server.ranks=2",))
    assert folder_name(3, world) == "3-nproc8-nodes2-gpus4" and folder_name(1, World(2)) == "1-nproc2"
    argv = sbatch_argv(world, 5, tmp_path, threads=2, options=["--partition=gpu"], name="hosfl-x", jobs=2)
    assert argv[:7] == ["sbatch", "--parsable", "--array=0-4%2", "--job-name=hosfl-x", "--nodes=2",
                        "--ntasks-per-node=1", "--cpus-per-task=8"]  # fmt: skip
    assert "--gpus-per-node=4" in argv and "--requeue" in argv and "--signal=B:TERM@120" in argv
    assert argv[-3:] == ["--partition=gpu", str(ARRAY_SCRIPT), str(tmp_path / "tasks")]
    one = sbatch_argv(World(2), 1, tmp_path, 1, [], "n")
    assert "--array=0-0" in one and "--cpus-per-task=2" in one and not any(a.startswith("--gpus") for a in one)


# ------------------------------------------------------------------------------------------------------------------
# Checks before anything starts, and the report of runs that did not complete


def test_rows_that_do_not_fit_their_world_or_memory_stop_the_study_before_anything_is_submitted(
    tmp_path, monkeypatch, capsys
):
    """A world with more client workers than clients and a point whose weights and optimizer state exceed the node's
    memory: one line each, exit code 2, sbatch never called and no folder made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho called >> {tmp_path / tool}.calls\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out"
    base = ["--config", str(empty_config(tmp_path)), *TINY, "--grid", "model.width=4,8,16", "--out", str(out)]
    # floors (2 processes on one node): width 8 18 KB, width 16 64 KB: 3e-5 GiB (32 KB) lets width 8 through
    argv = [*base, "--launcher", "slurm", "--world=model.width=4:9", "--nproc", "2", "--node-memory", "0.00003"]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: grid point model.width=4: world size 9 does not fit the roles: 8 client workers")
    assert re.fullmatch(r"error: grid point model.width=16: node 0 needs at least 5.9\de-05 GiB \(weights and "
                        r"optimizer state of 2 processes\) and a node has 3e-05 GiB; a larger server.ranks \(now 1\) "
                        r"or more nodes spread it", err[1]), err[1]  # fmt: skip
    assert err[2:] == ["error: 2 of 3 grid points cannot start: nothing was submitted"]
    assert not (tmp_path / "sbatch.calls").exists() and not (tmp_path / "squeue.calls").exists()
    assert not out.exists()
    # launcher options that the launcher does not take
    assert sweep.main([*base, "--nproc", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --nproc: every run of --launcher inprocess is one process")
    assert sweep.main([*base, "--launcher", "torchrun", "--no-wait"]) == 2
    assert "only --launcher slurm submits jobs" in capsys.readouterr().err


def test_a_failed_run_is_named_with_its_cause_and_collect_reports_the_study_again(tmp_path, capsys):
    """Of two points one diverges: the table holds the other, its Missing section and table.json name the failed one
    with summary.json's error; collect writes the same report from the folder; exit code 2 both times."""
    config = empty_config(tmp_path)
    out = tmp_path / "out"
    argv = ["--config", str(config), *TINY, "server.optim.name=sgd", "--grid", "server.optim.lr=0.01,1e30"]
    argv += ["--out", str(out)]
    specs, _, _ = sweep.build(sweep.parse_args(argv))
    finish_in_process(config, specs["server.optim.lr=0.01"])  # the other one runs as its own process
    assert sweep.main(argv) == 2
    said = capsys.readouterr()
    log = out / "runs" / "server.optim.lr=1e30" / "seed0" / "log.txt"
    cause = "failed: NonFiniteError: round 1: non-finite loss of client 1 (train.on_nonfinite=stop)"
    assert said.err.splitlines()[-2:] == [  # the in-process run above may have logged to stderr first
        f"error: grid point server.optim.lr=1e30 seed 0: {cause} (log: {log})",
        "error: 1 of 2 run(s) did not complete: the report holds the others and names these (Missing)",
    ]
    table = json.loads((out / "table.json").read_text())
    assert [r["variant"] for r in table["rows"]] == ["server.optim.lr=0.01"]
    assert table["missing"] == [{"row": "server.optim.lr=1e30", "seed": 0, "run": str(log.parent),
                                 "why": f"{cause} (log: {log})"}]  # fmt: skip
    assert table["launcher"] == "inprocess" and table["rows"][0]["roles"]["engine"] == "in_process"
    md = (out / "table.md").read_text()
    assert "## Missing" in md and f"- server.optim.lr=1e30, seed 0: {cause}" in md and "## Per role" not in md
    assert (out / "accuracy.png").is_file()

    assert collect.main([str(out)]) == 2
    said = capsys.readouterr()
    assert "reusing" not in said.out and (out / "table.md").read_text() == md
    assert said.err.splitlines()[-1] == "error: 1 of 2 run(s) did not complete: the report holds the others and " \
        "names these (Missing)"  # fmt: skip
    assert json.loads((out / "table.json").read_text())["missing"] == table["missing"]
    assert collect.main([str(tmp_path)]) == 2
    assert "holds no study.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# Multi-process tier: a 2×2 sweep, every point a torchrun job


@pytest.mark.multiprocess
@pytest.mark.slow  # four torchrun jobs: 80-120 s on the 2-core machine
def test_a_torchrun_sweep_equals_the_inprocess_one_and_reports_each_role(tmp_path, capsys):
    """2×2 grid (P × client lr): three points of 2 processes equal the in-process runs bit for bit (metrics rows, θc
    and θs digests); the fourth, with a server group of two ranks (3 processes, FSDP), to float rounding. The table
    gives each point's processes and its roles' memory and round times from the runs' summary.json; run again, every
    point is reused."""
    out = tmp_path / "out"
    argv = ["--config", str(empty_config(tmp_path)), *TINY, *GRID, "--out", str(out), "--launcher", "torchrun"]
    argv += ["--nproc", "2", "--world", "zo.num_perturbations=3&clients.optim.lr=0.02:3,server.ranks=2"]
    assert sweep.main([*argv, "--dry-run"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in shown] == ["NPROC=2"] * 3 + ["NPROC=3"]
    assert all(f"bash {REPO / 'launch' / 'torchrun.sh'} " in line for line in shown) and "server.ranks=2" in shown[3]

    assert sweep.main(argv) == 0
    said = capsys.readouterr().out
    assert said.count(" (2 processes): ") == 3 and f"[ok] {FSDP_POINT} seed 0 (3 processes): " in said
    table = json.loads((out / "table.json").read_text())
    by_row = {r["variant"]: r for r in table["rows"]}
    assert len(by_row) == 4 and table["missing"] == [] and table["launcher"] == "torchrun"
    assert table["worlds"][FSDP_POINT] == {"nproc": 3, "nodes": 1, "gpus": 0, "overrides": ["server.ranks=2"]}
    for name, row in by_row.items():
        roles = row["roles"]
        fsdp = name == FSDP_POINT
        assert roles["engine"] == "torchrun" and roles["processes"] == (3 if fsdp else 2)
        assert roles["server_ranks"] == (2 if fsdp else 1)
        assert set(roles["peak_rss_bytes"]) == ({"server", "server-shard", "worker"} if fsdp else {"server", "worker"})
        assert roles["worker_s_per_round"] > 0 and roles["server_compute_s_per_round"] > 0
    md = (out / "table.md").read_text()
    assert "| zo.num_perturbations, clients.optim.lr | processes | server ranks | server peak RSS [MiB] |" in md
    assert "| 3, 0.02 | 3 | 2 |" in md and "## Missing" not in md

    for name in by_row:
        ref_rows, ref = run_one_thread([*TINY, *name.split(","), f"job.out_dir={tmp_path / 'ref' / name}"])
        run = out / "runs" / name.replace(",", "_") / "seed0"
        rows, summary = rows_of(run), json.loads((run / "summary.json").read_text())
        assert summary["comm"]["bytes"] == ref["comm"]["bytes"] and summary["engine"] == "torchrun"
        if name != FSDP_POINT:
            assert rows == ref_rows and summary["server_digest"] == ref["server_digest"], name
            assert set(summary["client_digests"].values()) == set(ref["client_digests"].values())
            continue
        for a, b in zip(rows, ref_rows, strict=True):  # FSDP: each rank runs whole clients' rows, not one pass
            for k in ("eval_loss", "train_loss", "eval_accuracy"):
                assert a[k] == b[k] if b[k] is None else a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k

    assert sweep.main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("reusing ") == 4 and said.strip().endswith(f"0 run(s) launched (0.0 s), 4 reused -> {out}")


# ------------------------------------------------------------------------------------------------------------------
# Slurm tier: an array of four points on the local cluster

SLURM = ["server.optim.name=sgd", "train.budget_samples=9600", "train.eval_every_samples=960"]
"""400 rounds of 24 samples (10-20 s of training): the first task is still training when it is signalled."""
POINTS = ("0.01", "0.02", "1e30", "0.03")
"""server.optim.lr of the array's four tasks: the third diverges in round 1, the fourth is cancelled unstarted."""


def _squeue(env: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(["squeue", "--me", "--noheader", "--array", "--format=%i %T"], env=env, text=True,
                           capture_output=True, check=True).stdout  # fmt: skip
    return dict(line.split() for line in shown.splitlines())


def _wait(what: str, ready, timeout: float = 240) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s")
        time.sleep(0.5)


@pytest.mark.slurm
@pytest.mark.slow  # the cluster, four torchrun tasks two at a time, a requeue: 90-150 s
@pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "n/a")
def test_a_slurm_array_requeues_a_signalled_task_and_collect_names_a_failed_and_a_missing_point(
    slurm_env,  # noqa: F811
    tmp_path,
):
    """--no-wait submits one array of four tasks and returns; the first task is signalled as Slurm's --signal does
    (SIGTERM to its batch shell): it checkpoints, requeues itself alone and resumes to the uninterrupted run's rows;
    the fourth is cancelled before it starts. collect --wait then reports the two completed points and names the
    diverged one with its cause and the cancelled one as not run. Run again as a dry run, the command reuses the two
    and would submit the other two as one array."""
    out = tmp_path / "out"
    env = dict(slurm_env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{slurm_env['PATH']}")
    argv = [sys.executable, "-m", "hosfl_dist.experiments.sweep", "--config", str(empty_config(tmp_path)), *TINY,
            *SLURM, "--grid", f"server.optim.lr={','.join(POINTS)}", "--out", str(out), "--launcher", "slurm",
            "--nproc", "2", "--sbatch=--cpus-per-task=1", "--sbatch=--time=00:10:00"]  # fmt: skip
    sub = subprocess.run([*argv, "--no-wait"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    array = re.search(r"submitted Slurm array (\d+): 4 run\(s\) of 2 processes each", sub.stdout).group(1)
    assert f"not waiting (--no-wait): Slurm array(s) {array} hold 4 run(s)" in sub.stdout
    assert f"python -m hosfl_dist.experiments.collect {out}" in sub.stdout
    subprocess.run(["scancel", f"{array}_3"], env=slurm_env, check=True)

    runs = {lr: out / "runs" / f"server.optim.lr={lr}" / "seed0" for lr in POINTS}
    _wait("a metrics row of task 0", lambda: (runs["0.01"] / "metrics.jsonl").is_file())
    assert _squeue(slurm_env).get(f"{array}_0") == "RUNNING"
    subprocess.run(["scancel", "--signal=TERM", "--batch", f"{array}_0"], env=slurm_env, check=True)
    ref_rows, ref = run_one_thread([*TINY, *SLURM, "server.optim.lr=0.01", f"job.out_dir={tmp_path / 'ref'}"])

    got = subprocess.run([sys.executable, "-m", "hosfl_dist.experiments.collect", str(out), "--wait"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert got.returncode == 2, got.stdout + got.stderr
    log = (runs["0.01"] / "log.txt").read_text()
    assert "study_array.sbatch: [" in log and f" task {array}_0 (job " in log and ", start 2: " in log, log
    assert re.search(r"\(run interrupted\); requeueing job \d+", log) and "[server] resuming from " in log, log
    summary = json.loads((runs["0.01"] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"], summary
    assert rows_of(runs["0.01"]) == ref_rows and summary["server_digest"] == ref["server_digest"]
    assert json.loads((runs["0.02"] / "summary.json").read_text()).get("resumed_from") is None  # the others alone

    table = json.loads((out / "table.json").read_text())
    assert [r["variant"] for r in table["rows"]] == ["server.optim.lr=0.01", "server.optim.lr=0.02"]
    assert table["launcher"] == "slurm" and all(r["roles"]["processes"] == 2 for r in table["rows"])
    why = {m["row"]: m["why"] for m in table["missing"]}
    assert why["server.optim.lr=1e30"].startswith("failed: worker 1: NonFiniteError: round 1: non-finite loss")
    assert why["server.optim.lr=0.03"].startswith(("not run", "interrupted", "died")), why  # cancelled: never started
    md = (out / "table.md").read_text()
    assert len(why) == 2 and "- server.optim.lr=0.03, seed 0: " in md and "- server.optim.lr=1e30, seed 0: " in md
    assert got.stderr.splitlines()[-1] == "error: 2 of 4 run(s) did not complete: the report holds the others and " \
        "names these (Missing)"  # fmt: skip

    again = subprocess.run([*argv, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert sum(line.startswith("# reusing ") for line in lines) == 2
    (sbatch,) = [line for line in lines if " sbatch " in line]
    assert "--array=0-1 " in sbatch and "--nodes=1" in sbatch and sbatch.endswith("/tasks")
    assert [line.split(": ")[0] for line in lines if line.startswith("#   task")] == ["#   task 0", "#   task 1"]
