"""Tables and plots of an experiment: the last and the best evaluation, mean ± std over seeds, traffic by category
(paper Table 5), metric vs processed samples with a band over seeds, and traffic breakdown bars."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hosfl_dist.core.stopping import higher_is_better
from hosfl_dist.transport.wire import PAPER_CATEGORIES
from hosfl_dist.experiments.runs import RunData

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CATEGORY_LABELS = {
    "uplink_activations": "Uplink (Act)",
    "uplink_model": "Uplink (Model)",
    "uplink_scalars": "Uplink (Scalar)",
    "downlink_gradients": "Downlink (Grad)",
    "downlink_model": "Downlink (Model)",
    "downlink_scalars_seeds": "Downlink (Scalar/Seed)",
}
METHOD_LABELS = {
    "hosfl": "HO-SFL",
    "sfl": "SFL",
    "splitlora": "SplitLoRA",
    "fsl_sage": "FSL-SAGE",
    "zo_sfl": "ZO-SFL",
    "mu_splitfed": "MU-SplitFed",
}
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


@dataclass
class VariantSummary:
    """One row of the table: a method (or grid point) over its seeds."""

    variant: str
    seeds: list[int]
    final: list[float]
    mean: float
    std: float
    processed_samples: float
    comm_bytes: dict[str, float]
    training_total_bytes: float
    wall_time_s: float
    best: list[float] = field(default_factory=list)
    """Per seed: the best evaluation of the run (``best_eval_accuracy`` for eval_accuracy)."""
    best_round: list[int | None] = field(default_factory=list)
    """Per seed: the first round that reached it."""
    best_mean: float = float("nan")
    best_std: float = float("nan")
    roles: dict[str, Any] = field(default_factory=dict)
    """Per role, from the runs' summary.json (:func:`role_costs`, mean over seeds): how the runs were started, each
    role's peak memory, the client workers' and the server's time per round."""
    stopped: list[dict[str, Any] | None] = field(default_factory=list)
    """Per seed: where the run stopped early (``round``, ``processed_samples``, ``by``; summary.json's
    ``stopped``), None for a run that reached its budget."""


def final_metric(run: RunData, metric: str) -> float:
    """The metric of the run's last evaluation (at the end of its budget)."""
    for row in reversed(run.rows):
        if row.get(metric) is not None:
            return float(row[metric])
    raise KeyError(f"run {run.spec.out_dir} has no {metric!r} in metrics.jsonl")




