"""The experiment suite: grids and overrides (pure), and compare/sweep end to end on a tiny synthetic setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.errors import ConfigError
from hosfl_dist.experiments import compare, runs, sweep
from hosfl_dist.experiments.report import (
    PAPER_CATEGORIES,
    best_metric,
    curve,
    mean_std,
    metric_figure,
    row_labels,
    summarize,
    traffic_figure,
    write_table,
)
from hosfl_dist.experiments.cli import parse_list
from hosfl_dist.experiments.runs import RunData, RunSpec, resolve

REPO = Path(__file__).resolve().parents[1]

TINY = """\
# python -m hosfl_dist.run --config tiny.yaml
data: {name: synthetic, train_max_samples: 240}
model: {name: small_cnn, width: 4}
clients: {total: 6, per_round: 3, batch_size: 8, optim: {lr: 1.0e-2}}
server: {optim: {lr: 1.0e-2}}
zo: {num_perturbations: 2}
train: {budget_samples: 240, eval_every_samples: 120, eval_batch_size: 500}
"""


def test_grid_is_the_product_of_the_grids():
    points = sweep.grid_points(["zo.num_perturbations=1,5", "split.cut=1,2"])
    assert points == [
        ["zo.num_perturbations=1", "split.cut=1"],
        ["zo.num_perturbations=1", "split.cut=2"],
        ["zo.num_perturbations=5", "split.cut=1"],
        ["zo.num_perturbations=5", "split.cut=2"],
    ]
    with pytest.raises(ConfigError, match="not of the form"):
        sweep.grid_points(["zo.mu"])
    with pytest.raises(ConfigError, match="names a key twice"):
        sweep.grid_points(["zo.mu=1", "zo.mu=2"])
    with pytest.raises(ConfigError, match="not int"):
        parse_list("0,x", "--seeds", int)


def test_method_overrides_apply_paper_defaults_then_sets_then_method_sets():
    args = compare.parse_args(
        ["--config", "c.yaml", "--out", "o", "--methods", "hosfl,mu_splitfed", "--set", "zo.mu=0.01"]
        + ["--method-set", "mu_splitfed:clients.optim.lr=0.1"]
    )
    got = compare.method_overrides(args, ["hosfl", "mu_splitfed"])
    assert got["hosfl"] == ["algorithm.name=hosfl", "zo.mu=0.01"]
    mu = got["mu_splitfed"]
    assert mu[0] == "algorithm.name=mu_splitfed" and mu[-2:] == ["zo.mu=0.01", "clients.optim.lr=0.1"]
    assert "clients.optim.lr=0.005" in mu and mu.index("clients.optim.lr=0.005") < mu.index("clients.optim.lr=0.1")
    args.method_set = ["sfl:zo.mu=1"]
    with pytest.raises(ConfigError, match="not one of --methods"):
        compare.method_overrides(args, ["hosfl"])


def test_curves_average_seeds_on_common_points():
    def run(seed, pts):
        rows = [{"processed_samples": x, "eval_accuracy": y} for x, y in pts]
        return RunData(RunSpec("m", seed, [], None), rows, {})

    x, mean, std = curve([run(0, [(0, 0.1), (100, 0.5)]), run(1, [(0, 0.3), (50, 0.5), (110, 0.7)])], "eval_accuracy")
    assert x.tolist() == [0, 100]
    np.testing.assert_allclose(mean, [0.2, (0.5 + 0.5 + 0.2 * 50 / 60) / 2])
    assert std[0] == pytest.approx(np.std([0.1, 0.3], ddof=1))
    assert mean_std([0.5]) == (0.5, 0.0)


def finish_in_process(config, specs):
    """Run specs in this process (fast: no interpreter start-up) exactly as the runner would have."""
    for spec in specs:
        InProcessRunner(resolve(str(config), spec)).setup().run()


def test_compare_writes_the_report_and_reuses_finished_runs(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "cmp"
    argv = ["--config", str(cfg), "--methods", "hosfl,sfl", "--seeds", "0,1", "--out", str(out)]
    specs, _, _ = compare.build(compare.parse_args(argv))
    finish_in_process(cfg, [s for v in specs.values() for s in v])
    assert compare.main(argv) == 0
    said = capsys.readouterr().out.splitlines()
    reusing = [line for line in said if line.startswith("reusing ")]
    assert reusing[0] == f"reusing {out / 'runs/hosfl/seed0'} (completed, same identity: config and inputs)"
    assert len(reusing) == 4 and said[-1].endswith(f" s; 0 run(s) launched (0.0 s), 4 reused -> {out}")
    for name in ("table.md", "table.json", "accuracy.png", "traffic.png"):
        assert (out / name).stat().st_size > 0, name
    table = json.loads((out / "table.json").read_text())
    assert table["this_invocation"]["launched"] == [] and len(table["this_invocation"]["reused"]) == 4
    assert [r["variant"] for r in table["rows"]] == ["hosfl", "sfl"]
    assert all(r["seeds"] == [0, 1] and len(r["final"]) == 2 for r in table["rows"])
    assert table["traffic_ratio_hosfl_over_sfl"] > 0
    assert "Traffic ratio HO-SFL / SFL" in (out / "table.md").read_text()
    assert all(len(r["best"]) == 2 and all(b >= f for b, f in zip(r["best"], r["final"])) for r in table["rows"])

    # a sweep whose first point is already done and whose second is launched as a subprocess
    sw = tmp_path / "sweep"
    argv = ["--config", str(cfg), "--grid", "zo.num_perturbations=1,3", "--out", str(sw)]
    specs, _, _ = sweep.build(sweep.parse_args(argv))
    finish_in_process(cfg, specs["zo.num_perturbations=1"])
    capsys.readouterr()
    assert sweep.main(argv) == 0
    launched = sw / "runs" / "zo.num_perturbations=3" / "seed0"
    said = capsys.readouterr().out
    assert f"[start] zo.num_perturbations=3 seed 0 (1/1): log {launched / 'log.txt'}" in said  # named before it runs
    log = (launched / "log.txt").read_text()
    assert " samples (100%)" in log and ": evaluating round 10 (final)" in log  # its progress, in its log file
    assert "budget reached" in runs.last_progress(launched / "log.txt")  # what the study shows of a running point
    table = json.loads((sw / "table.json").read_text())
    assert len(table["this_invocation"]["launched"]) == 1 and len(table["this_invocation"]["reused"]) == 1
    rows = table["rows"]
    assert [r["variant"] for r in rows] == ["zo.num_perturbations=1", "zo.num_perturbations=3"]
    assert rows[0]["comm_bytes"]["uplink_scalars"] * 3 == rows[1]["comm_bytes"]["uplink_scalars"]  # P scalars each
    md = (sw / "table.md").read_text()
    assert "| zo.num_perturbations | final eval_accuracy (%) | best eval_accuracy (%) | n seeds |" in md
    assert "| 3 | " in md and "±" not in md.split("\n\n")[1]  # one seed per row: no spread in the table

    assert compare.main(["--config", str(cfg), "--methods", "sfl", "--out", str(out), "--set", "zo.mu=0"]) == 2
    assert "zo.mu" in capsys.readouterr().err


def fake_run(seed: int, accs: list[float], with_best: bool = False, variant: str = "hosfl") -> RunData:
    """A finished run without running it: one evaluation row per round, and the summary fields the report reads."""
    rows = [{"round": i + 1, "processed_samples": 100 * (i + 1), "eval_accuracy": a} for i, a in enumerate(accs)]
    if with_best:  # as the runner writes them: the running best and the first round that reached it
        for i, row in enumerate(rows):
            best = max(range(i + 1), key=lambda j: (accs[j], -j))
            row.update(best_eval_accuracy=accs[best], best_round=best + 1)
    comm = {c: 1000.0 * (k + 1) for k, c in enumerate(PAPER_CATEGORIES)}
    summary = {"comm": {"bytes": comm}, "processed_samples": 100 * len(accs), "wall_time_s": 1.0}
    return RunData(RunSpec(variant, seed, [], Path(f"runs/{variant}/seed{seed}")), rows, summary)


def test_a_running_point_shows_its_newest_progress_line_once(tmp_path, monkeypatch):
    """The watcher says a running point's newest progress line, each new line once, and nothing after it ended (driven
    by the log's content, not by how long a run takes: a tiny run may end before the first look)."""
    said: list[str] = []
    monkeypatch.setattr(runs, "say", said.append)
    monkeypatch.setattr(runs, "WATCH_S", 0.01)
    spec = RunSpec("P=3", 0, [], tmp_path)
    log = tmp_path / "log.txt"

    def wait_for(n: int) -> None:
        for _ in range(6000):  # up to a minute on a loaded machine; returns as soon as the line is there
            if len(said) >= n:
                return
            stop.wait(0.01)
        raise AssertionError(f"the watcher said {said}")

    def write(text: str) -> None:  # whole, as the watcher may look at any moment
        (tmp_path / "log.new").write_text(text)
        (tmp_path / "log.new").replace(log)

    import threading

    stop = threading.Event()
    with runs.Watch(1) as watch:
        watch.started(spec)
        wait_for(1)
        assert said == [f"[start] P=3 seed 0 (1/1): log {log}"]
        write("building\nhosfl: 24/240 samples (10%), 0 s\n")
        wait_for(2)
        stop.wait(0.1)  # several more looks at the same line: said once
        write(log.read_text() + "hosfl: 48/240 samples (20%), 0 s\nnot progress\n")
        wait_for(3)
        watch.ended(spec)
        write(log.read_text() + "hosfl: evaluating round 10 (final) …\n")
        stop.wait(0.1)
    assert said[1:] == [
        "[running] P=3 seed 0: hosfl: 24/240 samples (10%), 0 s",
        "[running] P=3 seed 0: hosfl: 48/240 samples (20%), 0 s",
    ]


