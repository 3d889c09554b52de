"""The scaling-study command: grid runs (reused when finished), sizes from a meta build, per-round costs, fits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tiny import lm_overrides, write_text_files

from hosfl_dist.experiments.scaling import (
    axes_of,
    loglinear_fit,
    main,
    scaling_figure,
    server_seconds,
    write_scaling,
)


def test_the_fit_recovers_one_exponent_per_axis_and_needs_enough_points():
    size, cut = [1e8, 1e8, 1e9, 1e9, 4e9], [2.0, 4.0, 2.0, 4.0, 8.0]
    fit = loglinear_fit({"size": size, "cut": cut}, [3.0 * s**0.5 * c**1.0 for s, c in zip(size, cut)])
    assert fit["exponents"]["size"] == pytest.approx(0.5) and fit["exponents"]["cut"] == pytest.approx(1.0)
    assert fit["a"] == pytest.approx(3.0) and fit["r2"] == pytest.approx(1.0) and fit["points"] == 5
    assert loglinear_fit({"x": [1e3, 1e4]}, [2.0, 20.0])["exponents"]["x"] == pytest.approx(1.0)
    one = loglinear_fit({"x": [10, 10]}, [1.0, 2.0])
    assert one["exponents"] == {} and one["a"] is None and one["axes"]["x"]["why"] == "one value (10)"
    assert loglinear_fit({"x": [1, 2]}, [0.0, None])["why"] == "no axis whose values are positive with a value"
    few = loglinear_fit({"a": [1, 2, 3], "b": [1, 2, 4]}, [1.0, 2.0, 3.0])  # 3 points, 2 exponents + a
    assert few["why"] == "3 point(s) with a value, 4 needed for 2 exponent(s) and a" and few["r2"] is None
    together = loglinear_fit({"a": [1, 2, 4, 8], "b": [2, 4, 8, 16]}, [1.0, 2.0, 3.0, 4.0])
    assert together["exponents"] == {} and "vary together" in together["why"]


def test_an_axis_that_barely_varies_gets_no_exponent_and_says_why(tmp_path):
    """Two models of 97,536 and 97,472 parameters: b(model size) would be noise over a 1.0007x range (it printed +73.6
    with a = 0); the axis is left out, the cut still fitted, and scaling.md and scaling.json say so."""
    size, cut = [97_536.0, 97_472.0, 97_536.0, 97_472.0, 97_536.0], [1.0, 1.0, 2.0, 2.0, 4.0]
    ys = [3.0 * c * (1.01 if s > 97_500 else 0.99) for s, c in zip(size, cut)]  # a 2% wobble between the models
    fit = loglinear_fit({"model size": size, "cut": cut}, ys)
    assert list(fit["exponents"]) == ["cut"] and fit["exponents"]["cut"] == pytest.approx(1.0, abs=0.01)
    flag = fit["axes"]["model size"]
    assert not flag["fitted"] and flag["spread"] == pytest.approx(97_536 / 97_472) and "less than 1.5x" in flag["why"]
    assert fit["axes"]["cut"] == {"distinct": 3, "min": 1.0, "max": 4.0, "spread": 4.0, "fitted": True, "why": None}
    alone = loglinear_fit({"model size": size[:2]}, ys[:2])
    assert alone["a"] is None and alone["exponents"] == {} and alone["why"] == "no axis whose values are 1.5x apart"

    points = {f"model.source=tiny:{m},split.cut={c}": point(s, c, 2) for m, s in (("qwen3", 97_536), ("llama", 97_472))
              for c in (1, 2, 4)}  # fmt: skip
    text = write_scaling(tmp_path, points, "eval_accuracy", "python -m hosfl_dist.experiments.scaling …", "T")
    said = "- axis model size: 2 values, 97,472 to 97,536 (spread 1.001x): no exponent, its values are 1.001x apart"
    assert said in text
    assert "- axis split.cut: 3 values, 1 to 4 (spread 4x)" in text
    assert "b(model size)" not in text and "b(split.cut) = +1.00 (spread 4x); a = " in text
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert saved["axis_checks"]["model size"]["fitted"] is False and saved["min_spread"] == 1.5
    assert saved["fits"]["client_peak_bytes"]["axes"]["model size"]["fitted"] is False


def point(size: float, cut: int, p: int) -> dict:
    return {
        "model_params": size, "client_blocks": cut, "client_params": int(size / 10 * cut),
        "client_trainable_params": 10 * cut, "client_param_bytes": 4e5 * cut, "server_params": int(size),
        "traffic_bytes_per_round": 100.0 * size / 1e6, "traffic/uplink_activations": 60.0 * size / 1e6,
        "traffic/downlink_gradients": 40.0 * size / 1e6, "traffic/eval": 5.0, "wall_s_per_round": 0.1 * cut,
        "server_s_per_round": 0.05 * size / 1e6, "client_step_s": 0.01 * cut * p, "client_peak_bytes": 2**20 * cut,
        "client_rss_bytes": 2**29, "peak_rss_bytes": 4e8, "eval_accuracy": None, "P": p, "seeds": 1,
    }  # fmt: skip


def test_the_report_lists_every_point_fits_every_axis_and_plots(tmp_path):
    points = {
        f"model.source=arch:{name},split.cut={cut},zo.num_perturbations={p}": point(size, cut, p)
        for name, size in (("small", 1e6), ("big", 4e6)) for cut in (1, 2) for p in (2, 4)
    }  # fmt: skip
    axes = axes_of(points)
    assert list(axes) == ["model size", "split.cut", "zo.num_perturbations"]
    assert axes["model size"]["model.source=arch:big,split.cut=2,zo.num_perturbations=4"] == 4e6
    text = write_scaling(tmp_path, points, "eval_accuracy", "python -m hosfl_dist.experiments.scaling …", "T")
    assert text.count("| model.source=") == 8 and "uplink_activations / round" in text and "eval / round" not in text
    saved = json.loads((tmp_path / "scaling.json").read_text())
    traffic, step = saved["fits"]["traffic_bytes_per_round"], saved["fits"]["client_step_s"]
    assert traffic["exponents"]["model size"] == pytest.approx(1.0)
    assert traffic["exponents"]["split.cut"] == pytest.approx(0.0, abs=1e-9)
    assert step["exponents"]["split.cut"] == pytest.approx(1.0)
    assert step["exponents"]["zo.num_perturbations"] == pytest.approx(1.0)
    assert ("client peak memory: b(model size) = +0.00 (spread 4x), b(split.cut) = +1.00 (spread 2x), "
            "b(zo.num_perturbations) = +0.00 (spread 2x); a = ") in text  # fmt: skip
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_each_line_of_the_plot_is_one_setting_of_the_other_keys_with_a_legend_and_plain_ticks():
    """Two tiny models of nearly the same size (both "0M" when labelled by size) and two methods (no axis): the P
    column drew one zigzag through all 12 points with no legend, and the memory panel read "+3.173" above its ticks."""
    points = {}
    for model, size in (("qwen3", 97_536), ("llama", 97_472)):
        for method in ("hosfl", "sfl"):
            for p in (4, 1, 2):  # not in x order
                pt = point(size, 2, p)
                pt["client_peak_bytes"] = 2**20 * (3.173 + 1e-4 * p + (2e-4 if model == "llama" else 0))
                pt["client_step_s"] = 0.01 * p * (2 if method == "sfl" else 1) * (1.3 if model == "llama" else 1)
                points[f"model.source=tiny:{model},algorithm.name={method},zo.num_perturbations={p}"] = pt
    axes = axes_of(points)
    fits = {q: loglinear_fit({a: [axes[a][n] for n in points] for a in axes}, [pt.get(q) for pt in points.values()])
            for q in ("client_peak_bytes", "client_step_s")}  # fmt: skip
    fig = scaling_figure(points, axes, fits, "eval_accuracy", "T")
    fig.canvas.draw()
    grid = np.array(fig.axes).reshape(-1, 2)  # rows: quantities; columns: model size, P
    step = grid[1][1]
    assert sorted(line.get_label() for line in step.lines) == ["tiny:llama, hosfl", "tiny:llama, sfl",
                                                              "tiny:qwen3, hosfl", "tiny:qwen3, sfl"]  # fmt: skip
    for line in step.lines:
        assert list(line.get_xdata()) == [1, 2, 4]  # one point per x: no vertical jump inside a line
    assert step.get_ylabel() == "client step [ms]" and grid[0][0].get_ylabel() == "client peak memory [MiB]"
    legends = [ax.get_legend() for ax in grid[-1]]
    assert [t.get_text() for t in legends[1].get_texts()] == ["tiny:qwen3, hosfl", "tiny:qwen3, sfl",
                                                             "tiny:llama, hosfl", "tiny:llama, sfl"]  # fmt: skip
    assert len(legends[0].get_texts()) == 6  # the model column: a line per (method, P)
    for ax in fig.axes:
        assert ax.yaxis.get_offset_text().get_text() == "" and ax.xaxis.get_offset_text().get_text() == ""
        assert all("+" not in t.get_text() and "e-" not in t.get_text() for t in ax.get_yticklabels())
    assert "no fit: spread 1.001x" in grid[0][0].get_title() and "fit: ∝ x^1.00" in step.get_title()


def test_the_server_cost_counts_training_calls_not_evaluation():
    """The method's training calls count, the evaluation server's do not; a call this version does not declare is left
    out rather than stopping the report."""
    compute = {"submit": 1.0, "finish_round": 0.5, "eval_batch": 2.0, "eval_generated": 0.25, "renamed_since": 9.0}
    assert server_seconds({"transport": {"server": {"compute_s": compute}}}, "hosfl") == 1.5
    assert server_seconds({"transport": {}}, "hosfl") is None


def test_a_key_that_is_not_a_number_or_a_model_is_no_axis():
    points = {f"algorithm.name={m},split.cut={c}": point(1e6, c, 2) for m in ("hosfl", "sfl") for c in (1, 2)}
    assert list(axes_of(points)) == ["split.cut"]


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
    assert a["traffic_bytes_per_round"] > 0
    assert math.isfinite(saved["fits"]["client_param_bytes"]["exponents"]["split.cut"])
    # per role: the profiler's client (one more block costs more) and the server's training calls
    assert b["client_peak_bytes"] > a["client_peak_bytes"] > 0 and a["client_step_s"] > 0
    assert a["server_s_per_round"] > 0 and a["model_params"] == b["model_params"]
    assert len(list((tmp_path / "out" / "profiles").glob("*.json"))) == 2
    capsys.readouterr()
    assert main(argv) == 0  # the second invocation reuses the finished runs
    assert "[ok]" not in capsys.readouterr().out
