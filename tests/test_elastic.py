"""Elastic runs (docs/participation.md#elastic-runs): a ``--serve`` server that ``--join`` workers join and leave
while it runs, the run's one trainer on the server and every method's own round on the workers, rounds decided by who
answers in time, a lost worker's clients moving to the others, a server that dies and comes back, every message
checked, and the record of it all replaying in one process to the same digests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hosfl_dist.config import load_config
from hosfl_dist.run import main
from hosfl_dist.runtime.build import round_plan
from tiny import ROOT, TINY_OVERRIDES, run_in_process

# a worker timeout that a loaded CI machine cannot make a healthy worker miss
ELASTIC = [*TINY_OVERRIDES, "server.worker_timeout_s=10", "server.min_workers=2"]
DEADLINE_S = 300


class Job:
    """A server and its workers as processes, each with its own log, started in a folder of their own (never the
    checkout: a user's module there must not shadow the package's); everything still alive is killed at the end."""

    def __init__(self, tmp: Path, overrides: list[str], server_args: tuple[str, ...] = ()) -> None:
        self.tmp, self.run_dir = tmp, tmp / "run"
        self.overrides = overrides
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.server = self.serve(server_args)

    def serve(self, extra: tuple[str, ...] = (), name: str = "server") -> subprocess.Popen:
        (self.run_dir / "join.json").unlink(missing_ok=True)
        proc = self._start(name, ["--serve", *self.overrides, f"job.out_dir={self.run_dir}", *extra])
        self.server_log = self.logs[-1]
        self.server = proc
        self.wait_for(lambda: (self.run_dir / "join.json").exists(), "join.json")
        return proc

    def _start(self, name: str, args: list[str], script: str | None = None) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        path = os.pathsep.join(filter(None, [os.environ.get("HOSFL_TEST_EXTRA_PATH"), str(ROOT)]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "hosfl_dist.run", *args]
        with open(log, "w") as fh:
            proc = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def join(self, folder: Path | None = None, script: str | None = None) -> subprocess.Popen:
        return self._start(f"worker{len(self.procs)}", ["--join", str(folder or self.run_dir)], script)

    def said(self) -> str:
        return self.server_log.read_text()

    def wait_for(self, cond, what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while not cond():
            if self.server.poll() is not None and not cond():
                raise AssertionError(f"the server ended ({self.server.returncode}) before {what}:\n"
                                     f"{self.said()[-3000:]}")  # fmt: skip
            if time.monotonic() > end:
                raise AssertionError(f"no {what} within {DEADLINE_S} s:\n{self.said()[-3000:]}")
            time.sleep(0.05)

    def joined(self, n: int) -> None:
        self.wait_for(lambda: self.said().count(" joined at round ") >= n, f"{n} joins")

    def training_with(self, n: int) -> list[subprocess.Popen]:
        """``n`` workers started, joined, and a metrics row written after they all took part."""
        workers = [self.join() for _ in range(n)]
        self.joined(n)
        rows = self.rows()
        self.wait_for(lambda: self.rows() > rows, f"a round evaluated with {n} workers")
        return workers

    def rows(self) -> int:
        try:
            return len((self.run_dir / "metrics.jsonl").read_text().splitlines())
        except FileNotFoundError:
            return 0

    def finish(self) -> int:
        try:
            code = self.server.wait(DEADLINE_S)
            for p in self.procs:
                p.wait(60)
            return code
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def replay(tmp: Path, run_dir: Path, overrides: list[str]) -> dict:
    """The in-process replay of an elastic run's participation.jsonl: its summary."""
    fixed = [o for o in overrides if not o.startswith(("server.round_timeout_s", "comm.speed_spread"))]
    _, _, s, _ = run_in_process([*fixed, f"clients.participation={run_dir / 'participation.jsonl'}",
                                 f"job.out_dir={tmp / 'replay'}"])  # fmt: skip
    return s


def check_replays(tmp: Path, job: Job, overrides: list[str]) -> dict:
    s = job.summary()
    assert s["status"] == "completed", s.get("error")
    digests = set(s["client_digests"].values())
    assert len(digests) == 1  # every worker at the end, and the server's evaluation replica, at the same θc
    r = replay(tmp, job.run_dir, overrides)
    assert set(r["client_digests"].values()) == digests and r["server_digest"] == s["server_digest"]
    assert not (job.run_dir / "join.json").exists()  # removed when the run ended
    return s


