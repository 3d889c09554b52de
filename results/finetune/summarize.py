"""Collects what results/finetune/run.sh measured into summary.md and the client-depth figures.

    python results/finetune/summarize.py          (run.sh calls it last; reads only finished folders)

It reads each experiment's table.json (written by hosfl_dist.experiments.compare / sweep) and, for the curves, the
runs' metrics.jsonl; it computes nothing the tables do not already hold except the mean accuracy over a run's
evaluations (a convergence-speed figure: the area under the accuracy curve divided by the budget) and the per-depth
means. A folder that does not exist yet is left out and said so. The committed runs and tables are in runs.tar.xz:
unpack them first (``tar xJf results/finetune/runs.tar.xz -C results/finetune``); no table on disk at all, or a table
whose run folders are missing, stops it before it writes anything (exit code 2), so the committed summary.md and
figures are never rewritten from none or half of the inputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hosfl_dist.experiments.runs import safe_name

HERE = Path(__file__).resolve().parent
NAMES = {"hosfl": "HO-SFL", "sfl": "SFL", "fsl_sage": "FSL-SAGE", "zo_sfl": "ZO-SFL", "mu_splitfed": "MU-SplitFed",
         "splitlora": "SplitLoRA", "frozen_client": "frozen_client"}  # fmt: skip
ORDER = ["sfl", "fsl_sage", "zo_sfl", "mu_splitfed", "hosfl"]
# the paper's Table 3 (App. "More results on vision tasks"): CIFAR-10 test accuracy (%), mean (std) over seeds
PAPER = {
    "iid": {"sfl": (77.5, 0.5), "fsl_sage": (62.1, 1.5), "zo_sfl": (12.3, 1.0), "mu_splitfed": (14.0, 0.9),
            "hosfl": (75.0, 0.3)},
    "dirichlet": {"sfl": (69.3, 2.6), "fsl_sage": (37.9, 2.9), "zo_sfl": (11.8, 1.2), "mu_splitfed": (13.6, 1.0),
                  "hosfl": (69.6, 0.8)},
}  # fmt: skip
D_C = {1: 156_864, 2: 681_152, 3: 2_778_304}
"""ResNet-18 client parameters that train (BatchNorm's affine ones frozen) at cut 1 / 2 / 3 (--dry-run)."""
LM_BLOCK_LORA = 15_360
"""SmolLM2-135M: LoRA r=8 on q_proj (576->576) and v_proj (576->192) of one decoder block."""


def table(folder: Path) -> dict[str, Any] | None:
    path = HERE / folder / "table.json"
    return json.loads(path.read_text()) if path.is_file() else None


def pct(mean: float, std: float, n: int) -> str:
    return f"{100 * mean:.1f}" if n == 1 else f"{100 * mean:.1f} ± {100 * std:.1f}"


def rows_by_variant(t: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in t["rows"]}


def curves(folder: Path, variant_dir: str) -> list[list[dict[str, Any]]]:
    """The metrics rows of every seed of one variant."""
    out = []
    for run in sorted((HERE / folder / "runs" / variant_dir).glob("seed*")):  # the folders compare / sweep write
        f = run / "metrics.jsonl"
        if f.is_file():
            out.append([json.loads(line) for line in f.read_text().splitlines()])
    return out


def mean_accuracy(rows: list[dict[str, Any]]) -> float:
    """Area under accuracy vs processed samples (trapezoids) over the budget: higher = faster convergence."""
    x = np.array([r["processed_samples"] for r in rows], dtype=float)
    y = np.array([r["eval_accuracy"] for r in rows], dtype=float)
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0])) if len(x) > 1 else float(y[0])


