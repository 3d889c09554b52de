"""The Python API, callbacks and plug-ins (docs/python-api.md): ``hosfl_dist.train`` runs as ``python -m
hosfl_dist.run`` does in one process and leaves the process as it found it; callbacks are called by the process that
owns each event, in one process and under torchrun, and one that raises fails the run in one line with its rows kept;
a method in the user's own module (``--plugin``, ``job.plugins``) runs in one process, under torchrun, in a study, and
``--help-config`` lists it."""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hosfl_dist
from hosfl_dist.config import load_config
from hosfl_dist.errors import ArgumentError, CallbackError, ConfigError
from hosfl_dist.runfolder.identity import comparable_config, fingerprint
from tiny import ROOT, TINY_OVERRIDES, page_block, read_run, rows_of, torchrun, user_folder, user_module

PLUGIN = page_block('register(AlgorithmSpec("my_method"')
MINE, WATCHED = user_module("mymethod"), user_module("watch")
"""The page's mymethod.py and this file's watch.py, as the tests write and import them (no user's file of the page's
name in the checkout stands for them)."""
"""The method written outside the repository, as the page shows it (architecture.md's "Adding a method" links it)."""

WATCH = '''
"""Callbacks that write what they saw to events.jsonl beside the run, one line per call (pid and event)."""
import json, os
from pathlib import Path

import hosfl_dist


class Log(hosfl_dist.Callback):
    def __init__(self):
        self.path = None

    def write(self, event, value):
        folder = self.path or Path(os.environ["EVENTS_DIR"])
        with open(folder / "events.jsonl", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "value": value}) + "\\n")

    def on_train_start(self, run):
        self.write("on_train_start", str(run.out_dir))

    def on_round_end(self, round, info):
        self.write("on_round_end", [round, info["processed"]])

    def on_evaluate(self, row):
        self.write("on_evaluate", row)

    def on_checkpoint(self, path):
        self.write("on_checkpoint", path)

    def on_train_end(self, summary):
        self.write("on_train_end", summary["status"])


class Boom(hosfl_dist.Callback):
    def on_evaluate(self, row):
        if row["round"] > 0:
            raise ValueError("boom")


class EndBoom(hosfl_dist.Callback):
    def on_train_end(self, summary):
        raise ValueError("boom at the end")


class Quit(hosfl_dist.Callback):
    def on_evaluate(self, row):
        if row["round"] > 0:
            import sys
            sys.exit(0)


class CtrlC(hosfl_dist.Callback):
    def on_evaluate(self, row):
        if row["round"] > 0:
            raise KeyboardInterrupt
'''


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """mymethod.py and watch.py in a folder of the user's (as :data:`MINE` and :data:`WATCHED`), importable here and by
    every process started from here."""
    folder = user_folder(tmp_path, monkeypatch, {"mymethod": PLUGIN, "watch": WATCH})
    monkeypatch.setenv("EVENTS_DIR", str(tmp_path))
    yield folder
    from hosfl_dist import algorithms

    algorithms._REGISTRY.pop("my_method", None)  # the registry lists the package's methods to the other tests
    for name in (MINE, WATCHED):
        sys.modules.pop(name, None)


TINY_YAML = textwrap.dedent("""\
    data: {name: synthetic}
    model: {name: small_cnn, width: 4}
    split: {cut: 1}
    clients: {total: 6, per_round: 3, batch_size: 8}
    zo: {num_perturbations: 3}
    train: {budget_samples: 240, eval_every_samples: 120}
    job: {progress: false, plots: false}
""")


