"""Aggregation traffic per client per round, HO-SFL vs SFL, as the client model grows (d_c × 1, 2, 4, 8).

    python -m bench.agg_traffic [--widths 16 32 64 128] [--out bench/out]

Runs one round of each method through the in-process runtime (small CNN cut after its first conv block on the
synthetic task; d_c = 10·width, so widths 16, 32, 64, 128 give d_c = 160, 320, 640, 1280) and reads the bytes the
transport counted by category (paper Table 5). Aggregation traffic is what the clients exchange to agree on θc:
HO-SFL uploads P float32 scalars per client (``uplink_scalars``: 4·P bytes, whatever d_c) and receives v̄ and the
P seeds (``downlink_scalars_seeds``); SFL uploads and downloads θc (``uplink_model`` / ``downlink_model``:
4·d_c bytes each). The per-sample activation traffic (z up, λ down) is the same for both and is not aggregation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.config import load_config
from hosfl_dist.runtime.inprocess import InProcessRunner

K, M, B, P = 4, 40, 32, 5


def one_round(algorithm: str, width: int, out_dir: Path) -> dict:
    cfg = load_config(
        None,
        [
            f"algorithm.name={algorithm}",
            "data.name=synthetic",
            "model.name=small_cnn",
            f"model.width={width}",
            "split.cut=1",
            f"clients.total={M}",
            f"clients.per_round={K}",
            f"clients.batch_size={B}",
            f"zo.num_perturbations={P}",
            f"train.budget_samples={B}",  # stop after the first round
            f"train.eval_every_samples={B}",
            "data.eval_max_samples=64",
            "job.progress=false",
            f"job.out_dir={out_dir}",
        ],
    )
    runner = InProcessRunner(cfg).setup()
    summary = runner.run()
    d_c = sum(p.numel() for p in runner.worker.current_params())  # θc's trainable tensors
    b = summary["comm"]["bytes"]
    per = summary["rounds"] * K
    return {
        "algorithm": algorithm,
        "width": width,
        "d_c": d_c,
        "rounds": summary["rounds"],
        "uplink_aggregation_bytes": (b["uplink_scalars"] + b["uplink_model"]) / per,
        "downlink_aggregation_bytes": (b["downlink_scalars_seeds"] + b["downlink_model"]) / per,
        "activation_bytes_per_client_round": (b["uplink_activations"] + b["downlink_gradients"]) / per,
    }


def figures(data: dict) -> tuple[dict, dict]:
    """Uplink aggregation bytes per client per round, per method and d_c (the declared widths; others: data only)."""
    values = {f"{r['algorithm']}_dc{r['d_c']}": r["uplink_aggregation_bytes"] for r in data["rows"]}
    return {k: v for k, v in values.items() if k in BENCHMARKS["agg_traffic"].names}, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="*", default=[16, 32, 64, 128])
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["agg_traffic"], argv, args.via)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="agg_") as tmp:
        for w in args.widths:
            for algo in ("hosfl", "sfl"):
                rows.append(one_round(algo, w, Path(tmp) / f"{algo}{w}"))
    base = {r["algorithm"]: r for r in rows if r["width"] == args.widths[0]}
    print(f"{'method':6s} {'d_c':>6s} {'x d_c':>5s} {'up B/client/round':>18s} {'x':>6s} {'down B/client/round':>20s}")
    for r in rows:
        b0 = base[r["algorithm"]]
        r["d_c_factor"] = r["d_c"] / b0["d_c"]
        r["uplink_factor"] = r["uplink_aggregation_bytes"] / b0["uplink_aggregation_bytes"]
        print(
            f"{r['algorithm']:6s} {r['d_c']:6d} {r['d_c_factor']:5.0f} {r['uplink_aggregation_bytes']:18.0f} "
            f"{r['uplink_factor']:6.2f} {r['downlink_aggregation_bytes']:20.0f}"
        )
    data = {"K": K, "M": M, "batch": B, "P": P, "rows": rows}
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
