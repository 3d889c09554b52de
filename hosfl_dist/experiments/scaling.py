"""Scaling study: a grid over model size, client depth and P, run (resumable), then how the costs scale.

    python -m hosfl_dist.experiments.scaling --config configs/smollm2_sentiment.yaml \\
        --grid model.source=arch:qwen3-0.6b,arch:qwen3-1.7b --grid split.cut=2,5 --grid zo.num_perturbations=2,5 \\
        model.dtype=bfloat16 train.budget_samples=96 --out results/scaling/qwen3

(the committed study, its exact command and findings: results/scaling/README.md). The runs are the sweep's
(``hosfl_dist.experiments.sweep``: one in-process run per grid point and seed under --out/runs/, finished ones
reused, unfinished ones resumed; the sweep's table and accuracy-vs-processed-samples curves are written too). Then,
per grid point (mean over seeds), ``scaling.md`` / ``scaling.json`` give:

- sizes, from a meta-device build of the point's config (nothing allocated, free at 8B): the model's parameters
  (f_c + f_s as split, LoRA included; a tied head is counted on both sides), the client depth (``split.cut``), f_c's
  parameters (all, trainable = d_c) and bytes;
- per role, per round: the client's peak memory and step time, measured by the memory profiler
  (:mod:`hosfl_dist.measure.memory`: the method's own client code for one sampled client, one batch of
  ``clients.batch_size`` × ``data.max_length`` tokens, the server a stand-in; tensor bytes counted, process RSS
  beside) in its own process, kept under --out/profiles/ and reused; the server's compute per round (its training
  calls' time in the in-process run, ``transport.server.compute_s`` without evaluation calls); training traffic per
  round by category (bytes counted on the wire);
- of the in-process run: wall time per round and the process's peak RSS (client and server together);
- the final metric, except for ``arch:`` sources (random weights: their accuracy means nothing).

Fitted: for each quantity, a power law in every swept axis at once, log y = log a + Σ_k b_k log x_k, by least
squares over the grid points (R² given), where x_k is the model's parameter count for a model key
(``model.source``, ``model.name``, ``model.width``) and the value itself for a numeric key (``split.cut``, P, …); an
axis with one value is left out, and so is an axis whose values span less than 1.5x (``MIN_SPREAD``: two models of
nearly the same size give an exponent that is noise); scaling.md and scaling.json give each axis's spread, and for
each quantity its exponents, R² and the axes left out with the reason. A quantity is fitted only with more points
than exponents + 1. So the exponent of model size says how a cost grows with the model at a fixed cut and P.
``scaling.png`` plots each quantity against each swept axis, one line per value of the other axes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hosfl_dist.experiments.cli import complete, done_line, guarded, parse, parser, quote_arg, run_rows
from hosfl_dist.experiments.sweep import build, plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from hosfl_dist.config import Config
    from hosfl_dist.experiments.runs import RunData

PROG = "hosfl_dist.experiments.scaling"
MODEL_KEYS = ("model.source", "model.name", "model.width", "model.gguf_file")
"""Grid keys that change the model: their axis is the model's parameter count."""
QUANTITIES = {
    "client_peak_bytes": ("client peak memory [MiB] (profiler)", 1 / 2**20),
    "client_step_s": ("client step [s] (one client, profiler)", 1.0),
    "server_s_per_round": ("server compute per round [s]", 1.0),
    "traffic_bytes_per_round": ("training traffic per round [MiB]", 1 / 2**20),
    "wall_s_per_round": ("wall time per round [s] (in-process)", 1.0),
    "peak_rss_bytes": ("peak RSS of the in-process run [GiB]", 1 / 2**30),
    "client_param_bytes": ("f_c bytes [MiB]", 1 / 2**20),
}
"""Fitted (and, but for the last two, plotted) quantities: key -> (label with unit, scale to that unit); sizes in
binary units (MiB = 2^20 bytes, GiB = 2^30), as every table of the package."""
PLOTTED = ("client_peak_bytes", "client_step_s", "server_s_per_round", "traffic_bytes_per_round")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, __doc__)
    p.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a swept key and its values (repeatable: the product of all grids is run)")  # fmt: skip
    p.add_argument("--client-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the client's peak memory and step time per grid point with the memory profiler "
                        "(a process per point, reused from --out/profiles/; default on)")  # fmt: skip
    return parse(p, argv)  # options and positional key=value overrides, as compare and sweep take them