def test_two_workers_compute_the_fixed_runtimes_run_and_the_record_replays(tmp_path):
    """Nothing drops: the elastic run is the fixed runtimes' run, bit for bit, with the same traffic (but for the
    leader's 4·P bytes of finish_round a round, which the gate does not need), and its record replays."""
    job = Job(tmp_path, ELASTIC)
    job.join(), job.join()
    job.joined(2)
    status = subprocess.run([sys.executable, "-m", "hosfl_dist.run", "--status", str(job.run_dir)], text=True,
                            capture_output=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert ": running (" in status or ": completed" in status, status  # (a tiny run may be over already)
    if ": running (" in status:
        assert "; elastic: 2 live worker(s): worker" in status and "2 joined, 0 lost" in status, status
        assert " ago)" in status or "silent" in status, status
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, ELASTIC)
    _, _, fixed, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'fixed'}"])
    assert set(s["client_digests"].values()) == set(fixed["client_digests"].values())
    assert s["server_digest"] == fixed["server_digest"]
    assert {k: v for k, v in s["comm"]["bytes"].items() if k != "control"} == \
        {k: v for k, v in fixed["comm"]["bytes"].items() if k != "control"}  # fmt: skip
    p = s["participation"]
    assert p["workers_joined"] == 2 and p["workers_lost"] == 0 and p["delivered"] == p["sampled"] == 30
    rows = [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 5, 10] and sum(r["participants"] for r in rows) == 30