def test_best_evaluation_comes_from_the_rows_or_is_the_maximum_over_them():
    accs = [0.2, 0.6, 0.6, 0.5]
    assert best_metric(fake_run(0, accs, with_best=True), "eval_accuracy") == (0.6, 2)
    assert best_metric(fake_run(0, accs), "eval_accuracy") == (0.6, 2)  # rows written before the runner kept it
    run = fake_run(0, accs)
    run.rows[-1]["best_eval_accuracy"], run.rows[-1]["best_round"] = 0.9, 7  # the runner's figure wins
    assert best_metric(run, "eval_accuracy") == (0.9, 7)
    losses = fake_run(0, [])
    losses.rows = [{"round": r, "eval_loss": v} for r, v in ((1, 2.0), (2, 1.5), (3, 1.7))]
    assert best_metric(losses, "eval_loss") == (1.5, 2)  # lower is better for a loss


def test_one_seed_rows_have_no_spread_and_every_row_says_its_seed_count(tmp_path):
    variants = {"hosfl": [fake_run(0, [0.2, 0.8, 0.7])], "sfl": [fake_run(0, [0.5, 0.6]), fake_run(1, [0.8, 0.4])]}
    rows = summarize(variants, "eval_accuracy")
    md = write_table(tmp_path, rows, "eval_accuracy", "t", {})
    table = [line for line in md.splitlines() if line.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[:5] == ["method", "final eval_accuracy (%)", "best eval_accuracy (%)", "n seeds", "processed samples"]
    hosfl = [c.strip() for c in table[2].strip("|").split("|")]
    assert hosfl[:4] == ["HO-SFL", "70.00", "80.00 (round 2)", "1"] and "±" not in table[2]
    sfl = [c.strip() for c in table[3].strip("|").split("|")]
    assert sfl[1:4] == ["50.00 ± 14.14", "70.00 ± 14.14 (rounds 2, 1)", "2"]
    saved = json.loads((tmp_path / "table.json").read_text())
    row = saved["rows"][0]
    assert row["final"] == [0.7] and row["std"] == 0.0  # the keys the table had before stay as they were
    assert row["best"] == [0.8] and row["best_round"] == [2] and row["best_mean"] == 0.8
    assert saved["row_header"] == "method"


def test_a_sweeps_rows_are_headed_by_the_swept_keys():
    assert row_labels(["zo.num_perturbations=1", "zo.num_perturbations=5"]) == ("zo.num_perturbations", ["1", "5"])
    header, cells = row_labels(["zo.mu=1e-4,split.cut=1", "zo.mu=1e-3,split.cut=2"])
    assert header == "zo.mu, split.cut" and cells == ["1e-4, 1", "1e-3, 2"]
    assert row_labels(["hosfl", "mu_splitfed"]) == ("method", ["HO-SFL", "MU-SplitFed"])
    assert row_labels(["model.source=arch:qwen3-0.6b"]) == ("model.source", ["arch:qwen3-0.6b"])


def test_traffic_totals_stay_inside_the_axes_below_the_title():
    rows = summarize({"hosfl": [fake_run(0, [0.5])], "sfl": [fake_run(0, [0.5])]}, "eval_accuracy")
    rows[1].training_total_bytes *= 2  # a taller bar, still < 20x: the stacked (linear) layout
    rows[1].comm_bytes = {c: 2 * v for c, v in rows[1].comm_bytes.items()}
    fig = traffic_figure(rows, "a title as long as the ones compare writes: hosfl, sfl over seeds [0, 1, 2]")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    box, title = ax.get_window_extent(renderer), ax.title.get_window_extent(renderer)
    assert len(ax.texts) == 2
    for text in ax.texts:
        ext = text.get_window_extent(renderer)
        assert ext.y1 <= box.y1 and not ext.overlaps(title), text.get_text()


def test_a_long_title_is_wrapped_inside_the_figure():
    title = "Fine-tuning ResNet-18 (CIFAR-10 0-4 -> 5-9), cut 2 (d_c = 681k), dirichlet, 32k samples, seeds 0-2"
    fig = metric_figure({"hosfl": [fake_run(0, [0.2, 0.5])]}, "eval_accuracy", title)
    fig.canvas.draw()
    (ax,) = fig.axes
    ext = ax.title.get_window_extent(fig.canvas.get_renderer())
    assert "\n" in ax.title.get_text() and ax.title.get_text().replace("\n", " ") == title
    assert ext.x0 >= 0 and ext.x1 <= fig.bbox.width and ext.y1 <= fig.bbox.height


def test_positional_overrides_reach_the_runs_like_set(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    argv = ["zo.mu=0.02", "--config", str(cfg), "--methods", "hosfl", "--out", str(tmp_path / "o"), "--dry-run"]
    assert compare.main([*argv, "--set", "zo.num_perturbations=3", "clients.per_round=2"]) == 0
    (cmd,) = capsys.readouterr().out.splitlines()
    assert cmd.index("zo.num_perturbations=3") < cmd.index("zo.mu=0.02") < cmd.index("clients.per_round=2")
    argv = ["--config", str(cfg), "--grid", "zo.mu=0.01,0.03", "--out", str(tmp_path / "s"), "--dry-run"]
    assert sweep.main([*argv, "zo.num_perturbations=3"]) == 0
    cmds = capsys.readouterr().out.splitlines()
    assert len(cmds) == 2 and all("zo.num_perturbations=3 zo.mu=0.0" in c for c in cmds)
    args = sweep.parse_args([*argv, "--set", "zo.mu=1", "zo.mu=2"])
    assert sweep.plan(args)["zo.mu=0.01"] == ["zo.mu=1", "zo.mu=2", "zo.mu=0.01"]  # --set, positional, grid


@pytest.mark.parametrize("command", ["sweep", "compare"])
def test_a_mistyped_key_is_one_line_before_torch_is_imported(tmp_path, command):
    what = ["--grid", "zo.mu=1e-3"] if command == "sweep" else ["--methods", "hosfl,sfl"]
    cmd = [sys.executable, "-X", "importtime", "-m", f"hosfl_dist.experiments.{command}"]
    cmd += ["--config", "configs/quickstart.yaml", *what, "--out", str(tmp_path / "x"), "zo.foo=1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    said = [line for line in lines if not line.startswith("import time:")]
    assert len(said) == 1 and said[0].startswith("error: ") and "unknown key zo.foo in section zo" in said[0]
    imported = [line.split("|")[-1].strip() for line in lines if line.startswith("import time:")]
    assert imported and not [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert not (tmp_path / "x").exists()


def test_a_finished_run_is_reused_only_while_its_pretrained_file_is_the_same(tmp_path):
    from hosfl_dist.core.digest import file_sha256
    from hosfl_dist.centralized import pretrain
    from hosfl_dist.experiments.runs import command, is_finished

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    weights = tmp_path / "w.pt"
    make = ["--config", str(cfg), "--out", str(weights), "--epochs", "1", "--batch-size", "32"]
    assert pretrain.main(make) == 0
    spec = RunSpec("hosfl", 0, [f"model.pretrained={weights}"], tmp_path / "run")
    finish_in_process(cfg, [spec])
    summary = json.loads((spec.out_dir / "summary.json").read_text())
    recorded = summary["inputs"]["model.pretrained"]
    assert recorded["path"] == str(weights) and recorded["sha256"] == file_sha256(weights)
    run_cfg = resolve(str(cfg), spec)
    assert is_finished(spec, run_cfg) and command(str(cfg), spec, run_cfg)[-1] == "job.resume=auto"

    assert pretrain.main([*make, "job.seed=1"]) == 0  # other weights under the same path: the config is unchanged
    assert not is_finished(spec, run_cfg)
    assert command(str(cfg), spec, run_cfg)[-1] == "job.overwrite=true"


def test_a_point_its_model_cannot_build_stops_the_grid_before_any_run(tmp_path, capsys, monkeypatch):
    """split.cut=5 fits a 28-block model and not a 4-block one: that point is named with its cause, nothing runs; the
    build is checked once per model, not once per value of P."""
    import hosfl_dist.cli.precheck as precheck
    from hosfl_dist.experiments import scaling
    from tiny import lm_overrides, write_text_files

    built = []
    check = precheck.check_build
    monkeypatch.setattr(precheck, "check_build", lambda cfg, world: (built.append(cfg.model.source), check(cfg, world)))
    files = write_text_files(tmp_path)
    sets = [o for o in lm_overrides(tmp_path / "unused", files) if not o.startswith(("job.out_dir", "split.cut"))]
    (tmp_path / "empty.yaml").write_text("{}\n")
    out = tmp_path / "out"
    argv = ["--config", str(tmp_path / "empty.yaml"), "--grid", "model.source=tiny:llama,arch:qwen3-0.6b"]
    argv += ["--grid", "zo.num_perturbations=1,2", "split.cut=5", "--out", str(out)]
    assert scaling.main([*argv, *(x for o in sets for x in ("--set", o))]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"error: grid point model.source=tiny:llama,zo.num_perturbations={p}: invalid value for split.cut: 5 "
        "(tiny:llama has 4 decoder blocks; need 1 <= cut < 4)"
        for p in (1, 2)
    ] + ["error: 2 of 4 grid points cannot be built: nothing was run"]
    assert built == ["tiny:llama", "arch:qwen3-0.6b"] and not out.exists()


def test_a_study_rerun_into_its_folder_with_other_rows_keeps_the_earlier_rows_and_says_they_are_reused(
    tmp_path, capsys
):
    """compare --methods hosfl, then --methods sfl into the same --out: the table and the plots hold both rows, the
    hosfl run said to be reused; collect reports both; the same command under another setting leaves the earlier
    row out, naming it and why, and the first setting again brings it back. A sweep's grid points the same way."""
    from hosfl_dist.experiments import collect
    from hosfl_dist.runtime.checks import load_run_config

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "cmp"

    def study(*methods: str, extra: tuple[str, ...] = ()) -> list[str]:
        argv = ["--config", str(cfg), "--methods", ",".join(methods), "--out", str(out), *extra]
        specs, _, _ = compare.build(compare.parse_args(argv))
        for spec in (s for v in specs.values() for s in v):  # as the study would run them (another setting replaced)
            wanted = resolve(str(cfg), spec)
            if not runs.is_finished(spec, wanted):
                again = [*spec.all_overrides(), *runs.start_overrides(spec, wanted)]
                InProcessRunner(load_run_config(str(cfg), again)).setup().run()
        capsys.readouterr()
        assert compare.main(argv) == 0
        return capsys.readouterr().out.splitlines()

    study("hosfl")
    said = study("sfl")
    hosfl_run = out / "runs" / "hosfl" / "seed0"
    assert f"reusing {hosfl_run.resolve()} (completed, same identity: config and inputs): method hosfl of an earlier " \
        "invocation into --out, kept in the report" in said  # fmt: skip
    assert said[-1].endswith(f" s; 0 run(s) launched (0.0 s), 2 reused -> {out}")
    table = json.loads((out / "table.json").read_text())
    assert [r["variant"] for r in table["rows"]] == ["hosfl", "sfl"] and table["traffic_ratio_hosfl_over_sfl"] > 0
    assert table["this_invocation"]["earlier_rows"] == {"hosfl": [0]}
    assert table["title"] == "tiny: sfl over seeds [0], with hosfl kept from earlier invocations"
    md = (out / "table.md").read_text()
    assert "| HO-SFL | " in md and "| SFL | " in md
    assert "Kept from earlier invocations into this folder, their runs reused: method hosfl (seed 0)." in md
    assert [r["row"] for r in json.loads((out / "study.json").read_text())["earlier"]] == ["hosfl"]

    assert collect.main([str(out)]) == 0  # the report again from the record: both rows
    assert [r["variant"] for r in json.loads((out / "table.json").read_text())["rows"]] == ["hosfl", "sfl"]

    said = study("sfl", extra=("zo.num_perturbations=3",))  # another setting: hosfl's run is not what it would run
    table = json.loads((out / "table.json").read_text())
    assert [r["variant"] for r in table["rows"]] == ["sfl"]
    (note,) = [line for line in said if line.startswith("note: method hosfl seed 0")]
    assert "is left out of the report: holds a completed run of another setting (zo.num_perturbations" in note
    md = (out / "table.md").read_text()
    assert "## Left out" in md and "- hosfl, seed 0: holds a completed run of another setting" in md
    study("sfl")  # the first setting again: the hosfl row is back (the record kept it)
    assert [r["variant"] for r in json.loads((out / "table.json").read_text())["rows"]] == ["hosfl", "sfl"]

    sw = tmp_path / "sweep"
    for grid in ("zo.num_perturbations=1", "zo.num_perturbations=3"):
        argv = ["--config", str(cfg), "--grid", grid, "--out", str(sw)]
        specs, _, _ = sweep.build(sweep.parse_args(argv))
        finish_in_process(cfg, specs[grid])
        assert sweep.main(argv) == 0
    table = json.loads((sw / "table.json").read_text())
    assert [r["variant"] for r in table["rows"]] == ["zo.num_perturbations=1", "zo.num_perturbations=3"]
    assert "| zo.num_perturbations | final eval_accuracy (%)" in (sw / "table.md").read_text()


CHILD = """
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
def stop(signum, frame):
    with open(folder / "signals", "a") as f:
        f.write("SIGINT\\n")
    time.sleep(0.3)  # a run checkpoints and records its end before it exits
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
(folder / "started").write_text(str(os.getpid()))
time.sleep(30)
"""
"""A stand-in run: says it started, and on SIGINT records it and exits 130 as hosfl_dist.run does."""


@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_stops_a_study_at_once_interrupting_each_running_point_once_and_starting_none(
    tmp_path, monkeypatch, jobs
):
    """Ctrl-C while the first point(s) run: each running point gets one SIGINT (and records it), no other point is
    started, and the study ends with KeyboardInterrupt (its command's one line, exit 130)."""
    import os
    import signal
    import threading
    import time

    specs = [RunSpec(f"p{i}", 0, ["zo.num_perturbations=2"], tmp_path / f"p{i}") for i in range(5)]
    monkeypatch.setattr(runs, "job", lambda config, spec, cfg, launcher: ([sys.executable, "-c", CHILD,
                                                                         str(spec.out_dir)], {}))  # fmt: skip
    monkeypatch.setattr(runs, "say", lambda line: None)

    def ctrl_c_once_running() -> None:
        deadline = time.monotonic() + 120
        while sum((s.out_dir / "started").exists() for s in specs) < jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C reaches the study's process (its group's)

    threading.Thread(target=ctrl_c_once_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        runs.launch(None, specs, jobs=jobs)
    started = [s.out_dir.name for s in specs if (s.out_dir / "started").exists()]
    assert started == [f"p{i}" for i in range(jobs)]  # none launched after Ctrl-C
    for name in started:  # interrupted, once each, and waited for until it had recorded it
        assert (tmp_path / name / "signals").read_text() == "SIGINT\n"


def test_a_point_stopped_by_ctrl_c_stops_the_study_before_the_next_point_starts(tmp_path, monkeypatch):
    """A Ctrl-C that reached a run and not the study (a study that ignores SIGINT, started in the background): the
    run's exit code 130 stops the study, no point is launched after it."""
    specs = [RunSpec(f"p{i}", 0, ["zo.num_perturbations=2"], tmp_path / f"p{i}") for i in range(4)]
    stopped_by_ctrl_c = "import sys; from pathlib import Path; Path(sys.argv[1], 'started').touch(); sys.exit(130)"
    monkeypatch.setattr(runs, "job", lambda config, spec, cfg, launcher: ([sys.executable, "-c", stopped_by_ctrl_c,
                                                                         str(spec.out_dir)], {}))  # fmt: skip
    said: list[str] = []
    monkeypatch.setattr(runs, "say", said.append)
    with pytest.raises(KeyboardInterrupt):
        runs.launch(None, specs, jobs=1)
    assert [s.out_dir.name for s in specs if (s.out_dir / "started").exists()] == ["p0"]
    assert [line.split(":")[0] for line in said if not line.startswith("[start]")] == ["[interrupted] p0 seed 0"]


def test_a_large_study_says_it_is_planning_and_reads_its_config_file_once(tmp_path, monkeypatch, capsys):
    """A plan of many runs says it is planning, how far it is and its time (on stderr: a dry run's stdout stays its
    commands); the config file is parsed once however many points it has, and a small plan says nothing."""
    from hosfl_dist import safe_yaml
    from hosfl_dist.experiments.cli import Planning

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    parsed = []
    load_text = safe_yaml.load_text
    monkeypatch.setattr(safe_yaml, "load_text", lambda data, where: (parsed.append(where), load_text(data, where))[1])
    safe_yaml._parsed.cache_clear()
    argv = ["--config", str(cfg), "--grid", "zo.num_perturbations=1,2,3", "--grid", "zo.mu=1e-3,2e-3",
            "--out", str(tmp_path / "s"), "--dry-run"]  # fmt: skip
    assert sweep.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and len(out.splitlines()) == 6 and parsed == [f"config file {cfg}"]
    monkeypatch.setattr(Planning, "SAY_FROM_RUNS", 6)
    monkeypatch.setattr(Planning, "EVERY_S", 0.0)
    assert sweep.main([*argv, "--seeds", "0"]) == 0
    out, err = capsys.readouterr()
    said = err.splitlines()
    assert said[0] == "planning 6 run(s) of 6 grid point(s): every config, world, build and run folder is checked " \
        "before anything starts"  # fmt: skip
    assert "planning: 5 of 6 configs read (0 s)" in said and "planning: 3 of 6 run folders read (0 s)" in said
    assert said[-1].startswith("planned 6 run(s) in ") and said[-1].endswith(" s") and len(out.splitlines()) == 6
