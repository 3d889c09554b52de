"""The scaling-study command: grid runs (reused when finished), sizes from a meta build, per-round costs, fits."""

from __future__ import annotations

import json
import math

import pytest

from tiny import lm_overrides, write_text_files

from hosfl_dist.experiments.scaling import main, power_fit, write_scaling


def test_power_fit_recovers_an_exponent_and_needs_two_sizes():
    xs = [1e3, 1e4, 1e5, 1e6]
    fit = power_fit(xs, [3.0 * x**0.5 for x in xs])
    assert fit["b"] == pytest.approx(0.5) and fit["a"] == pytest.approx(3.0) and fit["r2"] == pytest.approx(1.0)
    assert power_fit([10, 10], [1.0, 2.0]) is None and power_fit([1, 2], [0.0, 0.0]) is None


def test_the_report_lists_every_point_and_the_fits(tmp_path):
    points = {
        f"split.cut={k}": {
            "client_params": 1000 * k, "client_trainable_params": 10 * k, "client_param_bytes": 4000 * k,
            "server_params": 5000, "traffic_bytes_per_round": 100.0, "wall_s_per_round": 0.1 * k,
            "peak_rss_bytes": 4e8, "eval_accuracy": None,
        }
        for k in (1, 2, 4)
    }  # fmt: skip
    text = write_scaling(tmp_path, points, "eval_accuracy", "python -m hosfl_dist.experiments.scaling …")
    assert text.count("| split.cut=") == 3 and "wall_s_per_round: a = 0.0001, b = 1.000" in text
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert saved["fits"]["traffic_bytes_per_round"]["b"] == pytest.approx(0.0, abs=1e-9)
    assert (tmp_path / "scaling.png").stat().st_size > 0


@pytest.mark.slow
def test_a_grid_over_client_depth_runs_reports_and_reuses_its_runs(tmp_path, capsys):
    files = write_text_files(tmp_path)
    sets = [o for o in lm_overrides(tmp_path / "unused", files) if not o.startswith("job.out_dir")]
    (tmp_path / "empty.yaml").write_text("{}\n")  # the setting is all in --set
    argv = ["--config", str(tmp_path / "empty.yaml"), "--grid", "split.cut=1,2", "--out", str(tmp_path / "out")]
    argv += [x for o in sets for x in ("--set", o)]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "out" / "scaling.json").read_text())
    a, b = saved["points"]["split.cut=1"], saved["points"]["split.cut=2"]
    assert b["client_params"] > a["client_params"] and b["server_params"] < a["server_params"]
    assert a["traffic_bytes_per_round"] > 0 and math.isfinite(saved["fits"]["client_param_bytes"]["b"])
    capsys.readouterr()
    assert main(argv) == 0  # the second invocation reuses the finished runs
    assert "[ok]" not in capsys.readouterr().out