def test_participation_decided_live_is_the_plan_of_every_part(tmp_path):
    plan = round_plan(load_config(None, TINY_OVERRIDES)).participation
    plan.go_live()
    assert plan.emulated and not plan.skipped(0) and not plan.decided(0)
    with pytest.raises(KeyError):
        plan.round(0)
    decided = plan.settle(0, plan.sampled(0), plan.sampled(0)[:1], {m: "before_upload" for m in plan.sampled(0)[1:]})
    plan.decide(decided)
    assert plan.round(0) is decided and plan.skipped(0) and plan.decided(0)  # one upload against min_clients = K
    again = round_plan(load_config(None, TINY_OVERRIDES)).participation
    again.restore([decided.record()])  # what a checkpoint of a live run holds
    assert again.round(0) == decided


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["clients.dropout=0.2"], "clients.dropout: 0.2 (with --serve the workers"),
        (["clients.participation=x.jsonl"], "clients.participation"),
        (["server.round_timeout_s=-1"], "server.round_timeout_s"),
        (["server.worker_timeout_s=0"], "server.worker_timeout_s"),
        (["server.rejoin_timeout_s=-1"], "server.rejoin_timeout_s"),
        (["comm.speed_spread=1"], "emulated with comm.inject_delay=true"),
    ],
)
def test_what_an_elastic_server_refuses_is_one_line(tmp_path, capsys, args, expected):
    assert main(["--serve", *TINY_OVERRIDES, *args, f"job.out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_a_bad_serve_address_or_join_folder_is_one_line(tmp_path, capsys):
    assert main(["--serve", "--address", "nohost", *TINY_OVERRIDES, f"job.out_dir={tmp_path / 'r'}"]) == 2
    assert "--address: 'nohost' (HOST:PORT" in capsys.readouterr().err
    assert main(["--join", str(tmp_path)]) == 2
    assert "no join.json" in capsys.readouterr().err
    assert main(["--join", str(tmp_path), "--config", "x.yaml"]) == 2
    assert "a worker takes the run's own config" in capsys.readouterr().err


def test_real_time_keys_are_refused_in_one_process_unless_replaying(tmp_path, capsys):
    for key in ("server.round_timeout_s=2", "comm.speed_spread=1"):
        assert main([*TINY_OVERRIDES, key, f"job.out_dir={tmp_path / 'r'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "one process has no real-time rounds" in err[0], err
    assert main(["--check", *TINY_OVERRIDES, "server.round_timeout_s=2", f"job.out_dir={tmp_path / 'r'}"]) == 2
    assert "one process has no real-time rounds" in capsys.readouterr().err  # --check says what the run would
    out = f"job.out_dir={tmp_path / 'r'}"
    assert main(["--serve", "--check", *TINY_OVERRIDES, "server.round_timeout_s=2", out]) == 0
    capsys.readouterr()


def test_a_join_file_whose_server_is_gone_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("{}\n")
    import socket

    left = {"host": "127.0.0.1", "port": 1, "token": "x", "pid": 2**22 + 12345, "node": socket.gethostname()}
    (tmp_path / "join.json").write_text(json.dumps(left))  # what a SIGKILLed server leaves behind
    assert main(["--join", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not running" in err[0], err


@pytest.mark.slow
def test_a_worker_that_would_compute_another_run_is_refused_in_one_line(tmp_path):
    """A copied config with another clients.batch_size: the server refuses the join, naming what differs; the run
    goes on with the workers that are what the run is."""
    job = Job(tmp_path, [*ELASTIC, "server.min_workers=1", "train.budget_samples=24000"])
    job.join()
    job.joined(1)
    other = tmp_path / "copy"
    other.mkdir()
    (other / "join.json").write_text((job.run_dir / "join.json").read_text())
    cfg = (job.run_dir / "config.yaml").read_text().replace("batch_size: 8", "batch_size: 16")
    (other / "config.yaml").write_text(cfg)
    bad = job.join(other)
    assert bad.wait(DEADLINE_S) == 2
    said = job.logs[-1].read_text().strip().splitlines()
    assert [line for line in said if line.startswith("error:")] == [
        "error: refused to join: this worker would compute another run (its config key clients.batch_size not the "
        "run's); join with the run's config, data and code"
    ], said[-5:]
    assert job.finish() == 0, job.said()
    assert job.summary()["participation"]["workers_joined"] == 1


# -- slow: every method, a lost and a late worker, a server that dies, a stalled worker, stragglers, hostile peers ----
LOSS = [*ELASTIC, "server.min_workers=3", "train.budget_samples=9600", "train.eval_every_samples=2400",
        "server.min_clients=1"]  # fmt: skip
METHODS = ["hosfl", "frozen_client", "sfl", "fsl_sage", "zo_sfl", "mu_splitfed"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_survives_a_killed_worker_and_takes_a_late_one(tmp_path, method):
    """Three workers, one SIGKILLed after the first evaluation, a fourth joining later: the run completes, the
    record has the loss and the join, and its in-process replay gives the same digests. (SplitLoRA, the seventh
    method, is SFL's protocol on a LoRA model: tests/test_elastic_lm.py.)"""
    overrides = [*LOSS, f"algorithm.name={method}"]
    job = Job(tmp_path, overrides)
    workers = job.training_with(3)
    workers[1].send_signal(signal.SIGKILL)
    job.wait_for(lambda: " lost at round " in job.said(), "the loss noticed")
    job.join()
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    p = s["participation"]
    assert p["workers_lost"] == 1 and p["workers_joined"] in (3, 4) and p["dropped"] >= 1, p


@pytest.mark.slow
def test_a_killed_server_comes_back_from_its_checkpoint_and_its_workers_rejoin(tmp_path):
    """SIGKILL of the server after its second checkpoint, then --serve with job.resume=auto: the workers notice,
    wait, rejoin with their replicas rebuilt, the run completes at the replay's digests, and nothing recorded before
    the kill is lost (the lines the resume does not continue are kept in *.superseded.jsonl)."""
    overrides = [*ELASTIC, "train.budget_samples=4800", "train.eval_every_samples=1200",
                 "checkpoint.interval_samples=960", "server.min_clients=1"]  # fmt: skip
    job = Job(tmp_path, overrides)
    job.training_with(2)
    ckpts = job.run_dir / "checkpoints"
    job.wait_for(lambda: len([p for p in ckpts.glob("round-*") if not p.name.endswith(".partial")]) >= 2,
                 "two checkpoints")  # fmt: skip
    job.server.send_signal(signal.SIGKILL)
    job.server.wait()
    before = (job.run_dir / "participation.jsonl").read_text().splitlines()
    job.serve(("job.resume=auto",), "server2")
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    assert "resuming from" in job.said()
    after = (job.run_dir / "participation.jsonl").read_text().splitlines()
    kept = (job.run_dir / "participation.superseded.jsonl")
    superseded = kept.read_text().splitlines()[1:] if kept.exists() else []
    assert set(before) <= set(after) | set(superseded)  # every line the killed server wrote is still there
    assert s["participation"]["workers_joined"] >= 4  # two workers, then the same two again


@pytest.mark.slow
def test_a_worker_whose_server_never_returns_exits_in_one_line_within_its_bound(tmp_path):
    overrides = [*ELASTIC, "server.min_workers=1", "train.budget_samples=48000", "server.rejoin_timeout_s=3"]
    job = Job(tmp_path, overrides)
    worker = job.training_with(1)[0]
    job.server.send_signal(signal.SIGKILL)
    job.server.wait()  # reaped, as a server's shell reaps it (a zombie's pid still answers os.kill(pid, 0))
    began = time.monotonic()
    assert worker.wait(60) == 1
    assert time.monotonic() - began < 40  # the bound (3 s) and a lost connection's notice, not an RPC timeout
    said = [line for line in job.logs[-1].read_text().splitlines() if line.startswith("error")]
    assert len(said) == 1 and "did not come back within server.rejoin_timeout_s=3" in said[0], said


@pytest.mark.slow  # about 15 s
def test_a_worker_waiting_for_the_others_to_join_is_not_lost_while_it_waits(tmp_path):
    """server.min_workers=2: the first worker's join is answered once the second is there, twice
    server.worker_timeout_s later; waiting for its welcome it is not silent (nor lost), and the run is the fixed one."""
    overrides = [*TINY_OVERRIDES, "server.worker_timeout_s=2", "server.min_workers=2"]
    job = Job(tmp_path, overrides)
    job.join()
    job.joined(1)
    time.sleep(5)  # past the timeout: a member that waits for its welcome sends no beat
    assert job.server.poll() is None and " lost at round " not in job.said(), job.said()[-2000:]
    job.join()
    assert job.finish() == 0, job.said()[-3000:]
    s = check_replays(tmp_path, job, overrides)
    assert s["participation"]["workers_lost"] == 0 and " silent for " not in job.said(), job.said()[-2000:]
    _, _, fixed, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'fixed'}"])
    assert s["server_digest"] == fixed["server_digest"]


@pytest.mark.slow
def test_a_stopped_worker_is_left_behind_then_catches_up(tmp_path):
    """A worker SIGSTOPped past server.round_timeout_s (but not server.worker_timeout_s): the rounds go on without its
    clients, it continues, catches up by replay and ends at the same θc; the record replays to the same digests."""
    overrides = [*TINY_OVERRIDES, "server.min_workers=3", "train.budget_samples=9600", "train.eval_every_samples=2400",
                 "server.min_clients=1", "server.round_timeout_s=0.5", "server.worker_timeout_s=60"]  # fmt: skip
    job = Job(tmp_path, overrides)
    workers = job.training_with(3)
    workers[0].send_signal(signal.SIGSTOP)
    time.sleep(3)
    workers[0].send_signal(signal.SIGCONT)
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    p = s["participation"]
    assert p["workers_lost"] == 0 and p["workers_joined"] == 3 and len(s["client_digests"]) == 4
    assert p["dropped"] + p["late"] > 0  # the stopped worker's clients, in the rounds it missed


@pytest.mark.slow
def test_clients_on_slow_links_straggle_past_the_round_timeout_and_the_record_replays(tmp_path):
    """comm.speed_spread: clients on log-normal link speeds (the emulated link, comm.inject_delay); those whose upload
    takes longer than server.round_timeout_s after the round's first are late, and the record replays."""
    overrides = [*ELASTIC, "train.budget_samples=480", "comm.inject_delay=true", "comm.speed_spread=1.5",
                 "comm.uplink_mbps=0.5", "server.round_timeout_s=0.1", "server.min_clients=1"]  # fmt: skip
    job = Job(tmp_path, overrides)
    job.join(), job.join()
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    assert s["participation"]["dropped"] + s["participation"]["late"] > 0  # someone straggled


HOSTILE = """
import sys, torch
from hosfl_dist.runtime import live
from hosfl_dist.runtime.elastic.driver import run_join

MODE = {mode!r}
real = live.LiveRounds.close_async
calls = [0]

def close_async(self, t, exchange=None, rows=None, fn=None, width=0):
    rows = dict(rows or {{}})
    if rows:
        calls[0] += 1
        if calls[0] == 3:  # its third round with scalars
            m = next(iter(rows))
            rows[m] = {{"nan": torch.full((width,), float("nan")), "shape": torch.zeros(width + 1)}}[MODE]
    return real(self, t, exchange, rows, fn, width)

live.LiveRounds.close_async = close_async
sys.exit(run_join(sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "on_nonfinite"), [("nan", "skip"), ("nan", "stop"), ("shape", "skip")])
def test_a_member_that_sends_bad_scalars_is_checked_as_every_runtime_checks(tmp_path, mode, on_nonfinite):
    """NaN scalars under train.on_nonfinite=skip are left out (the client dropped after its upload, counted in
    nonfinite_skipped); under stop, or scalars of the wrong shape, the member is refused and lost. Never a deadlock,
    and the record replays to the run's digests in every case."""
    overrides = [*ELASTIC, "train.budget_samples=1200", "server.min_clients=1", f"train.on_nonfinite={on_nonfinite}"]
    job = Job(tmp_path, overrides)
    job.join(script=HOSTILE.format(mode=mode)), job.join()
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    rows = [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    if mode == "nan" and on_nonfinite == "skip":
        assert sum(r.get("nonfinite_skipped", 0) for r in rows) == 1 and s["participation"]["workers_lost"] == 0
    else:
        assert s["participation"]["workers_lost"] == 1


@pytest.mark.slow  # ~40 s: two runs' worth of process starts
def test_the_launch_script_runs_a_server_and_its_workers(tmp_path):
    """launch/elastic.sh: the server and WORKERS workers as separate processes; the run completes."""
    out = tmp_path / "run"
    env = {**os.environ, "WORKERS": "2", "OUT": str(out), "VENV": str(Path(sys.executable).parents[1]),
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    res = subprocess.run(["bash", str(ROOT / "launch" / "elastic.sh"), *ELASTIC], env=env, capture_output=True,
                         text=True, timeout=DEADLINE_S, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["participation"]["workers_joined"] == 2
    bad = subprocess.run(["bash", str(ROOT / "launch" / "elastic.sh"), *ELASTIC, "clients.dropout=0.5"], env=env,
                         capture_output=True, text=True, timeout=DEADLINE_S, cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2 and "with --serve" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


CALLBACK = textwrap.dedent("""
    import json, os
    from hosfl_dist import Callback

    class Events(Callback):
        def _note(self, name):
            with open(os.environ["HOSFL_TEST_EVENTS"], "a") as fh:
                fh.write(name + "\\n")

        def on_train_start(self, run): self._note("on_train_start")
        def on_round_end(self, t, info): self._note(f"on_round_end {t}")
        def on_evaluate(self, row): self._note(f"on_evaluate {row['round']}")
        def on_checkpoint(self, path): self._note("on_checkpoint")
        def on_train_end(self, summary): self._note("on_train_end")
""")


@pytest.mark.slow
def test_a_callback_hears_the_same_events_in_one_process_under_torchrun_and_in_an_elastic_run(tmp_path, monkeypatch):
    """The same run's events, in the same order, whichever process fires each (torchrun: the front on rank 0 and the
    leader worker; elastic: the server)."""
    from tiny import torchrun

    (tmp_path / "hosfl_test_events_cb.py").write_text(CALLBACK)
    monkeypatch.syspath_prepend(str(tmp_path))
    cb = ["job.callbacks=[hosfl_test_events_cb:Events]", "checkpoint.interval_samples=120"]
    events = {}
    for runtime in ("in_process", "torchrun", "elastic"):
        log = tmp_path / f"{runtime}.events"
        monkeypatch.setenv("HOSFL_TEST_EVENTS", str(log))
        if runtime == "in_process":
            run_in_process([*TINY_OVERRIDES, *cb, f"job.out_dir={tmp_path / 'ip'}"])
        elif runtime == "torchrun":
            monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
            rc, said, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY_OVERRIDES, *cb, f"job.out_dir={tmp_path / 'tr'}"])
            assert rc == 0, said[-3000:]
        else:
            monkeypatch.setenv("HOSFL_TEST_EXTRA_PATH", str(tmp_path))
            (tmp_path / "el").mkdir()
            job = Job(tmp_path / "el", [*ELASTIC, *cb])
            job.join(), job.join()
            assert job.finish() == 0, job.said()
        events[runtime] = log.read_text().splitlines()
    assert events["torchrun"] == events["in_process"] and "on_train_end" in events["in_process"]
    assert events["elastic"] == events["in_process"]


@pytest.mark.slow
def test_an_elastic_server_group_of_two_ranks_computes_the_torchrun_jobs_run(tmp_path):
    """--serve under torchrun with server.ranks=2 (f_s sharded with FSDP2 over the server group) and two joined
    workers: the run completes at the digests of the torchrun job with the same server group (the same data-parallel
    arithmetic; tests/test_distributed.py compares that one with one server rank)."""
    from tiny import torchrun

    overrides = [*ELASTIC, "server.ranks=2"]
    out = tmp_path / "run"
    job = Job.__new__(Job)
    job.tmp, job.run_dir, job.overrides, job.procs, job.logs = tmp_path, out, overrides, [], []
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]  # fmt: skip
    log = tmp_path / "server.log"
    with open(log, "w") as fh:
        job.server = subprocess.Popen([*launcher, "-m", "hosfl_dist.run", "--serve", *overrides, f"job.out_dir={out}"],
                                      stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # fmt: skip
    job.procs.append(job.server)
    job.server_log = log
    job.wait_for(lambda: (out / "join.json").exists(), "join.json")
    job.join(), job.join()
    assert job.finish() == 0, job.said()
    s = job.summary()
    assert s["status"] == "completed" and len(set(s["client_digests"].values())) == 1
    rc, said, _ = torchrun(4, ["-m", "hosfl_dist.run", *TINY_OVERRIDES, "server.ranks=2",
                               f"job.out_dir={tmp_path / 'fixed'}"])  # fmt: skip
    assert rc == 0, said[-3000:]
    fixed = json.loads((tmp_path / "fixed" / "summary.json").read_text())
    assert set(s["client_digests"].values()) == set(fixed["client_digests"].values())
    assert s["server_digest"] == fixed["server_digest"]


@pytest.mark.slow
def test_a_worker_whose_copy_of_the_data_differs_is_refused_in_one_line(tmp_path):
    """The same config, the same path, other bytes (a copy of the training file with its labels shifted, as on
    another machine): the join is refused naming the input, and the run goes on with the worker whose data is the
    run's; summary.json's inputs are what every member read."""
    from tiny import lm_overrides, write_text_files

    ours, theirs = tmp_path / "a", tmp_path / "b"
    for folder in (ours, theirs):
        folder.mkdir()
        write_text_files(folder)
    shifted = [json.loads(x) for x in (theirs / "sst2.jsonl").read_text().splitlines()]
    (theirs / "sst2.jsonl").write_text("".join(json.dumps({**r, "y": 1 - r["y"]}) + "\n" for r in shifted))
    overrides = [o.replace(str(ours) + "/", "") for o in lm_overrides(tmp_path / "unused", ours)
                 if not o.startswith("job.out_dir")]  # data.train_path=sst2.jsonl: relative to each one's cwd
    overrides += ["train.budget_samples=8000", "train.eval_every_samples=4000", "server.worker_timeout_s=10"]
    job = Job(ours, overrides)
    job.join()
    job.joined(1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    other = subprocess.run([sys.executable, "-m", "hosfl_dist.run", "--join", str(job.run_dir)], cwd=theirs, env=env,
                           capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
    assert other.returncode == 2, other.stderr[-2000:]
    errors = [line for line in other.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "refused to join" in errors[0] and "input" in errors[0], errors
    assert job.finish() == 0, job.said()
    s = job.summary()
    assert s["status"] == "completed" and s["participation"]["workers_joined"] == 1
