"""Combine the four dropout levels' compare reports into one table.

    python results/elastic/combine.py      # writes results/elastic/combined.md, combined.json and elastic.png

Reads results/elastic/dropout_<Q>/table.json (Q = 0, 0.1, 0.3, 0.5): rows = methods, columns = dropout, each cell the
final eval accuracy (%) as mean ± sample std over the seeds that completed, with n. Where the (git-ignored) run
folders are present it adds, per cell, the rounds run, the rounds skipped and the fraction of sampled client-rounds
that delivered (from each run's summary.json `participation`), as means over the seeds. A level or a seed that has not
finished is shown as missing, never filled in. The committed tables are in records.tar.xz: with none of the four on
disk it stops before it writes anything (exit code 2) and says how to unpack them, so the committed combined.md is
never rewritten from nothing.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEVELS = ["0", "0.1", "0.3", "0.5"]
METHODS = ["hosfl", "sfl", "zo_sfl", "mu_splitfed", "frozen_client"]
NAMES = {"hosfl": "HO-SFL", "sfl": "SFL", "zo_sfl": "ZO-SFL", "mu_splitfed": "MU-SplitFed",
         "frozen_client": "frozen_client (HO-SFL, client frozen)"}


def cell(values: list[float]) -> dict:
    n = len(values)
    if n == 0:
        return {"n": 0}
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    return {"n": n, "mean": mean, "std": std, "values": values}


def fmt(c: dict) -> str:
    if c["n"] == 0:
        return "not finished"
    pm = f" ± {100 * c['std']:.2f}" if c["n"] > 1 else ""
    return f"{100 * c['mean']:.2f}{pm} (n={c['n']})"


def participation(level: str, method: str, seeds: list[int]) -> dict | None:
    rounds, skipped, frac = [], [], []
    for s in seeds:
        p = HERE / f"dropout_{level}" / "runs" / method / f"seed{s}" / "summary.json"
        if not p.exists():
            return None
        summ = json.loads(p.read_text())
        part = summ.get("participation") or {}
        rounds.append(summ["rounds"])
        skipped.append(part.get("rounds_skipped", math.nan))
        frac.append(part["delivered"] / part["sampled"] if part.get("sampled") else math.nan)
    if not rounds:
        return None
    return {"rounds": statistics.fmean(rounds), "rounds_skipped": statistics.fmean(skipped),
            "delivered_fraction": statistics.fmean(frac)}


def main() -> int:
    if not any((HERE / f"dropout_{q}" / "table.json").is_file() for q in LEVELS):
        print("error: no results/elastic/dropout_<Q>/table.json on disk: unpack them first: "
              "tar xJf results/elastic/records.tar.xz -C results/elastic", file=sys.stderr)
        return 2
    out: dict = {"levels": LEVELS, "metric": "final eval_accuracy", "cells": {}}
    missing: list[str] = []
    for m in METHODS:
        out["cells"][m] = {}
    for q in LEVELS:
        path = HERE / f"dropout_{q}" / "table.json"
        table = json.loads(path.read_text()) if path.exists() else {"rows": [], "missing": []}
        rows = {r["variant"]: r for r in table["rows"]}
        for miss in table.get("missing", []):
            missing.append(f"dropout {q}: {miss}")
        for m in METHODS:
            r = rows.get(m)
            c = cell(list(r["final"]) if r else [])
            c["seeds"] = list(r["seeds"]) if r else []
            c["participation"] = participation(q, m, c["seeds"]) if r else None
            out["cells"][m][q] = c
    out["missing"] = missing

    lines = ["| method | " + " | ".join(f"dropout {q}" for q in LEVELS) + " |",
             "|---|" + "---:|" * len(LEVELS)]
    for m in METHODS:
        lines.append(f"| {NAMES[m]} | " + " | ".join(fmt(out["cells"][m][q]) for q in LEVELS) + " |")
    lines += ["", "Change of the mean final accuracy from dropout 0 (percentage points):", "",
              "| method | " + " | ".join(f"dropout {q}" for q in LEVELS[1:]) + " |",
              "|---|" + "---:|" * (len(LEVELS) - 1)]
    for m in METHODS:
        base = out["cells"][m]["0"]
        vals = []
        for q in LEVELS[1:]:
            c = out["cells"][m][q]
            vals.append(f"{100 * (c['mean'] - base['mean']):+.2f}" if c["n"] and base["n"] else "—")
        lines.append(f"| {NAMES[m]} | " + " | ".join(vals) + " |")
    if any(out["cells"][m][q]["participation"] for m in METHODS for q in LEVELS):
        lines += ["", "Rounds run / rounds skipped / fraction of sampled client-rounds delivered (means over the "
                  "seeds, from each run's summary.json):", "",
                  "| method | " + " | ".join(f"dropout {q}" for q in LEVELS) + " |", "|---|" + "---:|" * len(LEVELS)]
        for m in METHODS:
            vals = []
            for q in LEVELS:
                p = out["cells"][m][q]["participation"]
                vals.append(f"{p['rounds']:.1f} / {p['rounds_skipped']:.1f} / {p['delivered_fraction']:.3f}"
                            if p else "—")
            lines.append(f"| {NAMES[m]} | " + " | ".join(vals) + " |")
    if missing:
        lines += ["", "Missing runs:", ""] + [f"- {x}" for x in missing]
    (HERE / "combined.md").write_text("\n".join(lines) + "\n")
    (HERE / "combined.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))
    plot(out)


def plot(out: dict) -> None:
    """elastic.png: final accuracy (mean, error bar = sample std over seeds) against dropout, a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in METHODS:
        xs, ys, es = [], [], []
        for q in LEVELS:
            c = out["cells"][m][q]
            if c["n"]:
                xs.append(float(q))
                ys.append(100 * c["mean"])
                es.append(100 * c["std"])
        if xs:
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=NAMES[m].split(" (")[0])
    ax.set_xlabel("clients.dropout (server.min_clients=1)")
    ax.set_ylabel("final eval accuracy (%)")
    ax.set_xticks([float(q) for q in LEVELS])
    ax.set_title("Quickstart (Fashion-MNIST), 19.2k samples, seeds 0-2", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "elastic.png", dpi=120)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
