"""Scaling study: a grid over model size, client depth and P, run (resumable), then how the costs scale.

    python -m hosfl_dist.experiments.scaling --config configs/smollm2_sentiment.yaml \\
        --grid model.source=arch:qwen3-0.6b,arch:qwen3-1.7b --grid split.cut=2,5 --grid zo.num_perturbations=2,5 \\
        model.dtype=bfloat16 train.budget_samples=96 --out results/scaling/qwen3

The runs are the sweep's (``hosfl_dist.experiments.sweep``: one in-process run per grid point and seed under
--out/runs/, finished ones reused, unfinished ones resumed; the sweep's accuracy table and curves are written too).
Then, per grid point (mean over seeds), ``scaling.md`` / ``scaling.json`` give the split's sizes — f_c's parameters
(all, trainable) and bytes, f_s's parameters, from a meta-device build (nothing allocated) — the training traffic
per round by category, the wall time per round (the in-process run: client and server in one process), the peak
RSS of that process, and the final metric where the weights are real. ``scaling.png`` plots traffic per round, time
per round and f_c's bytes against f_c's parameters (log-log), one marker per P.

Fitted: for each quantity, a power law y ≈ a·x^b in f_c's parameter count x, by least squares on log y against
log x over the grid points (R² given), for quantities that vary; with fewer than two sizes nothing is fitted. The
traffic per round of HO-SFL depends on the activation (B·T·D) and P, not on f_c's size: a flat fit (b ≈ 0) is the
result, not a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hosfl_dist.errors import HosflError
from hosfl_dist.experiments.cli import parse, parser, run_experiment
from hosfl_dist.experiments.sweep import build, plan

if TYPE_CHECKING:
    from hosfl_dist.experiments.runs import RunData

PROG = "hosfl_dist.experiments.scaling"
QUANTITIES = ("traffic_bytes_per_round", "wall_s_per_round", "client_param_bytes", "peak_rss_bytes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, __doc__)
    p.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a swept key and its values (repeatable: the product of all grids is run)")  # fmt: skip
    return parse(p, argv)  # options and positional key=value overrides, as compare and sweep take them


def sizes(config: str, run: RunData) -> dict[str, int]:
    """f_c's and f_s's parameter counts and f_c's bytes, from a meta-device build of the run's config."""
    from hosfl_dist.data import data_info
    from hosfl_dist.experiments.runs import resolve
    from hosfl_dist.models import build_split_model

    cfg = resolve(config, run.spec)
    split = build_split_model(cfg, data_info(cfg), parts=())
    client = list(split.client.parameters())
    return {
        "client_params": sum(p.numel() for p in client),
        "client_trainable_params": sum(p.numel() for p in client if p.requires_grad),
        "client_param_bytes": sum(p.numel() * p.element_size() for p in client),
        "server_params": sum(p.numel() for p in split.server.parameters()),
    }


def point(config: str, runs: list[RunData], metric: str) -> dict[str, Any]:
    """One grid point's row: sizes, and per-round costs and the final metric averaged over its seeds."""
    out: dict[str, Any] = sizes(config, runs[0])
    per_run = []
    for r in runs:
        s, rounds = r.summary, max(1, r.summary.get("rounds") or 1)
        per_run.append(
            {
                "traffic_bytes_per_round": s["comm"]["training_total_bytes"] / rounds,
                "wall_s_per_round": s["wall_time_s"] / rounds,
                "peak_rss_bytes": max((m.get("peak_rss_bytes") or 0 for m in s.get("memory", [])), default=0),
                metric: (s.get("final") or {}).get(metric),
                **{f"traffic/{c}": v / rounds for c, v in s["comm"]["bytes"].items()},
            }
        )
    for key in per_run[0]:
        values = [p[key] for p in per_run if p[key] is not None]
        out[key] = float(np.mean(values)) if values else None
    out["seeds"] = len(runs)
    return out