def method_rows(lines: list[str], suffix: str, order: list[str], gap: bool) -> None:
    """The IID and Dirichlet(1) method tables of folders ``iid<suffix>`` and ``dirichlet<suffix>`` beside the paper's
    Table 3 (methods the paper does not have get "–"); with ``gap``, a last column SFL − HO-SFL in points."""
    parts = {p: table(Path(f"{p}{suffix}")) for p in ("iid", "dirichlet")}
    if not all(parts.values()):
        lines += [f"(not run yet: {', '.join(f'{p}{suffix}' for p, t in parts.items() if t is None)})", ""]
    last = " SFL − HO-SFL (points) |" if gap else ""
    lines += ["| | " + " | ".join(NAMES[m] for m in order) + " |" + last, "|---" * (len(order) + 1 + gap) + "|"]
    for p, t in parts.items():
        if t is None:
            continue
        by = rows_by_variant(t)
        for what, mean_key, std_key in (("final", "mean", "std"), ("best", "best_mean", "best_std")):
            cells = [pct(by[m][mean_key], by[m][std_key], len(by[m]["seeds"])) if m in by else "–" for m in order]
            if gap:
                both = {"sfl", "hosfl"} <= by.keys()
                cells.append(f"{100 * (by['sfl'][mean_key] - by['hosfl'][mean_key]):+.1f}" if both else "–")
            lines.append(f"| here, {p}, {what} (%) | " + " | ".join(cells) + " |")
        paper = [f"{PAPER[p][m][0]} ± {PAPER[p][m][1]}" if m in PAPER[p] else "–" for m in order]
        if gap:
            paper.append(f"{PAPER[p]['sfl'][0] - PAPER[p]['hosfl'][0]:+.1f}")
        lines.append(f"| paper CIFAR-10 {'IID' if p == 'iid' else 'Non-IID'} (%) | " + " | ".join(paper) + " |")


def method_table(lines: list[str]) -> None:
    lines += ["## Methods in the fine-tuning regime (beside the paper's Table 3)", ""]
    method_rows(lines, "", ORDER, gap=False)
    lines += ["", "Here: ResNet-18 pretrained on CIFAR-10 classes 0-4, fine-tuned on classes 5-9 (5 classes: chance is "
              "20%), cut after stage 2 (d_c = 681,152), 32k processed samples, mean ± sample std over 3 seeds; "
              "final = the last evaluation, best = the best evaluation of each run. Paper: ImageNet-pretrained "
              "ResNet-18 on CIFAR-10 (10 classes: chance 10%), 160k samples.", ""]  # fmt: skip


def code_bn_table(lines: list[str]) -> None:
    """The method tables again with BatchNorm per method as the authors' code runs it (freeze_bn=code, issue 34)."""
    lines += ["## Methods with BatchNorm per method as the authors' code runs it (`model.freeze_bn=code`)", ""]
    method_rows(lines, "_code_bn", [*ORDER, "frozen_client"], gap=True)
    lines += ["", "The table above's setting (lr 1e-4, wd 5e-4, 32k samples, seeds 0-2) with `model.freeze_bn=code`: "
              "the server's BatchNorm and a first-order client's train on batch statistics (the client's running "
              "statistics averaged with θc), a zeroth-order client's stay fixed; frozen_client = HO-SFL with the "
              "client never updated. Weights: the third pretraining's (`pretrain_rerun.json`).", ""]  # fmt: skip


def pretraining(lines: list[str]) -> None:
    """The two pretraining records: the one the method tables used, and the one of the later experiment sets."""
    lines += ["## Pretrained weights", "", "| record | used by | held-out accuracy (classes 0-4) | wall s | SHA-256 |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name, used_by in (("pretrain_table.json", "the method tables (`iid/`, `dirichlet/`), `settings/text`, "
                           "`settings/code`"),
                          ("pretrain.json", "`settings/anchor`, `settings/bn_client`, `settings/client_frozen`, "
                           "`ablation_P`, `ablation_mu`, `ablation_P_code*`, `depth_resnet18`, "
                           "`zo_dimension_resnet18`"),
                          ("pretrain_rerun.json", "`settings/code_sfl_bn`, `iid_code_bn`, "
                           "`dirichlet_code_bn`")):  # fmt: skip
        path = HERE / name
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        lines.append(f"| `{name}` | {used_by} | {100 * r['final_eval_accuracy']:.1f} % | {r['wall_time_s']:.0f} | "
                     f"{r.get('sha256', 'not recorded')[:16]} |")  # fmt: skip
    lines += ["", "The same command, seed and thread count on one machine give the same weights; another machine's CPU "
              "kernels gave other ones (each record was made in another session; a fourth run, in a later session, "
              "repeated the third's weights bit for bit).", ""]  # fmt: skip