def sizes(cfg: Config) -> dict[str, int]:
    """The model's, f_c's and f_s's parameter counts and f_c's bytes, from a meta-device build of ``cfg``."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.data import data_info
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    zeroth_order = get_algorithm(cfg.algorithm.name).zeroth_order_client
    split = build_split_model(cfg, data_info(data_sections(cfg)), zeroth_order, parts=())
    client = list(split.client.parameters())
    server = sum(p.numel() for p in split.server.parameters())
    return {
        "model_params": sum(p.numel() for p in client) + server,
        "client_blocks": cfg.split.cut,
        "client_params": sum(p.numel() for p in client),
        "client_trainable_params": sum(p.numel() for p in client if p.requires_grad),
        "client_param_bytes": sum(p.numel() * p.element_size() for p in client),
        "server_params": server,
    }


def real_weights(cfg: Config) -> bool:
    """False for an architecture without weights (``arch:``), whose metrics mean nothing."""
    return not (cfg.model.name == "hf" and cfg.model.source.startswith("arch:"))


def server_seconds(summary: dict[str, Any], algorithm: str) -> float | None:
    """The server's compute in the run's training calls (evaluation-only calls left out); None for a run whose
    summary has no ``transport.server`` (written before it was recorded in one process)."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.runtime.build import served
    from hosfl_dist.transport.wire import EVAL, wire_specs

    compute = ((summary.get("transport") or {}).get("server") or {}).get("compute_s")
    if compute is None:
        return None
    specs = wire_specs(served(get_algorithm(algorithm)))  # the method's calls and the evaluation server's
    return sum(s for method, s in compute.items() if method in specs and not specs[method].categories() <= {EVAL})


def client_profile(cfg: Config, out: Path, name: str, threads: int) -> dict[str, Any] | None:
    """Peak memory and step time of one sampled client (the memory profiler, its own process), cached in ``out``."""
    from hosfl_dist.experiments.runs import safe_name
    from hosfl_dist.measure.memory import profile
    from hosfl_dist.measure.modes import run_mode, run_spec

    mode = run_mode(cfg)
    if mode is None:
        return None  # no profiler mode for the method
    spec = run_spec(cfg, mode)
    path = out / f"{safe_name(name)}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("mode") == mode and cached.get("spec") == json.loads(json.dumps(dataclasses.asdict(spec))):
            print(f"client profile of {name}: reusing {path} (measured before for this client)")
            return cached  # measured before for exactly this client; another setting is measured again
    t0 = time.perf_counter()
    result = profile(spec, [mode], threads=threads, label=name)["modes"][mode]  # its own process, the runs' threads
    print(f"client profile of {name}: {mode} client measured in {time.perf_counter() - t0:.1f} s, peak "
          f"{result['peak_bytes'] / 2**20:,.1f} MiB of live tensors")  # fmt: skip
    record = {"mode": mode, "spec": dataclasses.asdict(spec), **result}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def point(
    config: str, name: str, runs: list[RunData], metric: str, profiles: Path | None, threads: int = 1
) -> dict[str, Any]:
    """One grid point's row: sizes, per-role and per-round costs and the final metric (mean over its seeds)."""
    from hosfl_dist.experiments.runs import resolve

    cfg = resolve(config, runs[0].spec)
    out: dict[str, Any] = sizes(cfg)
    per_run = []
    for r in runs:
        s, rounds = r.summary, max(1, r.summary.get("rounds") or 1)
        server_s = server_seconds(s, cfg.algorithm.name)
        per_run.append({
            "traffic_bytes_per_round": s["comm"]["training_total_bytes"] / rounds,
            "wall_s_per_round": s["wall_time_s"] / rounds,
            "server_s_per_round": None if server_s is None else server_s / rounds,
            "peak_rss_bytes": max((m.get("peak_rss_bytes") or 0 for m in s.get("memory", [])), default=0),
            metric: (s.get("final") or {}).get(metric) if real_weights(cfg) else None,
            **{f"traffic/{c}": v / rounds for c, v in s["comm"]["bytes"].items()},
        })  # fmt: skip
    for key in per_run[0]:
        values = [p[key] for p in per_run if p[key] is not None]
        out[key] = float(np.mean(values)) if values else None
    prof = client_profile(cfg, profiles, name, threads) if profiles is not None else None
    out["client_peak_bytes"] = None if prof is None else prof["peak_bytes"]
    out["client_rss_bytes"] = None if prof is None else prof.get("rss_peak_bytes")
    out["client_step_s"] = None if prof is None else prof["step_s"]
    out["P"] = cfg.zo.num_perturbations
    out["seeds"] = len(runs)
    out.update(roles_of(runs))
    return out