def power_fit(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """y ≈ a·x^b by least squares on (log x, log y); None with fewer than two distinct positive x."""
    pts = [(x, y) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    lx, ly = np.log([x for x, _ in pts]), np.log([y for _, y in pts])
    b, log_a = np.polyfit(lx, ly, 1)
    resid = ly - (b * lx + log_a)
    total = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
    return {"a": float(math.exp(log_a)), "b": float(b), "r2": r2, "points": len(pts)}


def write_scaling(
    out: Path, points: dict[str, dict[str, Any]], metric: str, command: str, title: str = "Scaling study"
) -> str:
    xs = [p["client_params"] for p in points.values()]
    fits = {q: power_fit(xs, [p[q] for p in points.values()]) for q in QUANTITIES}
    (out / "scaling.json").write_text(json.dumps({"points": points, "fits": fits, "command": command}, indent=1))
    lines = [
        f"`{command}`",
        "",
        "| grid point | f_c params | f_c trainable | f_c MB | f_s params | traffic / round | s / round | peak RSS MB "
        f"| {metric} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in points.items():
        final = "–" if p.get(metric) is None else f"{p[metric]:.4f}"
        lines.append(
            f"| {name} | {p['client_params']:,} | {p['client_trainable_params']:,} | "
            f"{p['client_param_bytes'] / 1e6:.1f} | {p['server_params']:,} | {p['traffic_bytes_per_round']:,.0f} B | "
            f"{p['wall_s_per_round']:.3f} | {p['peak_rss_bytes'] / 1e6:.0f} | {final} |"
        )
    lines += ["", "Fitted y ≈ a·x^b against f_c's parameter count x (least squares in log-log):", ""]
    for q, f in fits.items():
        if f is None:
            lines.append(f"- {q}: not fitted (fewer than two sizes)")
        else:
            lines.append(f"- {q}: a = {f['a']:.4g}, b = {f['b']:.3f}, R² = {f['r2']:.3f} over {f['points']} points")
    text = "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(text)
    _plot(out / "scaling.png", points, fits, metric, title)
    return text


PANELS = (
    ("traffic_bytes_per_round", "training traffic per round [MB]", 1e-6),
    ("wall_s_per_round", "wall time per round [s] (in-process)", 1.0),
    ("peak_rss_bytes", "peak RSS of the run [GB]", 1e-9),
)
"""Plotted quantities: key, axis label, unit scale."""


def _plot(path: Path, points: dict[str, dict[str, Any]], fits: dict[str, Any], metric: str, title: str) -> None:
    """One panel per quantity (and the final metric) against f_c's parameters, log x; the fitted power law dashed,
    its exponent in the panel's title; a log y axis only where values span more than 10x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

    panels = [*PANELS, *([(metric, f"final {metric}", 1.0)] if any(p.get(metric) is not None for p in points.values())
                         else [])]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), layout="constrained", squeeze=False)
    xs = np.array([p["client_params"] for p in points.values()], dtype=float)
    for ax, (q, label, scale) in zip(axes[0], panels):
        ys = [p.get(q) for p in points.values()]
        for (name, p), y in zip(points.items(), ys):
            if y is not None:
                ax.scatter(p["client_params"], y * scale, label=name, s=36)
        fit = fits.get(q)
        head = label.split(" [")[0]
        if fit is not None:
            grid = np.geomspace(xs.min(), xs.max(), 50)
            ax.plot(grid, fit["a"] * grid ** fit["b"] * scale, "k--", lw=1, label="fit")
            head += f"\nfit ∝ x^{fit['b']:.2f}, R² = {fit['r2']:.2f}"
        known = [y * scale for y in ys if y]
        log_y = bool(known) and min(known) > 0 and max(known) / min(known) > 10
        ax.set(xscale="log", yscale="log" if log_y else "linear", xlabel="f_c parameters (x)", ylabel=label)
        ax.set_title(head, fontsize=9)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 50k, 100k, 200k, ...: labels never crowd
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)), fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rc = run_experiment(PROG, args, argv, build, plan)  # the runs, and the sweep's accuracy report
    if rc != 0 or args.dry_run:
        return rc
    try:
        from hosfl_dist.experiments.runs import load  # imports torch: after the overrides were checked

        specs, title, _ = build(args)
        points = {name: point(args.config, [load(s) for s in runs], args.metric) for name, runs in specs.items()}
        words = argv if argv is not None else sys.argv[1:]
        command = f"python -m {PROG} " + " ".join(words)
        print(write_scaling(Path(args.out), points, args.metric, command, f"Scaling: {title}"))
    except HosflError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
