"""Surviving faults under torchrun: a stop signal checkpoints and resumes exactly; a lost rank (a client worker, the
leader, the server) is restarted by ``torchrun --max-restarts`` from the last checkpoint and the job finishes with
the results of an uninterrupted run, bit for bit."""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import pytest

from tiny import TINY_OVERRIDES, assert_same_as, read_run, run_one_thread, torchrun

TINY = [*TINY_OVERRIDES, "server.rpc_timeout_s=60", "checkpoint.interval_samples=48"]
"""Ten rounds of K=3 clients of 8 samples, a checkpoint every second round."""

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache: dict[str, tuple[list[dict], dict]] = {}

    def get(alg: str, extra: list[str]) -> tuple[list[dict], dict]:
        if alg not in cache:
            out = tmp_path_factory.mktemp(alg)
            cache[alg] = run_one_thread([*TINY, f"algorithm.name={alg}", *extra, f"job.out_dir={out}"])
        return copy.deepcopy(cache[alg])

    return get


INJECT = textwrap.dedent(
    """
    # hosfl_dist.run with one fault injected on the first attempt only:
    #   FAULT=kill:<rank>:<round>  that rank SIGKILLs itself when it meets round <round>
    #   FAULT=term:<round>         the leader worker (rank $LEADER, default 1) sends SIGTERM to the launcher (what
    #                              Slurm does) at round <round>
    import os, signal, sys
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.run import main
    from hosfl_dist.transport import endpoint

    kind, *args = os.environ["FAULT"].split(":")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not os.path.exists(os.environ["FAULT_DONE"])
    rank, at = int(os.environ["RANK"]), int(args[-1])
    target = int(args[0]) if kind == "kill" else int(os.environ.get("LEADER", "1"))

    def fault():
        open(os.environ["FAULT_DONE"], "w").close()
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getppid(), signal.SIGTERM)

    if first and rank == target == 0:
        serve = endpoint.ServerEndpoint.serve
        def dying(self, method, kw, *args, **kwargs):
            if kw.get("t") == at:
                fault()
            return serve(self, method, kw, *args, **kwargs)
        endpoint.ServerEndpoint.serve = dying
    elif first and rank == target:
        worker = get_algorithm(os.environ["ALG"]).worker
        run_round = worker.run_round
        def dying(self, t):
            if t == at:
                fault()
            return run_round(self, t)
        worker.run_round = dying
    sys.exit(main(sys.argv[1:]))
    """
)


def launch(
    tmp_path: Path, monkeypatch, fault: str, alg: str, launcher=(), extra=(), leader: int = 1
) -> tuple[int, str, float]:
    script = tmp_path / "inject.py"
    monkeypatch.setenv("LEADER", str(leader))
    script.write_text(INJECT)
    monkeypatch.setenv("FAULT", fault)
    monkeypatch.setenv("FAULT_DONE", str(tmp_path / "fault.done"))
    monkeypatch.setenv("ALG", alg)
    target = [str(script), *TINY, f"algorithm.name={alg}", f"job.out_dir={tmp_path / 'run'}", *extra]
    return torchrun(3, target, timeout=300, launcher=tuple(launcher))


SFL = ["data.train_max_samples=240", "train.budget_samples=600", "checkpoint.interval_samples=120"]
"""SFL's round is a local epoch of K=3 clients (40 samples each): five rounds of 120 samples."""
RUNS = {"hosfl": (5, 10, []), "sfl": (1, 5, SFL)}
"""algorithm -> (the round during which the launcher gets SIGTERM, the rounds of the run, its overrides)."""


@pytest.mark.parametrize("alg", ["hosfl", pytest.param("sfl", marks=pytest.mark.slow)])  # 40 s each
def test_sigterm_to_the_launcher_checkpoints_and_a_resume_finishes_identically(tmp_path, monkeypatch, references, alg):
    at, rounds, extra = RUNS[alg]
    rc, out, _ = launch(tmp_path, monkeypatch, f"term:{at}", alg, extra=extra)
    assert rc != 0, out[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted", (summary, out[-3000:])
    t = summary["rounds"]  # the first round boundary after the signal reached every worker
    assert at < t < rounds and summary["error"] == f"SIGTERM after round {t}"
    assert summary["checkpoint"].endswith(f"round-{t:08d}")
    assert f"[server] interrupted: SIGTERM after round {t}" in out
    # every rank ended by itself inside torchrun's 30 s stop wait: one that outlived it would have been killed, and
    # torchrun says so (a time limit from the launch would count the machine's load, start-up included)
    assert "closing signal SIGTERM" in out and "Unable to shutdown process" not in out, out[-3000:]
    rc, out, _ = launch(tmp_path, monkeypatch, f"term:{at}", alg, extra=[*extra, "job.resume=auto"])
    assert rc == 0, out[-3000:]
    summary = assert_same_as(tmp_path / "run", references(alg, extra))
    assert summary["resumed_from"].endswith(f"round-{t:08d}")


@pytest.mark.slow  # about 60 s each: torchrun waits 30 s for the survivors before it kills them and restarts
@pytest.mark.parametrize("rank", [2, 1, 0], ids=["worker", "leader", "server"])
def test_a_lost_rank_is_restarted_from_the_checkpoint_and_finishes_identically(tmp_path, monkeypatch, references, rank):
    rc, out, _ = launch(tmp_path, monkeypatch, f"kill:{rank}:7", "hosfl", launcher=["--max-restarts=1"])
    assert rc == 0, out[-3000:]
    assert (tmp_path / "fault.done").exists()  # the fault did happen
    assert "resuming from" in out and "round-00000006 (round 6, 144 samples)" in out
    summary = assert_same_as(tmp_path / "run", references("hosfl", []))
    assert summary["resumed_from"].endswith("round-00000006")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "round-00000008",
        "round-00000010",
    ]  # checkpoint.keep=2


@pytest.mark.slow  # about 40 s
def test_an_fsdp_server_group_checkpoints_its_shards_and_resumes_identically(tmp_path, monkeypatch):
    """server.ranks=2: each server rank writes its FSDP shard of θs and the optimizer through DCP; resumed, the run
    equals an uninterrupted run of the same 2-rank server group bit for bit (the data-parallel group itself equals
    the one-process run only to float rounding: tests/test_distributed.py)."""
    s2 = ["server.ranks=2"]
    ref = tmp_path / "ref"
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY, "algorithm.name=hosfl", *s2, f"job.out_dir={ref}"])
    assert rc == 0, out[-3000:]
    rc, out, _ = launch(tmp_path, monkeypatch, "term:5", "hosfl", extra=s2, leader=2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert rc != 0 and summary["status"] == "interrupted", (summary, out[-3000:])
    shards = sorted(p.name for p in Path(summary["checkpoint"], "model").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one file per server rank
    rc, out, _ = launch(tmp_path, monkeypatch, "term:5", "hosfl", extra=[*s2, "job.resume=auto"], leader=2)
    assert rc == 0, out[-3000:]
    summary = assert_same_as(tmp_path / "run", read_run(ref))
    assert summary["roles"]["server_ranks"] == [0, 1]