def events(folder: Path) -> list[dict]:
    path = folder / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_command(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hosfl_dist.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


class Rows(hosfl_dist.Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_train_start(self, run):
        self.calls.append(("start", run))

    def on_round_end(self, round, info):  # noqa: A002 - the callback's own name for it
        self.calls.append(("round", round, info))

    def on_evaluate(self, row):
        self.calls.append(("row", row))

    def on_checkpoint(self, path):
        self.calls.append(("checkpoint", path))

    def on_train_end(self, summary):
        self.calls.append(("end", summary))


# -- the Python API ------------------------------------------------------------------------------------------------
def test_import_hosfl_dist_stays_light():
    code = "import sys, hosfl_dist; hosfl_dist.Callback, hosfl_dist.load_run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        hosfl_dist.trian  # noqa: B018


def test_train_runs_as_the_command_does_calls_the_callbacks_and_restores_the_process(tmp_path):
    rows = Rows()
    log = logging.getLogger("hosfl_dist")
    handlers, level, threads = list(log.handlers), log.level, torch.get_num_threads()
    sigterm = signal.getsignal(signal.SIGTERM)
    run = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'api'}"], callbacks=[rows])
    assert (log.handlers, log.level, torch.get_num_threads()) == (handlers, level, threads)
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert run.out_dir == tmp_path / "api" and run.summary["status"] == "completed" and len(run.metrics) == 3

    kinds = [c[0] for c in rows.calls]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("round") == run.summary["rounds"] == 10
    assert [c[1] for c in rows.calls if c[0] == "row"] == run.metrics  # the rows as written
    assert [c[1] for c in rows.calls if c[0] == "checkpoint"] == [str(tmp_path / "api/checkpoints/round-00000010")]
    assert rows.calls[-1][1] == run.summary and rows.calls[0][1].out_dir == run.out_dir
    first = next(c for c in rows.calls if c[0] == "round")
    assert first[1] == 1 and first[2]["processed"] == first[2]["samples"] == 24 and first[2]["seconds"] > 0

    loaded = hosfl_dist.load_run(tmp_path / "api")
    assert loaded.summary == run.summary and loaded.metrics == run.metrics
    command = run_command(*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'cli'}")  # the command computes the same
    assert command.returncode == 0, command.stderr
    assert rows_of(tmp_path / "cli") == rows_of(tmp_path / "api")
    again = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'api'}", "job.resume=auto"])
    assert again.out_dir == run.out_dir and again.metrics == run.metrics  # completed already: returned as it is


def test_train_takes_a_config_tree_with_overrides_and_raises_on_bad_input(tmp_path):
    cfg = load_config(None, TINY_OVERRIDES)
    run = hosfl_dist.train(cfg, ["train.budget_samples=48", f"job.out_dir={tmp_path / 'a'}"])
    assert run.summary["processed_samples"] == 48
    with pytest.raises(ConfigError, match="zo.num_perturbationz"):
        hosfl_dist.train(cfg, ["zo.num_perturbationz=2"])
    with pytest.raises(ConfigError, match="not a run's folder"):
        hosfl_dist.load_run(tmp_path)


