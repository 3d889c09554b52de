"""Elastic runs (docs/participation.md#elastic-runs): a ``--serve`` server that ``--join`` workers join and leave
while it runs; rounds decided by who answers in time; a lost worker's clients moving to the others; and the record
of it all replaying in one process to the same digests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosfl_dist.algorithms.participation import ParticipationPlan
from hosfl_dist.config import load_config
from hosfl_dist.run import main
from tiny import ROOT, TINY_OVERRIDES, run_in_process

# a worker timeout that a loaded CI machine cannot make a healthy worker miss
ELASTIC = [*TINY_OVERRIDES, "server.worker_timeout_s=10", "server.min_workers=2"]
DEADLINE_S = 240


class Job:
    """A server and its workers as processes, each with its own log; everything still alive is killed at the end."""

    def __init__(self, tmp: Path, overrides: list[str]) -> None:
        self.tmp, self.run_dir = tmp, tmp / "run"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.server = self._start("server", ["--serve", *overrides, f"job.out_dir={self.run_dir}"])
        self.wait_for(lambda: (self.run_dir / "join.json").exists(), "join.json")

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with open(log, "w") as fh:
            command = [sys.executable, "-m", "hosfl_dist.run", *args]
            proc = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def join(self) -> subprocess.Popen:
        return self._start(f"worker{len(self.procs)}", ["--join", str(self.run_dir)])

    def said(self) -> str:
        return self.logs[0].read_text()

    def wait_for(self, cond, what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while not cond():
            if self.server.poll() is not None and not cond():
                raise AssertionError(
                    f"the server ended ({self.server.returncode}) before {what}:\n{self.said()[-3000:]}"
                )
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
        """The metrics rows written so far (one per evaluation)."""
        try:
            return len((self.run_dir / "metrics.jsonl").read_text().splitlines())
        except FileNotFoundError:
            return 0

    def finish(self) -> int:
        try:
            code = self.server.wait(DEADLINE_S)
            for p in self.procs[1:]:
                p.wait(30)
            return code
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def replay_digests(tmp: Path, run_dir: Path, overrides: list[str]) -> tuple[dict, str]:
    """The in-process replay of an elastic run's participation.jsonl: its client digest and θs digest."""
    _, _, s, _ = run_in_process([*overrides, f"clients.participation={run_dir / 'participation.jsonl'}",
                                 f"job.out_dir={tmp / 'replay'}"])  # fmt: skip
    return s["client_digests"], s["server_digest"]


def check_replays(tmp: Path, job: Job, overrides: list[str]) -> dict:
    s = job.summary()
    assert s["status"] == "completed", s.get("error")
    digests = set(s["client_digests"].values())
    assert len(digests) == 1  # every worker at the end, and the server's evaluation replica, at the same θc
    clients, server = replay_digests(tmp, job.run_dir, overrides)
    assert set(clients.values()) == digests and server == s["server_digest"]
    assert not (job.run_dir / "join.json").exists()  # removed when the run ended
    return s


def test_two_workers_train_and_the_record_replays_in_one_process(tmp_path):
    job = Job(tmp_path, ELASTIC)
    job.join(), job.join()
    job.joined(2)
    status = subprocess.run([sys.executable, "-m", "hosfl_dist.run", "--status", str(job.run_dir)], text=True,
                            capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout  # fmt: skip
    assert ": running (" in status or ": completed" in status, status  # (a tiny run may be over already)
    if ": running (" in status:
        assert "; elastic: 2 live worker(s): worker" in status and "2 joined, 0 lost" in status, status
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, ELASTIC)
    assert s["participation"]["workers_joined"] == 2 and s["participation"]["workers_lost"] == 0
    assert s["participation"]["delivered"] == s["participation"]["sampled"] == 30  # 10 rounds of 3
    rows = [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 5, 10] and sum(r["participants"] for r in rows) == 30
    replayed = json.loads((tmp_path / "replay" / "summary.json").read_text())["comm"]["bytes"]
    for what in ("uplink_activations", "downlink_gradients", "uplink_scalars"):  # the same bytes, counted as sent
        assert s["comm"]["bytes"][what] == replayed[what] > 0, what


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_a_late_one_takes_clients(tmp_path):
    """Three workers, one SIGKILLed mid-run, a fourth joining later: the run completes with workers_lost 1 and
    workers_joined 4, the lost worker's clients count as dropped in its round, and the record replays."""
    overrides = [*ELASTIC, "server.min_workers=3", "train.budget_samples=19200", "train.eval_every_samples=2400",
                 "server.min_clients=1"]  # fmt: skip
    job = Job(tmp_path, overrides)
    workers = job.training_with(3)
    workers[1].send_signal(signal.SIGKILL)
    job.wait_for(lambda: " lost at round " in job.said(), "the loss noticed")
    job.join()
    job.joined(4)
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    assert s["participation"]["workers_lost"] == 1 and s["participation"]["workers_joined"] == 4
    assert len(s["client_digests"]) == 4  # three live workers and the server's evaluation replica


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


