"""The experiment suite: grids and overrides (pure), and compare/sweep end to end on a tiny synthetic setting."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.errors import ConfigError
from hosfl_dist.experiments import compare, sweep
from hosfl_dist.experiments.report import curve, mean_std
from hosfl_dist.experiments.runs import RunData, RunSpec, parse_list, resolve

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
    for name in ("table.md", "table.json", "accuracy.png", "traffic.png"):
        assert (out / name).stat().st_size > 0, name
    table = json.loads((out / "table.json").read_text())
    assert table["this_invocation"]["launched"] == [] and len(table["this_invocation"]["reused"]) == 4
    assert [r["variant"] for r in table["rows"]] == ["hosfl", "sfl"]
    assert all(r["seeds"] == [0, 1] and len(r["final"]) == 2 for r in table["rows"])
    assert table["traffic_ratio_hosfl_over_sfl"] > 0
    assert "Traffic ratio HO-SFL / SFL" in (out / "table.md").read_text()

    # a sweep whose first point is already done and whose second is launched as a subprocess
    sw = tmp_path / "sweep"
    argv = ["--config", str(cfg), "--grid", "zo.num_perturbations=1,3", "--out", str(sw)]
    specs, _, _ = sweep.build(sweep.parse_args(argv))
    finish_in_process(cfg, specs["zo.num_perturbations=1"])
    assert sweep.main(argv) == 0
    table = json.loads((sw / "table.json").read_text())
    assert len(table["this_invocation"]["launched"]) == 1 and len(table["this_invocation"]["reused"]) == 1
    rows = table["rows"]
    assert [r["variant"] for r in rows] == ["zo.num_perturbations=1", "zo.num_perturbations=3"]
    assert rows[0]["comm_bytes"]["uplink_scalars"] * 3 == rows[1]["comm_bytes"]["uplink_scalars"]  # P scalars each

    assert compare.main(["--config", str(cfg), "--methods", "sfl", "--out", str(out), "--set", "zo.mu=0"]) == 2
    assert "zo.mu" in capsys.readouterr().err