def test_the_api_refuses_an_argument_of_the_wrong_type_in_one_line_before_building_anything(tmp_path):
    out = f"job.out_dir={tmp_path / 'x'}"
    for call, said in (
        (lambda: hosfl_dist.train(123), "hosfl_dist.train: config must be a YAML file's path (str or pathlib.Path), "
                                        "a hosfl_dist.config.Config or None, not int (123)"),
        (lambda: hosfl_dist.train(None, [out, 1, 2]), "hosfl_dist.train: overrides[1] must be a str"),
        (lambda: hosfl_dist.train(None, "train.budget_samples=48"), "overrides must be a list of 'section.key=value' "
                                                                     "strings"),
        (lambda: hosfl_dist.train(None, {"train.budget_samples": 48}), "overrides must be a list"),
        (lambda: hosfl_dist.train(None, [out], plugins="mymethod"), "plugins must be a list of module names"),
        (lambda: hosfl_dist.train(None, [out], callbacks=[object()]), "callbacks[0] is not a hosfl_dist.Callback "
                                                                      "instance or a 'module:Class' name: object"),
        (lambda: hosfl_dist.train(None, [out], callbacks=[Rows]), "(a class: pass an instance, Rows())"),
        (lambda: hosfl_dist.train(None, [out], callbacks=Rows()), "callbacks must be a list"),
        (lambda: hosfl_dist.train(None, [out], callbacks=[Rows(), 7]), "callbacks[1] is not a hosfl_dist.Callback"),
        (lambda: hosfl_dist.load_run(123), "load_run: out_dir must be a run's folder as a str or a pathlib.Path, "
                                           "not int (123)"),
        (lambda: hosfl_dist.Run(None), "Run: out_dir must be a run's folder"),
    ):
        with pytest.raises(ArgumentError) as exc:
            call()
        assert said in str(exc.value) and "\n" not in str(exc.value), exc.value
        assert isinstance(exc.value, TypeError) and isinstance(exc.value, ConfigError)
    assert not (tmp_path / "x").exists()  # refused before anything was built or written
    with pytest.raises(ConfigError, match=r"job.callbacks: cannot import 'nosuch:Thing' \(ModuleNotFoundError"):
        hosfl_dist.train(None, [out], callbacks=["nosuch:Thing"])


# -- callbacks -----------------------------------------------------------------------------------------------------
def test_callbacks_given_by_name_are_built_as_job_callbacks_are(tmp_path, user_modules):
    run = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'api'}"], callbacks=[f"{WATCHED}:Log"])
    seen = [e["event"] for e in events(tmp_path)]
    assert seen[0] == "on_train_start" and seen[-1] == "on_train_end" and seen.count("on_round_end") == 10
    assert load_config(run.out_dir / "config.yaml").job.callbacks == [f"{WATCHED}:Log"]


def test_a_callback_that_fails_after_the_end_leaves_the_record_as_it_was(tmp_path, user_modules):
    watch = importlib.import_module(WATCHED)

    reference = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'ref'}"]).summary
    run = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'api'}"], callbacks=[watch.EndBoom()])
    summary = run.summary
    assert summary["status"] == "completed" and summary["callback_error"] == END_BOOM
    for key in ("final", "client_digests", "server_digest", "comm", "participation", "rounds", "processed_samples"):
        assert summary[key] == reference[key], key  # nothing of the completed record dropped


@pytest.mark.parametrize("event", ["on_train_start", "on_round_end", "on_evaluate", "on_checkpoint", "on_train_end"])
def test_a_callback_that_raises_at_any_event_is_one_line_and_only_the_end_keeps_a_completed_record(tmp_path, event):
    def raises(self, *args, **kwargs):
        raise ValueError(f"no {event}")

    cb = type("Raises", (hosfl_dist.Callback,), {event: raises})()
    out = tmp_path / "run"
    said = f"callback {__name__}:Raises.{event} raised ValueError: no {event}"
    if event == "on_train_end":
        run = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={out}"], callbacks=[cb])
        assert run.summary["status"] == "completed" and run.summary["callback_error"] == said
        return
    with pytest.raises(CallbackError) as exc:
        hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={out}"], callbacks=[cb])
    assert str(exc.value) == said
    summary = read_run(out)[1]
    assert summary["status"] == "failed" and summary["error"].endswith(said) and "callback_error" not in summary


END_BOOM = f"callback {WATCHED}:EndBoom.on_train_end raised ValueError: boom at the end"
QUIT = (f"callback {WATCHED}:Quit.on_evaluate raised SystemExit(0) (sys.exit ends the process, not the run: a callback "
        "ends a run with control.should_training_stop = True)")  # fmt: skip
AT_ONCE = "KeyboardInterrupt after round 5: stopped at once, without a checkpoint of its own"