def test_participation_decided_live_is_the_plan_of_every_part(tmp_path):
    plan = ParticipationPlan(load_config(None, TINY_OVERRIDES))
    plan.go_live()
    assert plan.emulated and not plan.skipped(0)
    with pytest.raises(KeyError):
        plan.round(0)
    decided = plan.settle(0, plan.sampled(0), plan.sampled(0)[:1], {m: "before_upload" for m in plan.sampled(0)[1:]})
    plan.decide(decided)
    assert plan.round(0) is decided and plan.skipped(0)  # one upload against min_clients = K = 3


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["algorithm.name=sfl"], "algorithm.name: 'sfl' with --serve"),
        (["clients.dropout=0.2"], "clients.dropout: it emulates"),
        (["server.round_timeout_s=-1"], "server.round_timeout_s"),
        (["server.worker_timeout_s=0"], "server.worker_timeout_s"),
        (["checkpoint.interval_samples=120"], "checkpoint.interval_samples: elastic runs"),
        (["zo.batch_clients=true"], "zo.batch_clients: true (an elastic worker"),
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


@pytest.mark.slow  # ~40 s: two runs' worth of process starts
def test_the_launch_script_runs_a_server_and_its_workers(tmp_path):
    """launch/elastic.sh: the server and WORKERS workers as separate processes; the run completes."""
    out = tmp_path / "run"
    env = {**os.environ, "WORKERS": "2", "OUT": str(out), "VENV": str(Path(sys.executable).parents[1]),
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    res = subprocess.run(["bash", str(ROOT / "launch" / "elastic.sh"), *ELASTIC], env=env, capture_output=True,
                         text=True, timeout=DEADLINE_S)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["participation"]["workers_joined"] == 2
    bad = subprocess.run(["bash", str(ROOT / "launch" / "elastic.sh"), *ELASTIC, "algorithm.name=sfl"], env=env,
                         capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
    assert bad.returncode == 2 and "with --serve" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_clients_on_slow_links_straggle_past_the_round_timeout_and_the_record_replays(tmp_path):
    """comm.speed_spread: clients on log-normal link speeds (the emulated link, comm.inject_delay); those whose upload
    takes longer than server.round_timeout_s after the round's first are left out, and the record replays."""
    overrides = [*ELASTIC, "train.budget_samples=480", "comm.inject_delay=true", "comm.speed_spread=1.5",
                 "comm.uplink_mbps=0.5", "server.round_timeout_s=0.1", "server.min_clients=1"]  # fmt: skip
    job = Job(tmp_path, overrides)
    job.join(), job.join()
    assert job.finish() == 0, job.said()
    s = check_replays(tmp_path, job, overrides)
    assert s["participation"]["dropped"] + s["participation"]["late"] > 0  # someone straggled


def test_real_time_keys_are_refused_by_the_fixed_runtimes_unless_replaying(tmp_path, capsys):
    for key in ("server.round_timeout_s=2", "comm.speed_spread=1"):
        assert main([*TINY_OVERRIDES, key, f"job.out_dir={tmp_path / 'r'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "only elastic runs, --serve" in err[0], err
    assert main(["--check", *TINY_OVERRIDES, "server.round_timeout_s=2", f"job.out_dir={tmp_path / 'r'}"]) == 2
    assert "only elastic runs, --serve" in capsys.readouterr().err  # --check says what the run would
    out = f"job.out_dir={tmp_path / 'r'}"
    assert main(["--serve", "--check", *TINY_OVERRIDES, "server.round_timeout_s=2", out]) == 0
    capsys.readouterr()
    assert main(["--serve", *TINY_OVERRIDES, "comm.speed_spread=1", f"job.out_dir={tmp_path / 'r'}"]) == 2
    assert "emulated with comm.inject_delay=true" in capsys.readouterr().err


def test_a_join_file_whose_server_is_gone_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("{}\n")
    import socket

    left = {"host": "127.0.0.1", "port": 1, "token": "x", "pid": 2**22 + 12345, "node": socket.gethostname()}
    (tmp_path / "join.json").write_text(json.dumps(left))  # what a SIGKILLed server leaves behind
    assert main(["--join", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not running" in err[0], err


# -- the coordinator in one process: workers as threads over direct calls (no RPC), fast enough for every case ------
class DeadAfter:
    """A worker's link that goes silent (as a SIGKILLed process does) at its ``n``-th call of ``method``: that call
    and every later one (heartbeats included) never answer."""

    def __init__(self, link, method: str, n: int) -> None:
        self.link, self.method, self.left = link, method, n
        self.dead = False

    def open(self) -> str:
        return self.link.open()

    def send(self, method: str, *args, timeout=None):
        from torch.futures import Future

        if method == self.method:
            self.left -= 1
            self.dead = self.dead or self.left <= 0
        return Future() if self.dead else self.link.send(method, *args)

    def close(self) -> None:
        pass


def serve_in_threads(tmp: Path, overrides: list[str], links) -> tuple[dict, Path]:
    """An elastic run with its workers as threads of this process: ``links(coordinator)`` gives each worker's link."""
    import threading

    from hosfl_dist.runtime.elastic.serve import ElasticServer
    from hosfl_dist.runtime.elastic.worker import ElasticWorker

    served = ElasticServer(load_config(None, [*overrides, f"job.out_dir={tmp / 'run'}"]))
    try:
        for link in links(served.coordinator):
            worker = ElasticWorker(served.cfg, link, tmp / "run")
            threading.Thread(target=worker.run, daemon=True).start()
        return served.train(), tmp / "run"
    finally:
        served.close()


def direct(coordinator, n: int):
    from hosfl_dist.runtime.elastic.worker import DirectLink

    return [DirectLink(coordinator, f"thread{i}") for i in range(n)]


FAST = [*TINY_OVERRIDES, "server.worker_timeout_s=3", "train.budget_samples=480"]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # every client delivers
        ["clients.over_select=0.5"],  # 5 of 6 sampled, the first 3 uploads count, the others are late
    ],
)
def test_in_one_process_the_coordinator_decides_rounds_that_replay(tmp_path, extra):
    overrides = [*FAST, "server.min_workers=2", *extra]
    summary, run = serve_in_threads(tmp_path, overrides, lambda c: direct(c, 2))
    assert summary["status"] == "completed" and summary["participation"]["workers_joined"] == 2
    clients, server = replay_digests(tmp_path, run, overrides)
    assert set(clients.values()) == set(summary["client_digests"].values()) and server == summary["server_digest"]
    if extra:
        assert summary["participation"]["late"] > 0  # two late uploads in every round


@pytest.mark.parametrize(
    ("method", "min_clients", "what"),
    [
        ("upload", 1, "dropped before upload"),  # dies before its round's upload: the others step without it
        ("scalars", 1, "dropped after upload"),  # dies between its upload and its scalars
        ("upload", 0, "skipped"),  # min_clients = K: the round it dies in has too few uploads
    ],
)
def test_in_one_process_a_worker_that_goes_silent_is_lost_and_its_clients_move(tmp_path, method, min_clients, what):
    overrides = [*FAST, "server.min_workers=2", f"server.min_clients={min_clients}", "train.budget_samples=720"]

    def links(c):
        healthy, dying = direct(c, 2)
        return [healthy, DeadAfter(dying, method, 3)]

    summary, run = serve_in_threads(tmp_path, overrides, links)
    p = summary["participation"]
    assert summary["status"] == "completed" and p["workers_lost"] == 1 and p["workers_joined"] == 2
    assert list(summary["client_digests"]) == ["thread0", "server_evaluation"]  # the silent one reports nothing
    rows = [json.loads(x) for x in (run / "participation.jsonl").read_text().splitlines()]
    stages = {s for r in rows for s in r["dropped"].values()}
    if what == "skipped":
        assert p["rounds_skipped"] >= 1
    else:
        assert p["rounds_skipped"] == 0 and {"dropped before upload": "before_upload",
                                             "dropped after upload": "after_upload"}[what] in stages  # fmt: skip
    clients, server = replay_digests(tmp_path, run, overrides)  # the record replays whatever happened
    assert set(clients.values()) == set(summary["client_digests"].values()) and server == summary["server_digest"]
