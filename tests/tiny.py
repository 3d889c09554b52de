"""What the tests share: the tiny synthetic-data run, and a torchrun launcher for the multi-process tiers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.config import Config, load_config
from hosfl_dist.models import SplitModel
from hosfl_dist.runtime.build import method_config
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.runtime.server_compute import GroupCompute

TINY_OVERRIDES = [
    "data.name=synthetic",
    "model.name=small_cnn",
    "model.width=4",
    "split.cut=1",
    "clients.total=6",
    "clients.per_round=3",
    "clients.batch_size=8",
    "zo.num_perturbations=3",
    "clients.optim.lr=1e-2",
    "server.optim.lr=1e-2",
    "train.budget_samples=240",
    "train.eval_every_samples=120",
    "train.eval_batch_size=250",
    "job.progress=false",
    "job.plots=false",  # curves.png costs ~0.3 s a run; tests/test_run_dir.py draws it
]


def runner(overrides: list[str]) -> InProcessRunner:
    """An in-process runner set up (data, model, server, worker built) but not trained."""
    return InProcessRunner(load_config(None, overrides)).setup()


def server_of(cfg: Config, split: SplitModel, cls: type | None = None) -> Any:
    """The method's server (``cls``, or the registry's for ``algorithm.name``) over ``split``, on one rank."""
    cls = cls or get_algorithm(cfg.algorithm.name).server
    return cls(method_config(cfg), split, GroupCompute(split.server, split.task, cfg.server))


def run_in_process(overrides: list[str]) -> tuple[Config, InProcessRunner, dict[str, Any], list[dict[str, Any]]]:
    """Train with the in-process runtime; return (config, runner, summary, metrics rows)."""
    r = runner(overrides)
    summary = r.run()
    rows = [json.loads(line) for line in Path(r.cfg.job.out_dir, "metrics.jsonl").read_text().splitlines()]
    return r.cfg, r, summary, rows


ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240


def page_block(marker: str, page: Path = ROOT / "docs" / "python-api.md") -> str:
    """The ```python block of ``page`` that holds ``marker`` (the plug-ins the tests run are the page's)."""
    blocks = [b.split("```")[0] for b in page.read_text().split("```python\n")[1:]]
    (found,) = [b for b in blocks if marker in b]
    return found


def torchrun(
    nproc: int, target: list[str], timeout: float = LAUNCH_TIMEOUT_S, launcher: tuple[str, ...] = ()
) -> tuple[int, str, float]:
    """``torchrun`` with c10d rendezvous on a free port; the process tree is killed if it outlives ``timeout``.
    ``launcher``: more torchrun options (e.g. ``--max-restarts=1``)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        f"--rdzv-id={uuid.uuid4().hex[:8]}",
        *launcher,
        *target,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, time.perf_counter() - start


def run_one_thread(overrides: list[str], config: str | None = None) -> tuple[list[dict], dict]:
    """The in-process run of a config with one intra-op thread, like every torchrun process: the same arithmetic, so
    torchrun's results must equal it bit for bit. Returns :func:`read_run` of its job.out_dir."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(config, overrides)
        InProcessRunner(cfg).setup().run()
    finally:
        torch.set_num_threads(threads)
    return read_run(Path(cfg.job.out_dir))


def read_run(out_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_time_s")
    return rows, json.loads((out_dir / "summary.json").read_text())


def assert_same_as(out: Path, reference: tuple[list[dict], dict]) -> dict:
    """A completed run in ``out`` equals the uninterrupted ``reference`` (:func:`read_run`): digests, every metrics row,
    traffic (for a model-exchanging method, but for the end-of-run fetches, counted as eval), rounds and samples."""
    rows, summary = read_run(out)
    ref_rows, ref = reference
    assert summary["status"] == "completed", summary
    assert set(summary["client_digests"].values()) == set(ref["client_digests"].values())
    assert summary["server_digest"] == ref["server_digest"]
    assert rows == ref_rows  # every row once: those after the checkpoint were dropped and written again
    if summary["algorithm"] == "hosfl":
        assert summary["comm"] == ref["comm"]
    else:  # every client worker fetches θc once more for its end-of-run digest (in-process: one fetch), as "eval"
        assert _without_eval(summary["comm"]) == _without_eval(ref["comm"])
    assert summary["rounds"] == ref["rounds"] and summary["processed_samples"] == ref["processed_samples"]
    return summary


def _without_eval(comm: dict) -> dict:
    return {k: {c: n for c, n in v.items() if c != "eval"} if isinstance(v, dict) else v for k, v in comm.items()}


def rows_of(folder: Path) -> list[dict]:
    """A run's metrics rows without their wall time (what two runs of the same computation share)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_time_s")
    return rows


def stop_at(monkeypatch, alg: str, round_idx: int) -> None:
    """SIGTERM to this process while round ``round_idx`` runs (the runtime stops at the next boundary)."""
    from hosfl_dist.algorithms import get_algorithm

    worker_cls = get_algorithm(alg).worker
    real = worker_cls.run_round

    def run_round(self, t):
        if t == round_idx:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, t)

    monkeypatch.setattr(worker_cls, "run_round", run_round)


# -- the tiny language-model run: a random tiny Llama/OPT on six hand-written reviews or three SQuAD questions --------
SENTENCES = [
    ("a gorgeous, witty, seductive movie.", 1),
    ("the plot is a mess and the acting is worse.", 0),
    ("one of the best films of the year.", 1),
    ("dull, lifeless and far too long.", 0),
    ("a warm and funny delight.", 1),
    ("i wanted my money back.", 0),
]
SQUAD = [
    ("Super Bowl 50 was won by the Denver Broncos.", "Who won Super Bowl 50?", ["Denver Broncos", "Broncos"]),
    ("Paris is the capital of France.", "What is the capital of France?", ["Paris"]),
    ("Water boils at 100 degrees.", "At what temperature does water boil?", ["100 degrees", "100"]),
]


def write_text_files(folder: Path) -> Path:
    """sst2.jsonl (the reviews, columns review / y) and squad.jsonl in ``folder``, each example four times."""
    rows = [{"review": s, "y": y} for _ in range(4) for s, y in SENTENCES]
    (folder / "sst2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sq = [{"context": c, "question": q, "answers": a, "title": ""} for _ in range(4) for c, q, a in SQUAD]
    (folder / "squad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sq))
    return folder


def lm_overrides(out_dir: Path, files: Path, task: str = "sst2", arch: str = "llama", side: str = "right") -> list[str]:
    """Two rounds of K=2 of M=4 clients, LoRA r=2 on a tiny random LM cut after block 2."""
    data = [f"data.train_path={files / f'{task}.jsonl'}", f"data.eval_path={files / f'{task}.jsonl'}"]
    if task == "sst2":
        data.append("data.columns={sentence: review, label: y}")
    return [
        "model.name=hf",
        f"model.source=tiny:{arch}",
        "split.cut=2",
        f"data.name={task}",
        *data,
        "data.max_length=40",
        f"data.padding_side={side}",
        "data.eval_max_samples=6",
        "lora.r=2",
        "clients.total=4",
        "clients.per_round=2",
        "clients.batch_size=4",
        "zo.num_perturbations=2",
        "clients.optim.lr=1e-2",
        "server.optim.lr=1e-2",
        "train.budget_samples=16",
        "train.eval_every_samples=8",
        "train.eval_batch_size=4",
        "job.progress=false",
        "job.plots=false",
        f"job.out_dir={out_dir}",
    ]


USER_MODULE_PREFIX = "hosfl_test_"
"""What the tests' modules are named with (``hosfl_test_mymethod``): no user's ``mymethod.py`` or ``watch.py`` in
the checkout, where the docs have them written, can stand for them."""


def user_module(name: str) -> str:
    """The name a test's module ``name`` (a docs page's ``mymethod``, ``watch``) is written and imported under."""
    return USER_MODULE_PREFIX + name


def user_folder(tmp_path: Path, monkeypatch: Any, modules: dict[str, str]) -> Path:
    """The user's modules (name -> source) in a folder of theirs, each as :func:`user_module` names it (the imports
    of one another renamed too), importable here and by every process started from here (the caller's fixture takes
    them out of ``sys.modules`` and the registries when it ends)."""
    import re

    folder = tmp_path / "user"
    folder.mkdir()
    for name, source in modules.items():
        for other in modules:  # "from myparts import load_blobs" -> "from hosfl_test_myparts import load_blobs"
            source = re.sub(rf"^(\s*(?:from|import)\s+){re.escape(other)}\b", rf"\g<1>{user_module(other)}", source,
                            flags=re.MULTILINE)  # fmt: skip
        (folder / f"{user_module(name)}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))
    return folder
