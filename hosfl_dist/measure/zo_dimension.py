"""How far a zeroth-order estimate points along the true gradient as the zeroth-order part grows: the mechanism
behind the client-depth ablation (paper App. "Impact of client-side model depth", the d_c of its Corollary).

    python -m hosfl_dist.experiments.zo_dimension [--config configs/finetune/hosfl_iid.yaml] [--cuts 1 2 3]
        [--ps 1 5 20] [--repeats 8] [--out results/finetune/zo_dimension] [key=value ...]

For each cut: the config's model (with its ``model.pretrained`` weights), one training batch of client 0, λ = ∂ℓ/∂z
from a real server backprop (Eq. 11), and two estimates against the exact gradients that backprop gives:

    HO-SFL   ĝ_c = 1/(Pμ) Σ_p λᵀ(z̃_p − z) u_p over θc, computed with the production estimator (``zo.estimator``'s
             ``perturbed``, ``projector``, ``coefficients``, ``reconstruct_group``, seeds from ``round_seeds``),
             against g_c = ∂(λᵀz)/∂θc;
    ZO-SFL   ĝ = 1/P Σ_p (ℓ(θ + μw_p) − ℓ(θ − μw_p)) / (2μ) · w_p over θ = (θc, θs), w_p = (u_p, v_p) regenerated as
             ZO-SFL's worker and server do (the estimator's ``pair``, ``server_seed``), against g = ∂ℓ/∂θ.

Reported per cut, method and P, over --repeats independent seed sets: cos(ĝ, g) (mean ± std) beside √(P/(d+P+1)),
what a Gaussian estimator gives in expectation when μ is small (E ĝᵀg = ‖g‖², E‖ĝ‖² = (d+P+1)/P · ‖g‖²), and
‖ĝ‖/‖g‖ beside √((d+P+1)/P). A convergence bound of ZO-SGD goes with (d+P)/P steps; HO-SFL's d is d_c, ZO-SFL's is
the whole model's, whatever the cut. The estimate's quality is a property of the step, not of training: it says
nothing about how the server's first-order part or Adam's normalisation carry it into accuracy (that is what the
depth sweeps in results/finetune measure). CPU, one thread, a few seconds per cut.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

import torch

from hosfl_dist.algorithms.exchange import server_seed
from hosfl_dist.core.estimators import ZOEstimator, build_estimator
from hosfl_dist.core.params import slot_tensors, trainable_slots
from hosfl_dist.core.seeding import round_seeds
from hosfl_dist.data import build_data
from hosfl_dist.cli.guard import check_destination, guarded
from hosfl_dist.models import build_split_model, server_forward
from hosfl_dist.runtime.build import data_sections
from hosfl_dist.runtime.checks import load_run_config

PROG = "python -m hosfl_dist.experiments.zo_dimension"


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def rebuilt(estimator: ZOEstimator, params: list[torch.Tensor], seeds: list[int], coeffs: list[float]) -> list:
    """Σ_p c_p u_p tensor by tensor (trainable tensor i of ``params``: any mix of dtypes)."""
    return [estimator.reconstruct_group([p], [i], seeds, coeffs)[0] for i, p in enumerate(params)]


def measure_cut(cfg_path: str, overrides: list[str], cut: int, ps: list[int], repeats: int) -> dict:
    cfg = load_run_config(cfg_path, [*overrides, f"split.cut={cut}"])
    data = build_data(data_sections(cfg), clients=[0], evaluation=False)
    split = build_split_model(cfg, data.info, zeroth_order_client=True)
    client, server, task, estimator = split.client, split.server, split.task, build_estimator(cfg.zo)
    x, y = data.next_batch(0)
    c_slots, s_slots = trainable_slots(client), trainable_slots(server)
    c_params, s_params = slot_tensors(c_slots), slot_tensors(s_slots)
    d_c, d_s = sum(p.numel() for p in c_params), sum(p.numel() for p in s_params)

    # exact gradients: λ = ∂ℓ/∂z from the server, g_c = ∂(λᵀz)/∂θc, and the whole model's ∂ℓ/∂θ
    act = split.client_forward(x)  # {"z": (B, ...)} and, for an LM, the attention mask the server needs
    z = act["z"]
    z_leaf = z.detach().requires_grad_(True)
    loss = task.loss(server_forward(server, {**act, "z": z_leaf}), y)
    s_grads = torch.autograd.grad(loss, [z_leaf, *s_params])
    lam = s_grads[0].detach()
    g_c = flat(list(torch.autograd.grad(z, c_params, grad_outputs=lam)))
    g_all = torch.cat([g_c, flat(list(s_grads[1:]))])
    z = z.detach()

    def loss_at(sign: int, seed: int) -> float:  # ℓ at θs ± μv with θc already perturbed by the caller
        with estimator.perturbed(s_slots, server_seed(seed), sign):
            return float(task.loss(server_forward(server, split.client_forward(x)), y))

    rows = []
    with torch.no_grad():
        proj = estimator.projector(lam, z)
        for p_count in ps:
            ho_cos, ho_ratio, zo_cos, zo_ratio = [], [], [], []
            for r in range(repeats):
                seeds = round_seeds(cfg.job.seed + 1000 * r, r, p_count)
                # HO-SFL: the P scalars v_p = λᵀ(z̃_p − z) (Eq. 13) and ĝ_c = Σ_p v_p/(Pμ) u_p (Eq. 15)
                scalars = []
                for s in seeds:
                    with estimator.perturbed(c_slots, s):
                        scalars.append(float(proj(split.client_forward(x)["z"])))
                coeffs = estimator.coefficients(scalars)
                g_hat = flat(rebuilt(estimator, c_params, seeds, coeffs))
                ho_cos.append(cosine(g_hat, g_c))
                ho_ratio.append(float(g_hat.norm() / g_c.norm()))
                # ZO-SFL: SPSA over (θc, θs) with P two-point probes, each g_p·w_p
                est = torch.zeros_like(g_all)
                for s in seeds:
                    lp, lm = estimator.pair(c_slots, s, lambda sign, s=s: loss_at(sign, s))
                    g = estimator.pair_coefficient(lp, lm)
                    w_c = rebuilt(estimator, c_params, [s], [g])
                    w_s = rebuilt(estimator, s_params, [server_seed(s)], [g])
                    est += flat(w_c + w_s) / p_count
                zo_cos.append(cosine(est, g_all))
                zo_ratio.append(float(est.norm() / g_all.norm()))
            for method, d, cos, ratio in (("hosfl", d_c, ho_cos, ho_ratio), ("zo_sfl", d_c + d_s, zo_cos, zo_ratio)):
                rows.append({
                    "cut": cut, "method": method, "P": p_count, "d": d, "repeats": repeats,
                    "cos_mean": statistics.mean(cos), "cos_std": statistics.stdev(cos) if len(cos) > 1 else 0.0,
                    "cos_gaussian": math.sqrt(p_count / (d + p_count + 1)),
                    "norm_ratio_mean": statistics.mean(ratio),
                    "norm_ratio_gaussian": math.sqrt((d + p_count + 1) / p_count),
                })  # fmt: skip
    return {"cut": cut, "d_c": d_c, "d_s": d_s, "batch": len(y), "rows": rows}


def markdown(results: list[dict], command: str) -> str:
    lines = ["# Zeroth-order estimate vs true gradient as the zeroth-order part grows", "", f"`{command}`", "",
             "| cut | method | d (zeroth-order part) | P | cos(ĝ, g) | Gaussian √(P/(d+P+1)) | ‖ĝ‖/‖g‖ "
             "| Gaussian √((d+P+1)/P) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {r['cut']} | {'HO-SFL' if r['method'] == 'hosfl' else 'ZO-SFL'} | {r['d']:,} | {r['P']} | "
                         f"{r['cos_mean']:.2e} ± {r['cos_std']:.1e} | {r['cos_gaussian']:.2e} | "
                         f"{r['norm_ratio_mean']:.0f} | {r['norm_ratio_gaussian']:.0f} |")  # fmt: skip
    lines += ["", "cos: mean ± std over the repeats (independent seed sets); ĝ of HO-SFL is over θc against "
              "g_c = ∂(λᵀz)/∂θc, ĝ of ZO-SFL over the whole model against ∂ℓ/∂θ; one training batch of client 0 "
              f"per cut (`{PROG}`; the module's docstring).", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", default="configs/finetune/hosfl_iid.yaml", help="(default: %(default)s)")
    p.add_argument("--cuts", type=int, nargs="+", default=[1, 2, 3], help="split.cut values (default: %(default)s)")
    p.add_argument("--ps", type=int, nargs="+", default=[1, 5, 20], help="P values (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=8, help="independent seed sets per point (default: %(default)s)")
    p.add_argument("--out", default="", help="write <out>.json and <out>.md (default: print only)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    args = p.parse_intermixed_args(words)
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else None

    def body() -> int:
        for written in (out.with_suffix(".json"), out.with_suffix(".md")) if out is not None else ():
            check_destination(written)  # before the measurement: a run's files are never replaced
        results = []
        for cut in args.cuts:
            res = measure_cut(args.config, args.overrides, cut, args.ps, args.repeats)
            results.append(res)
            for r in res["rows"]:
                print(f"cut {cut} {r['method']:>6} d={r['d']:>10,} P={r['P']:>3}: cos {r['cos_mean']:.2e} "
                      f"± {r['cos_std']:.1e} (Gaussian {r['cos_gaussian']:.2e}), |ĝ|/|g| {r['norm_ratio_mean']:.0f} "
                      f"(Gaussian {r['norm_ratio_gaussian']:.0f})", flush=True)  # fmt: skip
        command = shlex.join([*PROG.split(), *words])
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2) + "\n")
            out.with_suffix(".md").write_text(markdown(results, command))
        return 0

    return guarded(PROG, body, out)


if __name__ == "__main__":
    sys.exit(main())