SETTINGS = [
    ("settings/text", "table", "paper text: lr 1e-5, wd 5e-4, BatchNorm frozen (all)"),
    ("iid", "table", "this table: lr 1e-4, wd 5e-4, BatchNorm frozen (all)"),
    ("settings/code", "table", "authors' code: lr 1e-3, wd 1e-4, server BatchNorm on batch statistics (client)"),
    ("settings/anchor", "later", "this table's settings again (lr 1e-4, wd 5e-4, BatchNorm frozen)"),
    ("settings/bn_client", "later", "lr 1e-4, wd 5e-4, server BatchNorm on batch statistics (client)"),
    ("settings/client_frozen", "later", "diagnostic: this table's HO-SFL with the client held at its pretrained "
     "weights (client lr 1e-12)"),
]  # fmt: skip
"""(folder, which pretraining its runs used: pretrain_table.json or pretrain.json, label)."""


def settings_table(lines: list[str]) -> None:
    head = "| setting | pretraining | n seeds | HO-SFL final | HO-SFL best | SFL final | SFL best |"
    lines += ["## The paper text's settings beside the authors' code's (IID, 32k samples)", "", head, "|---" * 7 + "|"]
    for folder, weights, label in SETTINGS:
        t = table(Path(folder))
        if t is None:
            lines.append(f"| {label} | {weights} | | (not run yet) | | | |")
            continue
        by = rows_by_variant(t)
        cells = []
        for m in ("hosfl", "sfl"):
            r = by.get(m)
            cells += ["–", "–"] if r is None else [pct(r["mean"], r["std"], len(r["seeds"])),
                                                    pct(r["best_mean"], r["best_std"], len(r["seeds"]))]  # fmt: skip
        n = max(len(r["seeds"]) for r in t["rows"])
        lines.append(f"| {label} | {weights} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: accuracy (%) on classes 5-9, mean ± sample std over the seeds; final = the last evaluation, "
              "best = the best evaluation of each run (what the authors' code logs). Pretraining: `table` = the "
              "weights of `pretrain_table.json`, `later` = those of `pretrain.json`; compare rows of one pretraining "
              "(the anchor row is the later weights' reference).", ""]  # fmt: skip


def ablation_table(lines: list[str], folder: str, symbol: str, fixed: str) -> None:
    t = table(Path(folder))
    lines += [f"## HO-SFL: {symbol} ({fixed}, 16k samples, IID)", ""]
    if t is None:
        lines += ["(not run yet)", ""]
        return
    lines += [f"| {symbol} | n seeds | final (%) | best (%) | mean over the run (%) | final train loss |",
              "|---" * 6 + "|"]  # fmt: skip
    for r in t["rows"]:
        runs = curves(Path(folder), safe_name(r["variant"]))
        auc = [mean_accuracy(c) for c in runs]
        loss = [c[-1]["train_loss"] for c in runs if c and c[-1].get("train_loss") is not None]
        n = len(r["seeds"])
        lines.append(f"| {r['variant'].split('=', 1)[1]} | {n} | {pct(r['mean'], r['std'], n)} | "
                     f"{pct(r['best_mean'], r['best_std'], n)} | "
                     f"{pct(float(np.mean(auc)), float(np.std(auc, ddof=1)) if n > 1 else 0.0, n) if auc else '–'} | "
                     f"{np.mean(loss):.4f} |")  # fmt: skip
    lines += ["", f"Plot: `{folder}/accuracy.png` (mean ± std band over seeds).", ""]
    held = table(Path(f"{folder}_client_frozen"))
    if held is not None:
        r = held["rows"][0]
        n = len(r["seeds"])
        lines += [f"The same setting with the client held at its pretrained weights (client lr 1e-12, P = 5): final "
                  f"{pct(r['mean'], r['std'], n)} %, best {pct(r['best_mean'], r['best_std'], n)} % "
                  f"(`{folder}_client_frozen/`).", ""]  # fmt: skip