def best_metric(run: RunData, metric: str) -> tuple[float, int | None]:
    """The best evaluation of the run and the first round that reached it.

    For eval_accuracy the runner writes the running best into every evaluation row (``best_eval_accuracy``,
    ``best_round``); runs written before it did, and other metrics, take the best over the rows."""
    if metric == "eval_accuracy":
        for row in reversed(run.rows):
            if row.get("best_eval_accuracy") is not None:
                return float(row["best_eval_accuracy"]), row.get("best_round")
    scored = [r for r in run.rows if r.get(metric) is not None]
    if not scored:
        raise KeyError(f"run {run.spec.out_dir} has no {metric!r} in metrics.jsonl")
    sign = 1.0 if higher_is_better(metric) else -1.0
    best = max(scored, key=lambda r: sign * r[metric])  # max() keeps the first of equals: the earliest round
    return float(best[metric]), best.get("round")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single seed)."""
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def role_costs(summary: dict[str, Any]) -> dict[str, Any]:
    """What a run's summary.json says per role: its engine and processes, each role's peak RSS (and peak CUDA memory)
    over its ranks (``server``, ``server-shard``, ``worker``; ``in-process`` for one process), the client workers'
    time per round (the slowest worker's mean) and the server's compute per round (its calls' time over the rounds)."""
    rounds = max(1, summary.get("rounds") or 1)
    peaks: dict[str, dict[str, float]] = {"peak_rss_bytes": {}, "peak_cuda_bytes": {}}
    for entry in summary.get("memory") or []:
        for key, by_role in peaks.items():
            value = entry.get(key)
            if isinstance(value, (int, float)):
                role = str(entry.get("role", "?"))
                by_role[role] = max(by_role.get(role, 0), value)
    transport = summary.get("transport") or {}
    workers = [w for w in (transport.get("workers") or {}).values() if w.get("rounds")]
    compute = (transport.get("server") or {}).get("compute_s") or {}
    roles = summary.get("roles") or {}
    return {
        "engine": summary.get("engine", ""),
        "processes": roles.get("world_size") or len(summary.get("memory") or []) or 1,
        "server_ranks": len(roles.get("server_ranks") or [0]),
        **{key: by_role for key, by_role in peaks.items() if by_role},
        "worker_s_per_round": max((w["round_s"] / w["rounds"] for w in workers), default=None),
        "server_compute_s_per_round": sum(compute.values()) / rounds if compute else None,
    }


def mean_roles(costs: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`role_costs` of a row's runs: numbers averaged over them (a number all share stays as it is), the rest
    as the first run says."""

    def mean(values: list[Any]) -> Any:
        if values and all(isinstance(v, dict) for v in values):
            keys = dict.fromkeys(k for v in values for k in v)
            return {k: mean([v[k] for v in values if k in v]) for k in keys}
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers:
            return float(np.mean(numbers)) if len(set(numbers)) > 1 else numbers[0]
        return values[0] if values else None

    return mean(costs) if costs else {}


def summarize(variants: dict[str, list[RunData]], metric: str) -> list[VariantSummary]:
    out = []
    for name, runs in variants.items():
        finals = [final_metric(r, metric) for r in runs]
        mean, std = mean_std(finals)
        bests = [best_metric(r, metric) for r in runs]
        best_mean, best_std = mean_std([b for b, _ in bests])
        comm = {c: float(np.mean([r.summary["comm"]["bytes"][c] for r in runs])) for c in PAPER_CATEGORIES}
        out.append(
            VariantSummary(
                variant=name,
                seeds=[r.spec.seed for r in runs],
                final=finals,
                mean=mean,
                std=std,
                processed_samples=float(np.mean([r.summary["processed_samples"] for r in runs])),
                comm_bytes=comm,
                training_total_bytes=sum(comm.values()),
                wall_time_s=float(np.mean([r.summary.get("wall_time_s", float("nan")) for r in runs])),
                best=[b for b, _ in bests],
                best_round=[r for _, r in bests],
                best_mean=best_mean,
                best_std=best_std,
                roles=mean_roles([role_costs(r.summary) for r in runs]),
                stopped=[stopped_at(r.summary) for r in runs],
            )
        )
    return out


def stopped_at(summary: dict[str, Any]) -> dict[str, Any] | None:
    """Where a run stopped early (its summary's ``stopped``: round, processed samples, by what), None if it did not."""
    stopped = summary.get("stopped")
    if summary.get("status") != "stopped" or not isinstance(stopped, dict):
        return None
    return {k: stopped.get(k) for k in ("round", "processed_samples", "by")}


def _stops(row: VariantSummary) -> str:
    """The "stopped early" cell: where each seed's run stopped (– for one that reached its budget)."""
    where = [(seed, s) for seed, s in zip(row.seeds, row.stopped) if s is not None]
    if not where:
        return "–"
    return "; ".join(f"seed {seed}: round {s['round']}, {s['processed_samples']:,} samples" for seed, s in where)


def unit_for(nbytes: float) -> tuple[str, int]:
    for name, size in UNITS:
        if nbytes >= size:
            return name, size
    return UNITS[-1]


def label(variant: str) -> str:
    return METHOD_LABELS.get(variant, variant)


def _pct(metric: str) -> bool:
    return "accuracy" in metric


def traffic_ratio(rows: list[VariantSummary], num: str = "hosfl", den: str = "sfl") -> float | None:
    by = {r.variant: r.training_total_bytes for r in rows}
    if num in by and den in by and by[den] > 0:
        return by[num] / by[den]
    return None


def row_labels(variants: list[str]) -> tuple[str, list[str]]:
    """The first column's header and cells: a sweep's rows (``key=value,key=value`` with the same keys in every
    row) are headed by the swept keys and show their values; anything else is a method."""
    points = [[item.partition("=") for item in v.split(",")] for v in variants]
    keys = [[k for k, _, _ in p] for p in points]
    if points and all(sep for p in points for _, sep, _ in p) and all(k == keys[0] for k in keys):
        return ", ".join(keys[0]), [", ".join(value for _, _, value in p) for p in points]
    return "method", [label(v) for v in variants]


def over_seeds(mean: float, std: float, n: int, scale: float) -> str:
    """``mean ± std``; a single seed has no spread to show, so its value stands alone (the n column says 1)."""
    return f"{mean * scale:.2f}" if n == 1 else f"{mean * scale:.2f} ± {std * scale:.2f}"


def _rounds(rounds: list[int | None]) -> str:
    known = [str(r) for r in rounds if r is not None]
    if not known:
        return ""
    return f" (round{'s' if len(known) > 1 else ''} {', '.join(known)})"


def write_table(
    out: Path,
    rows: list[VariantSummary],
    metric: str,
    title: str,
    extra: dict[str, Any],
    missing: list[dict[str, Any]] | None = None,
    notes: list[str] | None = None,
) -> str:
    """table.md (human) and table.json (every number, per seed); returns the markdown. Rows whose runs ran
    distributed get a table per role; ``missing`` (runs that did not complete: row, seed, run, why) a section that
    names each; ``notes`` (lines) end it."""
    scale = 100.0 if _pct(metric) else 1.0
    pct = " (%)" if scale == 100 else ""
    unit, size = unit_for(max((r.training_total_bytes for r in rows), default=1.0))
    row_header, names = row_labels([r.variant for r in rows])
    head = [row_header, f"final {metric}{pct}", f"best {metric}{pct}", "n seeds", "processed samples"]
    head += [f"{CATEGORY_LABELS[c]} [{unit}]" for c in PAPER_CATEGORIES]
    head += [f"Total [{unit}]", "wall s / run (summary.json: after set-up)"]
    early = any(s is not None for r in rows for s in r.stopped)
    if early:  # a column only where a point stopped before its budget: where it stopped
        head.append("stopped early")
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in zip(names, rows):
        n = len(r.seeds)
        cells = [
            name,
            over_seeds(r.mean, r.std, n, scale),
            over_seeds(r.best_mean, r.best_std, n, scale) + _rounds(r.best_round),
            str(n),
            f"{r.processed_samples:,.0f}",
        ]
        cells += [f"{r.comm_bytes[c] / size:.4g}" for c in PAPER_CATEGORIES]
        cells += [f"{r.training_total_bytes / size:.4g}", f"{r.wall_time_s:.1f}"]
        if early:
            cells.append(_stops(r))
        lines.append("| " + " | ".join(cells) + " |")
    best_word = "highest" if higher_is_better(metric) else "lowest"
    lines += [
        "",
        f"Final {metric}: the last evaluation of each run (at the end of its sample budget); best: the {best_word} "
        "evaluation of each run and the round(s) that first reached it (one per seed). Both are the mean ± sample "
        "standard deviation over the row's n seeds (a single value where n = 1). Traffic: training bytes per "
        "category as in the paper's Table 5 (binary units), mean over seeds, counted from the tensors that crossed "
        "the client-server boundary.",
    ]
    if early:
        lines.append("Stopped early: the runs that ended before their sample budget (train.early_stopping, or a "
                     "callback), with the round and processed samples they stopped at; their final evaluation is "
                     "that round's, their traffic what they sent until then.")  # fmt: skip
    ratio = traffic_ratio(rows)
    if ratio is not None:
        lines.append(f"Traffic ratio HO-SFL / SFL: {ratio:.3f} (paper, CIFAR-10 IID ResNet-18: 2.44 / 4.20 = 0.581).")
    if any(r.roles.get("engine") == "torchrun" for r in rows):
        lines += role_table(rows, row_header, names)
    if missing:
        lines += missing_section(missing, sum(len(r.seeds) for r in rows))
    if notes:
        lines += ["", *notes]
    md = "\n".join(lines) + "\n"
    (out / "table.md").write_text(md)
    payload = {
        "title": title,
        "metric": metric,
        "rows": [asdict(r) for r in rows],
        "traffic_ratio_hosfl_over_sfl": ratio,
        "row_header": row_header,
        "missing": list(missing or []),
        **extra,
    }
    (out / "table.json").write_text(json.dumps(payload, indent=2) + "\n")
    return md


ROLE_ORDER = ("server", "server-shard", "worker", "in-process")


def role_table(rows: list[VariantSummary], row_header: str, names: list[str]) -> list[str]:
    """table.md's lines per role: each row's processes, each role's peak memory and the time per round."""
    roles = {k: [r for r in ROLE_ORDER if any(r in row.roles.get(k, {}) for row in rows)]
             for k in ("peak_rss_bytes", "peak_cuda_bytes")}  # fmt: skip
    head = [row_header, "processes", "server ranks"]
    head += [f"{role} peak RSS [MiB]" for role in roles["peak_rss_bytes"]]
    head += [f"{role} peak CUDA [MiB]" for role in roles["peak_cuda_bytes"]]
    head += ["worker s / round", "server compute s / round"]
    lines = ["", "## Per role", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in zip(names, rows):
        c = row.roles
        cells = [name, str(c.get("processes", "")), str(c.get("server_ranks", ""))]
        for key, shown in roles.items():
            cells += [_mib(c.get(key, {}).get(role)) for role in shown]
        cells += [_seconds(c.get("worker_s_per_round")), _seconds(c.get("server_compute_s_per_round"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "From each run's summary.json, mean over seeds: a role's peak memory is its largest rank's (peak "
              "RSS, the kernel's VmHWM); worker s / round the slowest client worker's mean round; server compute s / "
              "round the server's calls (evaluation included) over the rounds, on rank 0."]  # fmt: skip
    return lines


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:,.0f}"


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def missing_section(missing: list[dict[str, Any]], present: int) -> list[str]:
    """table.md's lines naming every run the table lacks and why."""
    total = present + len(missing)
    lines = ["", "## Missing", "", f"{len(missing)} of {total} run(s) did not complete and are not in the table or "
             "the plots:", ""]  # fmt: skip
    lines += [f"- {m['row']}, seed {m['seed']}: {m['why']}" for m in missing]
    return lines


def curve(runs: list[RunData], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Metric vs processed samples: each seed interpolated onto the first seed's evaluation points."""
    grid = np.asarray([r["processed_samples"] for r in runs[0].rows if r.get(metric) is not None], dtype=float)
    ys = []
    for run in runs:
        pts = [(r["processed_samples"], r[metric]) for r in run.rows if r.get(metric) is not None]
        x, y = np.asarray(pts, dtype=float).T
        ys.append(np.interp(grid, x, y))
    ys_arr = np.vstack(ys)
    std = ys_arr.std(axis=0, ddof=1) if len(ys) > 1 else np.zeros_like(grid)
    return grid, ys_arr.mean(axis=0), std


MIN_EVALUATIONS = 3
"""Fewer evaluations of a run than this and its curve is a line drawn between measurements: the command says so."""


def few_evaluations(name: str, runs: list[list[dict[str, Any]]], metric: str, samples: float | None) -> str | None:
    """A note when a run of ``name`` (its metrics rows in ``runs``, one list per run) has fewer than
    :data:`MIN_EVALUATIONS` evaluations of ``metric``, with a ``train.eval_every_samples`` that gives about five
    (from the run's processed ``samples``), or, where every round was evaluated already, the number of rounds (an
    SFL round can be a whole budget); None otherwise."""
    n = min(sum(isinstance(r.get(metric), (int, float)) for r in rows) for rows in runs)
    if n >= MIN_EVALUATIONS:
        return None
    each = " each" if len(runs) > 1 else ""
    note = (f"note: {label(name)}: {n} evaluation(s) of {metric}{each}; its curve joins {n} measurement(s) with a "
            "straight line")  # fmt: skip
    known = [[r["round"] for r in rows if isinstance(r.get("round"), int)] for rows in runs]
    rounds = min(max(k) for k in known) if all(known) else None
    if rounds is not None and n >= rounds + 1:  # every round evaluated already: no interval adds a point
        return f"{note}: evaluations come at the end of a round and it ran {rounds} round(s)"
    hint = f"train.eval_every_samples={int(samples) // 4}" if samples and samples >= 4 else "train.eval_every_samples"
    return f"{note}: {hint} gives about five"


def wrap_title(title: str, width: int = 75) -> str:
    """A figure title on as many lines as it needs at ``width`` characters, so a long one is never cut off."""
    return "\n".join(textwrap.wrap(title, width)) or title


def metric_figure(variants: dict[str, list[RunData]], metric: str, title: str) -> Figure:
    """The metric against processed samples, one line per variant with a band of ± one std over its seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = 100.0 if _pct(metric) else 1.0
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for name, runs in variants.items():
        x, mean, std = curve(runs, metric)
        # a marker per evaluation: two measurements joined by a line must not read as a measured straight line
        (line,) = ax.plot(x, mean * scale, marker="o", ms=3.5, label=f"{label(name)} (n={len(runs)})")
        ax.fill_between(x, (mean - std) * scale, (mean + std) * scale, color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("processed samples")
    ax.set_ylabel(metric + (" (%)" if scale == 100 else ""))
    ax.set_title(wrap_title(title), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_metric(path: Path, variants: dict[str, list[RunData]], metric: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = metric_figure(variants, metric, title)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def traffic_figure(rows: list[VariantSummary], title: str) -> Figure:
    """Traffic by category per method: stacked bars with their totals above them, or grouped bars on a log axis
    when totals span > 20x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, size = unit_for(max((r.training_total_bytes for r in rows), default=1.0))
    totals = [r.training_total_bytes for r in rows if r.training_total_bytes > 0]
    log = bool(totals) and max(totals) / min(totals) > 20
    cats = [c for c in PAPER_CATEGORIES if any(r.comm_bytes[c] > 0 for r in rows)]
    x = np.arange(len(rows))
    # constrained layout makes room for the title, the rotated tick labels and the legend outside the axes
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 3.5), 4.2), layout="constrained")
    if log:
        width = 0.8 / max(len(cats), 1)
        for i, c in enumerate(cats):
            vals = [r.comm_bytes[c] / size for r in rows]
            ax.bar(x + (i - (len(cats) - 1) / 2) * width, vals, width, label=CATEGORY_LABELS[c])
        ax.set_yscale("log")
    else:
        bottom = np.zeros(len(rows))
        for c in cats:
            vals = np.asarray([r.comm_bytes[c] / size for r in rows])
            ax.bar(x, vals, 0.6, bottom=bottom, label=CATEGORY_LABELS[c])
            bottom += vals
        for xi, tot in zip(x, bottom):
            ax.text(xi, tot, f"{tot:.3g}", ha="center", va="bottom", fontsize=8)
        if bottom.max() > 0:  # headroom inside the axes for the totals, so they never reach the title
            ax.set_ylim(0, bottom.max() * 1.15)
    ax.set_xticks(x, [label(r.variant) for r in rows], rotation=20)
    ax.set_ylabel(f"training traffic [{unit}]" + (" (log)" if log else ""))
    ax.set_title(wrap_title(title), fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_traffic(path: Path, rows: list[VariantSummary], title: str) -> None:
    import matplotlib.pyplot as plt

    fig = traffic_figure(rows, title)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(
    out: Path,
    variants: dict[str, list[RunData]],
    metric: str,
    title: str,
    extra: dict[str, Any],
    missing: list[dict[str, Any]] | None = None,
    notes: list[str] | None = None,
) -> str:
    """All outputs of an experiment into ``out``; returns table.md's text. ``missing``: the runs that did not
    complete (named in the table; no plots when no run completed); ``notes``: table.md's last lines."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(variants, metric)
    md = write_table(out, rows, metric, title, extra, missing, notes)
    if rows:
        plot_metric(out / ("accuracy.png" if metric == "eval_accuracy" else f"{metric}.png"), variants, metric, title)
        plot_traffic(out / "traffic.png", rows, title)
    return md


def main(argv: list[str] | None = None) -> int:
    """``python -m hosfl_dist.experiments.report RUN_DIR… [--out PNG]``: the curves of one run or several."""
    import argparse
    import sys

    from hosfl_dist.runtime.record.curves import write_curves

    p = argparse.ArgumentParser(
        prog="hosfl_dist.experiments.report",
        description="Draw the curves of one or several runs (evaluation score, losses and traffic against processed "
        "samples) from their metrics.jsonl, as each run's own curves.png.",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders (each with metrics.jsonl)")
    p.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/curves.png for one run, curves.png "
                   "here for several)")  # fmt: skip
    args = p.parse_args(argv)
    series: dict[str, list[dict[str, Any]]] = {}
    for folder in args.runs:
        try:
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            print(f"error: {folder}: no readable metrics.jsonl ({exc})", file=sys.stderr)
            return 2
        try:
            algorithm = json.loads((folder / "summary.json").read_text()).get("algorithm", "")
        except (OSError, ValueError):
            algorithm = ""
        series[f"{folder.name} ({algorithm})" if algorithm else folder.name] = rows
    from hosfl_dist.runtime.record.curves import SCORES

    for name, rows in series.items():
        score = next((k for k in SCORES if any(isinstance(r.get(k), (int, float)) for r in rows)), "eval_loss")
        samples = max((r.get("processed_samples") or 0 for r in rows), default=0)
        note = few_evaluations(name, [rows], score, samples)
        if note is not None:
            print(note)
    out = args.out or (args.runs[0] / "curves.png" if len(args.runs) == 1 else Path("curves.png"))
    if out.resolve() not in {(folder / "curves.png").resolve() for folder in args.runs}:  # a run's own curves may be
        from hosfl_dist.runfolder.folder import run_in_the_way  # drawn again; nothing else of a run is replaced

        run = run_in_the_way(out, below=False)
        if run is not None:
            print(f"error: --out {out} is inside the run folder {run}: write the curves elsewhere", file=sys.stderr)
            return 2
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.safe_files import check_output_file

    try:
        check_output_file(out, "--out")  # never a device, a FIFO (savefig would wait on it) or a link out
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    title = ", ".join(series) if len(series) > 1 else f"{next(iter(series))}: {args.runs[0]}"
    try:
        write_curves(out, series, title)
    except OSError as exc:
        print(f"error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