def test_sys_exit_and_keyboard_interrupt_in_a_callback_end_the_run_as_the_record_says(tmp_path, user_modules):
    watch = importlib.import_module(WATCHED)

    with pytest.raises(CallbackError) as exc:
        hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'quit'}"], callbacks=[watch.Quit()])
    assert str(exc.value) == QUIT
    rows, summary = read_run(tmp_path / "quit")
    assert summary["status"] == "failed" and summary["error"].endswith(QUIT) and [r["round"] for r in rows] == [0, 5]

    with pytest.raises(KeyboardInterrupt):  # what Ctrl-C raises, wherever from: the run stops at once
        hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'ctrl_c'}"], callbacks=[watch.CtrlC()])
    rows, summary = read_run(tmp_path / "ctrl_c")
    assert summary["status"] == "interrupted" and summary["error"] == AT_ONCE and summary["rounds"] == 5
    assert summary["checkpoint"] is None and [r["round"] for r in rows] == [0, 5]  # the folder holds none


@pytest.mark.slow  # three runs of the command: 35 s on the 2-core machine
def test_the_command_says_what_the_record_says_of_a_callback_that_exits_interrupts_or_fails_after_the_end(
    tmp_path, user_modules
):
    res = run_command(*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'end'}", f"job.callbacks=[{WATCHED}:EndBoom]")
    assert res.returncode == 0, res.stderr  # the record says completed: so does the exit code
    told = [line for line in res.stderr.splitlines() if "EndBoom" in line]
    assert told == [f"{END_BOOM}, after the run had ended: summary.json keeps status completed, with this error as "
                    "callback_error"]  # fmt: skip
    assert res.stdout.startswith("done: 10 rounds") and read_run(tmp_path / "end")[1]["callback_error"] == END_BOOM

    res = run_command(*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'quit'}", f"job.callbacks=[{WATCHED}:Quit]")
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == f"error: {QUIT}"
    assert read_run(tmp_path / "quit")[1]["status"] == "failed"

    res = run_command(*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'ctrl_c'}", f"job.callbacks=[{WATCHED}:CtrlC]")
    assert res.returncode == 130
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted: the run hosfl (job.out_dir={tmp_path / 'ctrl_c'}) stopped at once by "
                           "KeyboardInterrupt (Ctrl-C), without a checkpoint of its own")  # fmt: skip
    assert read_run(tmp_path / "ctrl_c")[1]["error"] == AT_ONCE


def test_a_callback_that_raises_fails_the_run_in_one_line_and_keeps_its_rows(tmp_path, user_modules):
    import importlib

    watch = importlib.import_module(WATCHED)

    out = tmp_path / "api"
    with pytest.raises(CallbackError, match=rf"callback {WATCHED}:Boom.on_evaluate raised ValueError: boom"):
        hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={out}"], callbacks=[watch.Boom()])
    rows, summary = read_run(out)
    assert summary["status"] == "failed"
    assert summary["error"].endswith(f"{WATCHED}:Boom.on_evaluate raised ValueError: boom")
    assert [r["round"] for r in rows] == [0, 5]  # the row the callback saw is written, nothing after it

    res = run_command(*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'cli'}", f"job.callbacks=[{WATCHED}:Boom]")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == f"error: callback {WATCHED}:Boom.on_evaluate raised ValueError: boom"
    assert json.loads((tmp_path / "cli/summary.json").read_text())["status"] == "failed"


def test_callbacks_and_plugins_that_cannot_be_imported_are_one_line_exit_2(tmp_path, user_modules):
    for args, said in (
        (["--plugin", "nosuchmodule"], "error: job.plugins: cannot import plug-in 'nosuchmodule' (ModuleNotFoundError"),
        ([f"job.callbacks=[{WATCHED}:Nope]"], f"error: job.callbacks: cannot import '{WATCHED}:Nope' (AttributeError"),
        ([f"job.callbacks=[{WATCHED}]"], "error: invalid value for job.callbacks"),
        (["job.callbacks=[json:JSONDecoder]"], "error: job.callbacks: 'json:JSONDecoder' is not a callback class"),
    ):
        res = run_command(*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'x'}", *args, "--check")
        assert res.returncode == 2 and res.stderr.startswith(said) and len(res.stderr.splitlines()) == 1, res.stderr