def depth(lines: list[str], folder: str, methods: list[str], what: str, d_c: dict[int, int]) -> None:
    t = table(Path(folder))
    lines += [f"## Client depth: {what}", ""]
    if t is None:
        lines += ["(not run yet)", ""]
        return
    by = rows_by_variant(t)
    cuts = sorted(d_c)
    lines += ["| method | " + " | ".join(f"cut {c} (d_c {d_c[c]:,})" for c in cuts) + " |", "|---" * (len(cuts) + 1)
              + "|"]  # fmt: skip
    series: dict[str, dict[int, list[list[dict[str, Any]]]]] = {}
    for m in methods:
        cells = []
        for c in cuts:
            name = f"algorithm.name={m},split.cut={c}"
            r = by.get(name)
            runs = curves(Path(folder), safe_name(name))
            series.setdefault(m, {})[c] = runs
            if r is None or not runs:
                cells.append("–")
                continue
            auc = float(np.mean([mean_accuracy(x) for x in runs]))
            cells.append(f"{pct(r['mean'], r['std'], len(r['seeds']))} (run mean {100 * auc:.1f})")
        lines.append(f"| {NAMES[m]} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: final accuracy (%, mean ± std over seeds where there are several) and, in brackets, the "
              "mean accuracy over the run's evaluations (area under the curve over the budget: the convergence "
              f"speed). Plot: `{folder}/depth.png`.", ""]  # fmt: skip
    plot_depth(HERE / folder / "depth.png", series, what, d_c)


def plot_depth(path: Path, series: dict[str, dict[int, list[list[dict[str, Any]]]]], what: str,
               d_c: dict[int, int]) -> None:  # fmt: skip
    """One panel per method, one curve per cut (mean over seeds, band = min-max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4.3 * len(series), 3.9), sharey=True, layout="constrained")
    for ax, (m, by_cut) in zip(np.atleast_1d(axes), series.items()):
        for c, runs in by_cut.items():
            if not runs:
                continue
            n = min(len(r) for r in runs)
            x = np.array([r["processed_samples"] for r in runs[0][:n]])
            y = np.array([[r["eval_accuracy"] for r in run[:n]] for run in runs]) * 100
            ax.plot(x, y.mean(0), label=f"cut {c} (d_c {d_c[c] / 1e3:,.0f}k)")
            if len(runs) > 1:
                ax.fill_between(x, y.min(0), y.max(0), alpha=0.2)
        finals = {tuple(r["eval_accuracy"] for r in runs[0]) for runs in by_cut.values() if runs}
        if len(finals) == 1 and len(by_cut) > 1:  # e.g. SFL: FedAvg of both sides is the same at every cut
            ax.text(0.5, 0.5, "every cut gives the same curve", transform=ax.transAxes, ha="center", fontsize=8)
        ax.set(title=NAMES[m], xlabel="processed samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel("held-out accuracy (%)")
    fig.suptitle(f"Client depth: {what}", fontsize=10)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def lm_client_frozen(lines: list[str]) -> None:
    """HO-SFL on SmolLM2 with the client's LoRA held at its start, beside the trained client at the same cuts."""
    frozen, trained = table(Path("depth_smollm2_client_frozen")), table(Path("depth_smollm2"))
    lines += ["## Client depth diagnostic: SmolLM2-135M HO-SFL with the client's LoRA held at its start", ""]
    if frozen is None or trained is None:
        lines += ["(not run yet)", ""]
        return
    lines += ["| cut | client trained: final (%) | eval loss | client held (lr 1e-12): final (%) | eval loss |",
              "|---|---|---|---|---|"]  # fmt: skip
    for cut in (2, 8):
        cells = []
        for folder, name in (("depth_smollm2", f"algorithm.name=hosfl,split.cut={cut}"),
                             ("depth_smollm2_client_frozen", f"split.cut={cut}")):  # fmt: skip
            runs = curves(Path(folder), safe_name(name))
            last = runs[0][-1] if runs else None
            cells += ["–", "–"] if last is None else [f"{100 * last['eval_accuracy']:.1f}", f"{last['eval_loss']:.4f}"]
        lines.append(f"| {cut} | " + " | ".join(cells) + " |")
    lines += ["", "If the two agree, the client's zeroth-order LoRA updates are too small at this budget to change the "
              "result, and accuracy cannot show how HO-SFL's speed depends on d_c here.", ""]  # fmt: skip


