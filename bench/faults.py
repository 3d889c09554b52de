"""The fault table: real signals to a running torchrun job, and what became of the run.

Each case starts ``torchrun`` (1 server + 2 client workers by default), waits until the job has written its first
checkpoint, then delivers one fault from outside, as an operator, the kernel or Slurm would:

- SIGKILL a client worker / the leader worker / the server, under ``--max-restarts=1``: torchrun restarts the job,
  which resumes from the last checkpoint;
- SIGTERM to the launcher (what Slurm sends) and SIGINT to the whole process group (Ctrl-C): every process stops at
  the next round boundary with a checkpoint; a second launch with ``job.resume=auto`` finishes the run;
- SIGSTOP a client worker under ``--max-restarts=1`` with a short ``server.rpc_timeout_s``: the server's wait runs
  out, the job fails, torchrun restarts it and it resumes.

For every case it prints how long the processes took to go after the fault (stop cases), the summary.json status
then and at the end, and whether the final digests and metrics rows equal an uninterrupted run of the same config.

    python bench/faults.py                      # quickstart-sized run, all cases, results/faults/
    python bench/faults.py --cases kill_worker sigterm train.budget_samples=6400
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dist_bench import torchrun_cmd  # run as a script: bench/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = [
    "train.budget_samples=12800",
    "train.eval_every_samples=3200",
    "checkpoint.interval_samples=1280",
    "job.progress=false",
]
CASES = ("kill_worker", "kill_leader", "kill_server", "sigterm", "sigint", "sigstop_worker")


def launch(nproc: int, overrides: list[str], restarts: int, log: Path) -> subprocess.Popen:
    cmd = torchrun_cmd(nproc, [f"--max-restarts={restarts}", "-m", "hosfl_dist.run", *overrides])
    out = log.open("a")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (read from /proc: their RANK variable)."""
    out = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(next(x for x in status.read_text().splitlines() if x.startswith("PPid:")).split()[1])
            if ppid != launcher:
                continue
            env = (status.parent / "environ").read_bytes().split(b"\0")
            rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
            out[rank] = int(status.parent.name)
        except (OSError, StopIteration, ValueError):
            continue
    return out


def alive(pids: list[int]) -> bool:
    for pid in pids:
        try:
            state = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("State:"))
            if "Z" not in state:
                return True
        except (OSError, StopIteration):
            continue
    return False


def summary(out: Path) -> dict:
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def rows(out: Path) -> list[dict]:
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in got:
        r.pop("wall_time_s", None)
    return got


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if any(p.is_dir() and not p.name.endswith(".partial") for p in (out / "checkpoints").glob("round-*")):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (rc {proc.returncode}) before its first checkpoint")
        time.sleep(0.2)
    raise RuntimeError("no checkpoint within the time limit")


def run_case(case: str, args: argparse.Namespace, base: list[str], work: Path) -> dict:
    out, log = work / case, work / f"{case}.log"
    over = [*base, f"job.out_dir={out}"]
    restarts = 1 if case.startswith(("kill", "sigstop")) else 0
    if case == "sigstop_worker":
        over.append(f"server.rpc_timeout_s={args.stop_timeout}")
    proc = launch(args.nproc, over, restarts, log)
    wait_for_checkpoint(out, proc)
    pids = ranks(proc.pid)
    victim = {"kill_worker": 2, "kill_leader": 1, "kill_server": 0, "sigstop_worker": 2}.get(case)
    fault_at = time.monotonic()
    if case == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    elif case == "sigint":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(pids[victim], signal.SIGSTOP if case == "sigstop_worker" else signal.SIGKILL)
    row: dict = {"case": case, "last_checkpoint": latest(out)}
    gone, status = None, None
    while proc.poll() is None:
        if gone is None and not alive(list(pids.values())):
            gone = time.monotonic() - fault_at  # every process of the first attempt has exited
            status = summary(out).get("status")
        time.sleep(0.1)
    row["first_attempt_gone_s"] = round(gone if gone is not None else time.monotonic() - fault_at, 1)
    row["launcher_rc"] = proc.returncode
    row["status_after_fault"] = status or summary(out).get("status")
    if case in ("sigterm", "sigint"):
        row["interrupted_at"] = summary(out).get("checkpoint")
        resumed = launch(args.nproc, [*over, "job.resume=auto"], 0, log)
        resumed.wait()
        row["resume_rc"] = resumed.returncode
    else:
        row["restarted"] = "resuming from" in log.read_text()
    final = summary(out)
    row["final_status"] = final.get("status")
    row["resumed_from"] = Path(final.get("resumed_from") or "").name or None
    row["wall_s"] = round(time.monotonic() - fault_at, 1)
    return row


def latest(out: Path) -> str | None:
    done = sorted(p.name for p in (out / "checkpoints").glob("round-*") if not p.name.endswith(".partial"))
    return done[-1] if done else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--stop-timeout", type=float, default=20.0, help="server.rpc_timeout_s of the SIGSTOP case")
    p.add_argument("--work", default="/tmp/hosfl-faults", help="where the runs go (replaced)")
    p.add_argument("--results", default="results/faults")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    work = Path(args.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    base = ["--config", args.config, *DEFAULTS, *args.overrides]
    ref_out = work / "reference"
    ref = launch(args.nproc, [*base, f"job.out_dir={ref_out}"], 0, work / "reference.log")
    ref.wait()
    reference = summary(ref_out)
    assert reference.get("status") == "completed", (work / "reference.log").read_text()[-3000:]
    table = []
    for case in args.cases:
        row = run_case(case, args, base, work)
        final = summary(work / case)
        row["digests_equal"] = final.get("server_digest") == reference["server_digest"] and set(
            final.get("client_digests", {}).values()
        ) == set(reference["client_digests"].values())
        row["rows_equal"] = final.get("status") == "completed" and rows(work / case) == rows(ref_out)
        row["comm_equal"] = final.get("comm") == reference["comm"]
        print(json.dumps(row), flush=True)
        table.append(row)
    results = ROOT / args.results
    results.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/faults.py", *sys.argv[1:]])
    record = {"command": command, "config": base, "reference_rounds": reference["rounds"], "cases": table}
    (results / "faults.json").write_text(json.dumps(record, indent=2) + "\n")
    cols = list(dict.fromkeys(k for r in table for k in r))
    lines = [f"`{command}` ({reference['rounds']} rounds uninterrupted)", "", "| " + " | ".join(cols) + " |"]
    lines.append("|" + "---|" * len(cols))
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in table]
    (results / "faults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