def test_callbacks_are_not_identity_and_plugins_left_empty_keep_every_earlier_fingerprint():
    base = load_config(None, TINY_OVERRIDES)
    watched = load_config(None, [*TINY_OVERRIDES, f"job.callbacks=[{WATCHED}:Log]"])
    assert comparable_config(watched) == comparable_config(base)
    assert "plugins" not in comparable_config(base)["job"] and "callbacks" not in comparable_config(base)["job"]
    plugged = load_config(None, [*TINY_OVERRIDES, f"job.plugins=[{MINE}]"])
    assert fingerprint({"config": comparable_config(plugged)}) != fingerprint({"config": comparable_config(base)})


# -- plug-ins ------------------------------------------------------------------------------------------------------
def test_a_method_outside_the_package_runs_by_plugin_and_equals_the_method_it_reuses(tmp_path, user_modules):
    res = run_command("--plugin", MINE, *TINY_OVERRIDES, "algorithm.name=my_method",
                      f"job.out_dir={tmp_path / 'mine'}", f"job.callbacks=[{WATCHED}:Log]")  # fmt: skip
    assert res.returncode == 0, res.stderr
    hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'ref'}"])
    (mine_rows, mine), (ref_rows, reference) = read_run(tmp_path / "mine"), read_run(tmp_path / "ref")
    assert mine["algorithm"] == "my_method" and mine["client_digests"] == reference["client_digests"]
    assert mine_rows == ref_rows
    api = hosfl_dist.train(None, [*TINY_OVERRIDES, "algorithm.name=my_method", f"job.out_dir={tmp_path / 'api'}"],
                           plugins=[MINE])  # fmt: skip
    assert api.summary["algorithm"] == "my_method" and rows_of(api.out_dir) == rows_of(tmp_path / "mine")
    assert set(mine["code"]["plugins"]) == {MINE}  # the plug-in's source is part of the code's identity
    assert load_config(tmp_path / "mine/config.yaml").job.plugins == [MINE]  # a resume imports it too
    seen = [e["event"] for e in events(tmp_path)]
    assert seen[0] == "on_train_start" and seen[-1] == "on_train_end" and seen.count("on_evaluate") == 3

    listed = run_command("--plugin", MINE, "--help-config", "algorithm")
    assert listed.returncode == 0 and f"From the plug-ins ({MINE}): my_method" in listed.stdout
    unknown = run_command(*TINY_OVERRIDES, "algorithm.name=my_method", "--check")
    assert unknown.returncode == 2 and "invalid value for algorithm.name: 'my_method'" in unknown.stderr


@pytest.mark.slow  # two torchrun jobs: 16 s on the 2-core machine
def test_a_plugin_method_and_config_callbacks_under_torchrun(tmp_path, user_modules):
    """rank 0 (the front) sees the start, the rows, the checkpoint and the end; the leader worker the rounds; the
    run equals the in-process one."""
    out = tmp_path / "dist"
    plugged = ["--plugin", MINE, "algorithm.name=my_method", f"job.callbacks=[{WATCHED}:Log]"]
    rc, log, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY_OVERRIDES, *plugged, f"job.out_dir={out}"])
    assert rc == 0, log[-3000:]
    rows, summary = read_run(out)
    assert summary["status"] == "completed" and summary["algorithm"] == "my_method"
    seen = events(tmp_path)
    by_event = {e["event"]: {x["pid"] for x in seen if x["event"] == e["event"]} for e in seen}
    front = by_event["on_train_start"]
    assert len(front) == 1 and by_event["on_evaluate"] == by_event["on_checkpoint"] == by_event["on_train_end"] == front
    assert len(by_event["on_round_end"]) == 1 and by_event["on_round_end"] != front  # the leader worker's
    assert [e["value"]["round"] for e in seen if e["event"] == "on_evaluate"] == [r["round"] for r in rows]
    assert [e["value"] for e in seen if e["event"] == "on_round_end"][-1] == [10, 240]

    boom = tmp_path / "boom"
    rc, log, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY_OVERRIDES, f"job.callbacks=[{WATCHED}:Boom]",
                              f"job.out_dir={boom}"], timeout=120)  # fmt: skip
    assert rc != 0 and f"[server] error: callback {WATCHED}:Boom.on_evaluate raised ValueError: boom" in log
    assert "Traceback" not in log.split("[server] error")[0]  # no RPC handler's traceback before the one line
    rows, summary = read_run(boom)
    assert summary["status"] == "failed" and [r["round"] for r in rows] == [0, 5]


