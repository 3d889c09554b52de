"""A run's curves: ``curves.png`` in its folder, drawn from its metrics rows when it completes (``job.plots``).

Three panels against processed samples (the paper's x-axis): the evaluation's score (accuracy, or F1 / exact match
for generation tasks) with the best so far marked; the evaluation and training losses; and the traffic by category
(cumulative, log scale). ``python -m hosfl_dist.experiments.report RUN_DIR…`` draws one run or several runs over each
other the same way (several: each run's training traffic summed over the categories).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.transport.wire import PAPER_CATEGORIES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SCORES = ("eval_accuracy", "eval_f1", "eval_exact_match")
"""What the first panel shows, the first a run reports."""
CATEGORY_LABELS = {
    "uplink_activations": "up: activations",
    "uplink_model": "up: model",
    "uplink_scalars": "up: scalars",
    "downlink_gradients": "down: gradients",
    "downlink_model": "down: model",
    "downlink_scalars_seeds": "down: scalars + seeds",
}


def _points(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["processed_samples"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [float(x) for x, _ in pts], [float(y) for _, y in pts]


COINCIDE = 0.05
"""Two traffic lines within this fraction of each other at every point are drawn as one (on the log axis the one
would hide the other): z up and λ down differ by the labels and masks sent with z."""


def _coincide(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    return len(a) == len(b) and all(xa == xb and abs(ya - yb) <= COINCIDE * max(ya, yb) for (xa, ya), (xb, yb) in
                                    zip(a, b))  # fmt: skip


def curves_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str) -> Figure:
    """The figure of one or several runs (label -> metrics rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (score_ax, loss_ax, comm_ax) = plt.subplots(1, 3, figsize=(13.5, 4.0), layout="constrained")
    several = len(runs) > 1
    for i, (name, rows) in enumerate(runs.items()):
        color = f"C{i}"
        score = next((k for k in SCORES if any(isinstance(r.get(k), (int, float)) for r in rows)), None)
        if score is not None:
            x, y = _points(rows, score)
            score_ax.plot(x, [100 * v for v in y], "o-", ms=3, color=color, label=name if several else score)
            best = max(range(len(y)), key=lambda j: (y[j], -j)) if y else None
            if best is not None and not several:
                score_ax.plot(x[best], 100 * y[best], "*", ms=11, color=color, label=f"best {100 * y[best]:.2f} %")
        for key, style in (("eval_loss", "o-"), ("train_loss", "s--")):
            x, y = _points(rows, key)
            if x:
                loss_ax.plot(x, y, style, ms=3, color=color, label=f"{name}: {key}" if several else key)
        comm = [(r["processed_samples"], r.get("comm") or {}) for r in rows]
        if several:  # one line per run: its training traffic in all (per category, the lines would be a thicket)
            pts = [(x, sum(c.get(cat, 0) for cat in PAPER_CATEGORIES) / 2**20) for x, c in comm]
            pts = [(x, y) for x, y in pts if y > 0]  # log scale: nothing sent yet is no point
            if pts:
                comm_ax.plot(*zip(*pts), "o-", ms=3, color=color, label=f"{name}: training traffic")
            continue
        drawn: list[tuple[list[tuple[float, float]], list[str]]] = []  # a line's points, the categories on it
        for cat in PAPER_CATEGORIES:
            pts = [(x, c[cat] / 2**20) for x, c in comm if c.get(cat)]
            if not pts:
                continue
            # z up and λ down carry (nearly) the same bytes: one line named by both, none hidden under the other
            same = next((cats for line, cats in drawn if _coincide(line, pts)), None)
            if same is not None:
                same.append(cat)
            else:
                drawn.append((pts, [cat]))
        for pts, cats in drawn:
            j = PAPER_CATEGORIES.index(cats[0])
            style = ("o" if cats[0].startswith("up") else "s") + ("-" if cats[0].startswith("up") else "--")
            label = " ≈ ".join(CATEGORY_LABELS[c] for c in cats)
            comm_ax.plot(*zip(*pts), style, ms=3, color=f"C{j}", label=label)
    score_ax.set_ylabel("evaluation score (%)")
    loss_ax.set_ylabel("loss")
    comm_ax.set_ylabel("cumulative traffic (MiB)")  # binary units, as table.md's
    comm_ax.set_yscale("log")
    traffic = "training traffic (the paper's categories summed)" if several else "traffic by category"
    for ax, what in ((score_ax, "evaluation"), (loss_ax, "losses"), (comm_ax, traffic)):
        ax.set_xlabel("processed samples")
        ax.set_title(what, fontsize=10)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def write_curves(path: Path, runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str) -> Path:
    """Draw :func:`curves_figure` into ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = curves_figure(runs, title)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