def roles_of(runs: list[RunData]) -> dict[str, Any]:
    """How the point's runs were started and, per role, their peak RSS and time per round (mean over seeds): the
    distributed runs' own summary.json (:func:`hosfl_dist.experiments.report.role_costs`)."""
    from hosfl_dist.experiments.report import mean_roles, role_costs

    costs = mean_roles([role_costs(r.summary) for r in runs])
    peaks = costs.get("peak_rss_bytes") or {}
    return {
        "engine": costs.get("engine"),
        "processes": costs.get("processes"),
        "server_ranks": costs.get("server_ranks"),
        "server_peak_rss_bytes": max((v for k, v in peaks.items() if k.startswith("server")), default=None),
        "worker_peak_rss_bytes": peaks.get("worker"),
        "worker_s_per_round": costs.get("worker_s_per_round"),
    }


def axes_of(points: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Swept axis -> {point: x}: the model's parameter count for a model key, the number itself for a numeric key;
    only axes with more than one value (a non-numeric key that is not a model key is not an axis)."""
    keys: list[str] = []
    for name in points:
        for item in name.split(","):
            key = item.split("=", 1)[0]
            if key not in keys:
                keys.append(key)
    out: dict[str, dict[str, float]] = {}
    model_axis = False
    for key in keys:
        if key in MODEL_KEYS:
            if not model_axis:
                out["model size"] = {n: float(p["model_params"]) for n, p in points.items()}
                model_axis = True
            continue
        values = {}
        for n in points:
            raw = dict(item.split("=", 1) for item in n.split(",")).get(key)
            try:
                values[n] = float(raw)
            except (TypeError, ValueError):
                values = {}
                break
        if values:
            out[key] = values
    return {k: v for k, v in out.items() if len(set(v.values())) > 1}


MIN_SPREAD = 1.5
"""Least ratio of an axis's largest to smallest value for its exponent to be fitted. Over a narrower range log x
barely varies, and b is the noise of y divided by that small difference: two models of 97,472 and 97,536 parameters
gave b(model size) = +73.6 with a = 0, and -9.8 with a = 7.5e+50."""


def axis_check(values: list[float]) -> dict[str, Any]:
    """An axis's distinct values, range and spread (max / min) over the points fitted, and whether an exponent of
    it means anything (``why`` says why not)."""
    distinct = sorted(set(values))
    spread = distinct[-1] / distinct[0] if distinct and distinct[0] > 0 else None
    why = None
    if len(distinct) < 2:
        why = f"one value ({distinct[0]:g})" if distinct else "no value"
    elif spread is None:
        why = f"a value of {distinct[0]:g} has no logarithm"
    elif spread < MIN_SPREAD:
        why = f"its values are {spread:.4g}x apart, less than {MIN_SPREAD:g}x: log x barely varies, b would be noise"
    return {"distinct": len(distinct), "min": distinct[0] if distinct else None,
            "max": distinct[-1] if distinct else None, "spread": spread, "fitted": why is None, "why": why}  # fmt: skip


def loglinear_fit(axes: dict[str, list[float]], ys: list[float | None]) -> dict[str, Any]:
    """y ≈ a·Π_k x_k^b_k by least squares on log y = log a + Σ_k b_k log x_k, over the points where y > 0.

    Only the axes whose values over those points are at least :data:`MIN_SPREAD` apart get an exponent (``axes``
    says each one's spread and why one is left out). No fit (``a``, ``exponents`` and ``r2`` empty, ``why`` says why)
    with no such axis, with the axes varying together (no unique exponents), or with no more points than
    coefficients (the exponents and a: nothing left to check the fit against); a single axis needs only two points
    (the line through them: R² = 1 says nothing)."""
    names = list(axes)
    rows = [(i, y) for i, y in enumerate(ys) if y is not None and y > 0 and all(axes[k][i] > 0 for k in names)]
    checks = {k: axis_check([axes[k][i] for i, _ in rows]) for k in names}
    fitted = [k for k in names if checks[k]["fitted"]]
    out: dict[str, Any] = {"a": None, "exponents": {}, "r2": None, "points": len(rows), "axes": checks, "why": None}
    need = 2 if len(fitted) == 1 else len(fitted) + 2
    if not fitted:
        out["why"] = "no axis whose values are " + (f"{MIN_SPREAD:g}x apart" if rows else "positive with a value")
        return out
    if len(rows) < need:
        out["why"] = f"{len(rows)} point(s) with a value, {need} needed for {len(fitted)} exponent(s) and a"
        return out
    ly = np.log([y for _, y in rows])
    design = np.column_stack([np.ones(len(rows)), [[math.log(axes[k][i]) for k in fitted] for i, _ in rows]])
    if np.linalg.matrix_rank(design) < design.shape[1]:
        out["why"] = f"the axes {', '.join(fitted)} vary together over these points: their exponents are not unique"
        return out
    coef, *_ = np.linalg.lstsq(design, ly, rcond=None)
    resid = ly - design @ coef
    total = float(((ly - ly.mean()) ** 2).sum())
    constant = np.ptp(ly) <= 1e-12 * max(1.0, float(np.abs(ly).max()))  # rounding noise alone: R² would be noise
    r2 = 1.0 if constant else max(0.0, 1.0 - float((resid**2).sum()) / total)  # >= 0 with an intercept: no "-0.00"
    out.update(a=float(math.exp(coef[0])), exponents=dict(zip(fitted, map(float, coef[1:]))), r2=r2)
    return out


def _exponent(b: float, sign: str = "") -> str:
    """``b`` to two decimals, without the minus of a negative value that rounds to zero."""
    return format(0.0 if round(b, 2) == 0 else b, f"{sign}.2f")


def fit_line(label: str, fit: dict[str, Any], grid: dict[str, dict[str, Any]]) -> str:
    """One line of scaling.md: the exponents with their axis's spread, a and R², and each axis left out and why
    (where ``grid``, the axes' checks over every point, has not said it already)."""
    left = [f"{k}: no exponent, {c['why']}" for k, c in fit["axes"].items() if not c["fitted"] and grid[k]["fitted"]]
    if fit["why"] is not None:
        return f"- {label}: not fitted: {fit['why']}" + "".join(f"; {w}" for w in left)
    exps = ", ".join(f"b({k}) = {_exponent(b, '+')} (spread {fit['axes'][k]['spread']:.3g}x)"
                     for k, b in fit["exponents"].items())  # fmt: skip
    exact = fit["points"] == len(fit["exponents"]) + 1
    exact_words = " (as many points as coefficients: the line through them)" if exact else ""
    return (f"- {label}: {exps}; a = {fit['a']:.3g}, R² = {fit['r2']:.3f}{exact_words} over {fit['points']} points"
            + "".join(f"; {w}" for w in left))  # fmt: skip


def _mib(b: float | None) -> str:
    return "–" if b is None else f"{b / 2**20:,.0f}"


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def write_scaling(
    out: Path, points: dict[str, dict[str, Any]], metric: str, command: str, title: str = "Scaling study"
) -> str:
    """scaling.json, scaling.md (returned) and scaling.png."""
    axes = axes_of(points)
    names = list(points)
    fits = {q: loglinear_fit({a: [axes[a][n] for n in names] for a in axes}, [points[n].get(q) for n in names])
            for q in QUANTITIES}  # fmt: skip
    checks = {a: axis_check(list(axes[a].values())) for a in axes}
    (out / "scaling.json").write_text(json.dumps({"points": points, "axes": axes, "axis_checks": checks, "fits": fits,
                                                  "min_spread": MIN_SPREAD, "command": command}, indent=1))  # fmt: skip
    categories = [c for c in sorted({k for p in points.values() for k in p if k.startswith("traffic/")})
                  if any(p.get(c) for p in points.values()) and c != "traffic/eval"]  # fmt: skip
    lines = [f"# {title}", "", f"`{command}`", "",
             "| grid point | model params | client blocks | f_c params | d_c (trainable) | f_c MiB | P | "
             + " | ".join(f"{c.split('/', 1)[1]} / round" for c in categories)
             + " | server s / round | client step s | client peak MiB | client RSS MiB | wall s / round | run peak "
               f"RSS GiB | {metric} |",
             "|---" + "|---:" * (12 + len(categories)) + "|"]  # fmt: skip
    for name, p in points.items():
        lines.append(
            f"| {name} | {p['model_params'] / 1e6:,.1f}M | {p['client_blocks']} | {p['client_params']:,} | "
            f"{p['client_trainable_params']:,} | {p['client_param_bytes'] / 2**20:,.1f} | {p['P']} | "
            + " | ".join(f"{p[c]:,.0f} B" for c in categories)
            + f" | {_num(p.get('server_s_per_round'), '.3f')} | {_num(p.get('client_step_s'), '.3f')} | "
            f"{_mib(p.get('client_peak_bytes'))} | {_mib(p.get('client_rss_bytes'))} | "
            f"{p['wall_s_per_round']:.3f} | {p['peak_rss_bytes'] / 2**30:.2f} | {_num(p.get(metric), '.4f')} |"
        )
    lines += ["", "Per round and mean over seeds. Model params: f_c's and f_s's as split (an embedding tied to the "
              "head counts in both: SmolLM2-135M is 163M here, 134.5M as transformers counts it); sizes in MiB and "
              "GiB (2^20 and 2^30 bytes). Client peak MiB: live tensor bytes of one client step (the memory "
              "profiler's count); client RSS: that profiling process's peak; client step: one sampled client's "
              "compute (clients run in parallel); server s: its training calls in the in-process run; wall s and run "
              "peak RSS: the in-process run (every client and the server in one process). "
              f"{metric}: final, none for architectures without weights.", ""]  # fmt: skip
    distributed = {n: p for n, p in points.items() if p.get("engine") == "torchrun"}
    if distributed:
        lines += ["Points run under torchrun (server s, wall s and run peak RSS above are those runs': run peak RSS "
                  "is the largest rank's), per role from their summary.json:", "",
                  "| grid point | processes | server ranks | server peak RSS MiB | worker peak RSS MiB | worker s / "
                  "round |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for name, p in distributed.items():
            lines.append(f"| {name} | {p['processes']} | {p['server_ranks']} | {_mib(p['server_peak_rss_bytes'])} | "
                         f"{_mib(p['worker_peak_rss_bytes'])} | {_num(p['worker_s_per_round'], '.4f')} |")  # fmt: skip
        lines.append("")
    if axes:
        fitted = [a for a in axes if checks[a]["fitted"]] or list(axes)
        lines += ["Fitted y ≈ a · " + " · ".join(f"({a})^b({a})" for a in fitted) + " (least squares in log-log "
                  "over the grid; the model size axis is its parameter count). An axis gets an exponent only where "
                  f"its values span at least {MIN_SPREAD:g}x (spread: largest / smallest value):", ""]  # fmt: skip
        for a, c in checks.items():
            spread = "" if c["spread"] is None else f" (spread {c['spread']:.4g}x)"
            lines.append(f"- axis {a}: {c['distinct']} values, {c['min']:,.6g} to {c['max']:,.6g}{spread}"
                         + ("" if c["fitted"] else f": no exponent, {c['why']}"))  # fmt: skip
        lines.append("")
        lines += [fit_line(QUANTITIES[q][0].split(" [")[0], f, checks) for q, f in fits.items()]
    else:
        lines.append("No axis with several numeric values (or model sizes): nothing fitted.")
    text = "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(text)
    _plot(out / "scaling.png", points, axes, fits, metric, title)
    return text


def _plot(path: Path, points: dict[str, dict[str, Any]], axes: dict[str, dict[str, float]], fits: dict[str, Any],
          metric: str, title: str) -> None:  # fmt: skip
    fig = scaling_figure(points, axes, fits, metric, title)  # selects the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_figure(points: dict[str, dict[str, Any]], axes: dict[str, dict[str, float]], fits: dict[str, Any],
                   metric: str, title: str) -> Figure:  # fmt: skip
    """A row per quantity, a column per swept axis; in a panel one line per setting of the other grid keys, sorted by
    x, one colour per setting down the column (legend under the column), the fitted exponent of that axis (or why
    there is none) in the panel's title. Tick labels are plain numbers in the unit of the axis label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    rows = [q for q in PLOTTED if any(p.get(q) is not None for p in points.values())]
    if any(p.get(metric) is not None for p in points.values()):
        rows.append(metric)
    cols = list(axes) or ["point"]
    fig, grid = plt.subplots(len(rows), len(cols), figsize=(4.6 * len(cols), 2.7 * len(rows) + 0.9),
                             layout="constrained", squeeze=False)  # fmt: skip
    names = list(points)
    for j, axis in enumerate(cols):
        xs = axes.get(axis, {n: float(i) for i, n in enumerate(names)})
        groups = _groups(names, axis)
        for i, q in enumerate(rows):
            ax = grid[i][j]
            name, unit, scale = _unit(q, [points[n][q] for n in names if points[n].get(q) is not None], metric)
            for k, (g, members) in enumerate(groups.items()):
                pts = sorted((xs[n], points[n][q] * scale) for n in members if points[n].get(q) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=4, color=f"C{k % 10}", label=g)
            fit = fits.get(q)
            b = None if fit is None else fit["exponents"].get(axis)
            check = None if fit is None else fit["axes"].get(axis)
            note = "" if b is None else f"   (fit: ∝ x^{_exponent(b)}, R² {fit['r2']:.2f})"
            if check is not None and not check["fitted"] and check["spread"] is not None:
                note = f"   (no fit: spread {check['spread']:.4g}x)"
            ax.set_title(name + note, fontsize=8.5)
            ax.set_ylabel(name if unit is None else f"{name} [{unit}]", fontsize=8)
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)  # no "+3.173" or "1e-6" above the axis
            if axis == "model size":
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(EngFormatter(sep=""))
                ax.xaxis.set_minor_formatter(EngFormatter(sep=""))
            else:
                ax.set_xticks(sorted(set(xs.values())))
                ax.ticklabel_format(axis="x", style="plain", useOffset=False)
            ax.tick_params(labelsize=7.5, which="both")
            ax.grid(alpha=0.3, which="both")
            if i == len(rows) - 1:
                ax.set_xlabel("model parameters" if axis == "model size" else axis, fontsize=8.5)
        shown = {}  # every line of the column once, in the order of the groups (a row may lack some)
        for ax in grid[:, j]:
            shown.update(zip(*reversed(ax.get_legend_handles_labels())))
        if len(groups) > 1:
            order = [g for g in groups if g in shown]
            grid[-1][j].legend([shown[g] for g in order], order, fontsize=7, loc="upper center",
                               bbox_to_anchor=(0.5, -0.32), ncols=2, frameon=False)  # fmt: skip
    from hosfl_dist.experiments.report import wrap_title

    fig.suptitle(wrap_title(title, width=int(12 * 4.6 * len(cols))), fontsize=10)  # ~12 characters an inch at 10 pt
    return fig


def _groups(names: list[str], axis: str) -> dict[str, list[str]]:
    """The points of each line in the column of ``axis``: those alike in every other grid key (the model keys are
    the model size axis together), labelled by those keys' values."""
    if axis == "point":
        return {"all points": names}
    own = MODEL_KEYS if axis == "model size" else (axis,)
    groups: dict[str, list[str]] = {}
    for n in names:
        items = [item.split("=", 1) for item in n.split(",")]
        groups.setdefault(", ".join(_setting(k, v) for k, v in items if k not in own) or "all points", []).append(n)
    return groups


def _setting(key: str, value: str) -> str:
    if key in ("model.source", "model.name", "model.gguf_file", "algorithm.name"):
        return value  # tiny:qwen3, hosfl: the value says what it is
    short = {"split.cut": "cut", "zo.num_perturbations": "P", "zo.mu": "μ", "model.width": "width"}.get(key)
    return f"{short} {value}" if short else f"{key}={value}"


def _unit(q: str, values: list[float], metric: str) -> tuple[str, str | None, float]:
    """A quantity's name, the unit its values read best in (bytes in binary units, seconds in s, ms or µs) and the
    scale to it."""
    if q not in QUANTITIES:
        return f"final {metric}", None, 1.0
    name, top = QUANTITIES[q][0].split(" [")[0], max((abs(v) for v in values), default=0.0)
    if "bytes" in q:
        unit, size = next(((u, z) for u, z in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= z),
                          ("bytes", 1))  # fmt: skip
        return name, unit, 1 / size
    unit, scale = ("s", 1.0) if top >= 1 else ("ms", 1e3) if top >= 1e-3 else ("µs", 1e6)
    return name, unit, scale


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body(start: float) -> None:
        record = run_rows(PROG, args, argv, build, plan)  # the runs, and the sweep's accuracy report
        if record is None:  # a dry run
            return
        from hosfl_dist.experiments.runs import load  # imports torch: after the overrides were checked

        specs, title, _ = build(args)
        specs = getattr(args, "study_specs", None) or specs  # with their worlds, as launched
        missing = {m["run"] for m in record.get("missing") or []}
        out = Path(args.out)
        profiles = out / "profiles" if args.client_profile else None
        points = {
            name: point(args.config, name, [load(s) for s in done], args.metric, profiles, args.threads)
            for name, runs in specs.items()
            if (done := [s for s in runs if str(s.out_dir) not in missing])
        }
        words = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--collect"]
        command = f"python -m {PROG} " + " ".join(quote_arg(a) for a in words)
        if points:
            print(write_scaling(out, points, args.metric, command, title if args.title else f"Scaling: {title}"))
        complete(record)
        print(done_line(start, record, out))

    return guarded(PROG, args, body)  # one line for bad input, a full disk or Ctrl-C; the study's lock let go


if __name__ == "__main__":
    sys.exit(main())