def test_a_study_runs_a_plugin_method(tmp_path, user_modules):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_YAML)
    res = subprocess.run([sys.executable, "-m", "hosfl_dist.experiments.compare", "--config", str(config),
                          "--methods", "my_method", "--plugin", MINE, "--out", str(tmp_path / "study"),
                          "train.budget_samples=48", "train.eval_every_samples=24"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| my_method |" in res.stdout
    summary = json.loads((tmp_path / "study/runs/my_method/seed0/summary.json").read_text())
    assert summary["status"] == "completed" and summary["algorithm"] == "my_method"


@pytest.mark.slow  # a run in one process and a torchrun job: 20 s on the 2-core machine
def test_the_pages_example_runs_at_the_tiny_size(tmp_path, monkeypatch):
    """docs/python-api.md's watch.py and demo.py as written, with the tiny synthetic config and budget."""
    (tmp_path / "watch.py").write_text(page_block("class Rows"))
    demo = page_block("hosfl_dist.train(CONFIG")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_YAML)
    swapped = demo.replace('CONFIG = "configs/quickstart.yaml"', f'CONFIG = "{config}"')
    swapped = swapped.replace('"train.budget_samples=6000", "train.eval_every_samples=2000"',
                              '"train.budget_samples=240", "train.eval_every_samples=120"')  # fmt: skip
    assert swapped.count(str(config)) == 1 and "budget_samples=240" in swapped
    (tmp_path / "demo.py").write_text(swapped)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    res = subprocess.run([sys.executable, "demo.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    one = next(x for x in lines if x.startswith("one process:"))
    assert one.replace("one process:", "torchrun:") in lines  # the same rows under torchrun
    assert sum(x.startswith("on_evaluate: round") for x in lines) == 6  # 3 rows in each run, each seen once


def test_a_users_file_in_the_folder_a_test_process_starts_in_stands_for_none_of_the_tests_modules(
    tmp_path, monkeypatch
):
    """docs/python-api.md has the user write watch.py and mymethod.py in the checkout, where the tests' processes
    start: the tests' own modules have names no user would choose, and no process a test starts puts its working folder
    (or its script's) first on its import path, so a file there named as a test's module is not what it imports."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("watch", "mymethod", user_module("watch")):  # the user's files, as the docs name them, and worse
        (checkout / f"{name}.py").write_text(f"raise RuntimeError('the user\\'s {name}.py was imported')\n")
    user_folder(tmp_path, monkeypatch, {"watch": "SEEN = 'the test module'\n"})
    try:
        assert user_module("watch") not in ("watch", "mymethod") and (tmp_path / "user" / f"{WATCHED}.py").is_file()
        for argv in (["-c", f"import {WATCHED}; print({WATCHED}.SEEN)"], ["-m", WATCHED]):
            done = subprocess.run([sys.executable, *argv], cwd=checkout, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr[-1000:]
        done = subprocess.run([sys.executable, "-c", "import sys; print(sys.path[0])"], cwd=checkout,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.stdout.strip() not in ("", str(checkout))
    finally:
        sys.modules.pop(WATCHED, None)