def zo_dimension(lines: list[str], name: str, what: str) -> None:
    """hosfl_dist.experiments.zo_dimension's cosines per cut and P, HO-SFL (over θc) beside ZO-SFL (over the whole
    model)."""
    path = HERE / f"{name}.json"
    lines += [f"## The zeroth-order estimate against the true gradient per cut: {what}", ""]
    if not path.is_file():
        lines += ["(not run yet)", ""]
        return
    results = json.loads(path.read_text())["results"]
    ps = sorted({r["P"] for res in results for r in res["rows"]})
    head = " | ".join(f"{m} P={p}" for m in ("HO-SFL", "ZO-SFL") for p in ps)
    lines += [f"| cut | d_c | d (ZO-SFL) | {head} |", "|---" * (3 + 2 * len(ps)) + "|"]
    for res in results:
        by = {(r["method"], r["P"]): r for r in res["rows"]}
        pairs = [by[m, p] for m in ("hosfl", "zo_sfl") for p in ps]
        cells = [f"{r['cos_mean']:.1e} ({r['cos_gaussian']:.1e})" for r in pairs]
        lines.append(f"| {res['cut']} | {res['d_c']:,} | {res['d_c'] + res['d_s']:,} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: cos(ĝ, g), mean over the repeats, and in brackets √(P/(d+P+1)), a Gaussian estimator's "
              f"expectation. Spreads and norms: `{name}.md` "
              "(`python -m hosfl_dist.experiments.zo_dimension`).", ""]  # fmt: skip


def gemma(lines: list[str]) -> None:
    t = table(Path("gemma3_270m"))
    lines += ["## Gemma-3-270M (LoRA, offline sentiment reviews, 960 samples, 1 seed)", ""]
    if t is None:
        lines += ["(not run yet)", ""]
        return
    lines += ["| method | final accuracy (%) | best (%) | wall s / run |", "|---|---|---|---|"]
    for r in t["rows"]:
        wall = r.get("wall_time_s")
        lines.append(f"| {NAMES.get(r['variant'], r['variant'])} | {100 * r['mean']:.1f} | "
                     f"{100 * r['best_mean']:.1f} | {'–' if wall is None else f'{wall:.0f}'} |")  # fmt: skip
    lines += ["", "Plot: `gemma3_270m/accuracy.png`.", ""]


def tables_without_runs() -> list[str]:
    """Experiment folders with a table.json but no run folders beside it (the archive not unpacked)."""
    tables = HERE.glob("**/table.json")
    return sorted(str(t.parent.relative_to(HERE)) for t in tables if not (t.parent / "runs").is_dir())


def main() -> int:
    if (HERE / "runs.tar.xz").is_file() and not any(HERE.glob("**/table.json")):
        print(f"error: no experiment table in {HERE.name}/ (they are packed with the runs): unpack them first: "
              "tar xJf results/finetune/runs.tar.xz -C results/finetune", file=sys.stderr)  # fmt: skip
        return 2
    if missing := tables_without_runs():
        print(f"error: {len(missing)} experiment folder(s) have a table but no runs/ ({', '.join(missing[:3])}, ...): "
              f"unpack the committed runs first: tar xJf results/finetune/runs.tar.xz -C results/finetune",
              file=sys.stderr)  # fmt: skip
        return 2
    lines = ["# Fine-tuning regime: collected results", "", "Written by `python results/finetune/summarize.py` from "
             "the experiment folders beside it (`bash results/finetune/run.sh` makes them).", ""]  # fmt: skip
    pretraining(lines)
    method_table(lines)
    code_bn_table(lines)
    settings_table(lines)
    ablation_table(lines, "ablation_P", "P", "μ = 1e-4 as the paper's P ablation")
    ablation_table(lines, "ablation_mu", "μ", "P = 10 as the paper's μ ablation")
    ablation_table(lines, "ablation_P_code", "P", "the authors' code's settings: lr 1e-3, wd 1e-4, freeze_bn=client, "
                   "μ = 1e-4")  # fmt: skip
    depth(lines, "depth_resnet18", ["hosfl", "zo_sfl", "sfl"], "ResNet-18 cut after stage 1 / 2 / 3", D_C)
    depth(lines, "depth_smollm2", ["hosfl", "zo_sfl", "splitlora"], "SmolLM2-135M, 2 / 4 / 6 / 8 client blocks",
          {c: c * LM_BLOCK_LORA for c in (2, 4, 6, 8)})  # fmt: skip
    lm_client_frozen(lines)
    zo_dimension(lines, "zo_dimension_resnet18", "ResNet-18 (the fine-tuning setting)")
    zo_dimension(lines, "zo_dimension_smollm2", "SmolLM2-135M (the depth setting)")
    gemma(lines)
    (HERE / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
