"""zo.compile: the HO-SFL client's ZO forwards through torch.compile, against eager forwards.

Inductor's kernels are not eager's, so the contract is equality within a stated tolerance, never bits. Every test
that compiles is in the slow tier: a process's first compile takes ~20 s on the 2-core CPU with a cold inductor cache
(measured with --durations and TORCHINDUCTOR_CACHE_DIR set to an empty folder).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from hosfl_dist.config import load_config
from hosfl_dist.core.params import bound, slot_tensors, trainable_slots
from hosfl_dist.core.seeding import round_seeds
from hosfl_dist.core.zo import Projector, perturbed
from hosfl_dist.errors import ConfigError
from hosfl_dist.measure.modes import ProfileSpec, build_setup, profiled_worker
from hosfl_dist.models.compiled import CompiledForward
from tiny import TINY_OVERRIDES, run_in_process, runner

TOL = {"rtol": 1e-5, "atol": 1e-5}
"""Compiled against eager: float32 kernels that may round otherwise (same bits here on the CPU, not promised)."""
COPY = "zo.perturb_mode=copy"


def tiny_client() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.slow  # ~20 s alone with a cold inductor cache (its first compile in a process), 4-7 s warm
def test_compiled_forward_sees_weights_swapped_in_and_written_in_place():
    """Dynamo lifts the parameters as inputs: a tensor bound into a slot, a perturbed copy (perturb_mode=copy) and
    an in-place write are all seen by the compiled forward, with no freezing of the weights."""
    m = tiny_client()
    slots = trainable_slots(m)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    fwd = CompiledForward(m, "default")
    with torch.no_grad():
        torch.testing.assert_close(fwd(x)["z"], m(x), **TOL)
        for p in slot_tensors(slots):  # an optimizer step writes θ in place
            p.add_(0.5)
        torch.testing.assert_close(fwd(x)["z"], m(x), **TOL)
        other = [torch.randn_like(p) for p in slot_tensors(slots)]  # another replica bound into the slots
        with bound(slots, other):
            want = m(x)
            torch.testing.assert_close(fwd(x)["z"], want, **TOL)
        assert (fwd(x)["z"] - want).abs().max() > 1e-2  # and its own weights once the replica is unbound
        with perturbed(slots, seed=7, mu=1e-3, mode="copy"):  # θ + μu swapped in for the forward
            torch.testing.assert_close(fwd(x)["z"], m(x), **TOL)
        z, z_tilde = fwd(x)["z"], None
        with perturbed(slots, seed=7, mu=1e-3, mode="copy"):
            z_tilde = fwd(x)["z"]
        assert (z_tilde - z).abs().max() > 0  # the perturbation reached the compiled forward


@pytest.mark.slow  # ~20 s with a cold inductor cache
def test_hooks_added_after_compiling_are_not_run_which_is_why_hooks_mode_is_refused():
    """Dynamo does not guard on submodules' hooks (skip_nnmodule_hook_guards): perturb_mode=hooks under a compiled
    f_c gives z back for z̃, silently. Should torch start running them, the refusal can be reconsidered."""
    m = tiny_client()
    fwd = CompiledForward(m, "default")
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z = fwd(x)["z"]
        with perturbed(trainable_slots(m), seed=7, mu=1e-1, mode="hooks"):
            z_tilde, want = fwd(x)["z"], m(x)
    torch.testing.assert_close(z_tilde, z, rtol=0, atol=0)
    assert (want - z).abs().max() > 1e-3


def test_a_compile_failure_stops_in_one_line_naming_the_key(monkeypatch):
    """A backend that fails is not hidden behind an eager fallback: the forward raises, naming zo.compile."""

    def failing(gm, example_inputs):
        raise RuntimeError("no compiler here")

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, mode: real(module, backend=failing))
    fwd = CompiledForward(tiny_client(), "default")
    with pytest.raises(RuntimeError) as err:
        fwd(torch.randn(2, 6))
    assert str(err.value) == ("zo.compile=default: torch.compile could not compile the client's forward "
                              "(RuntimeError: no compiler here); use zo.compile=off")  # fmt: skip


@pytest.mark.slow  # ~20 s with a cold inductor cache
def test_outputs_of_the_graph_mode_outlive_the_next_call():
    """reduce-overhead replays CUDA graphs into static buffers: each call's output is a copy, so a kept z is not the
    next call's z̃. (Off CUDA torch compiles without graphs: this runs the copying path, the GPU test the graphs.)"""
    m = tiny_client()
    fwd = CompiledForward(m, "reduce-overhead")
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z = fwd(x)["z"]
        with perturbed(trainable_slots(m), seed=7, mu=1e-1, mode="copy"):
            z_tilde = fwd(x)["z"]
            torch.testing.assert_close(z_tilde, m(x), **TOL)
        torch.testing.assert_close(z, m(x), **TOL)
    assert (z_tilde - z).abs().max() > 0


def zo_steps(spec: ProfileSpec, rounds: int = 2) -> tuple[list, list[torch.Tensor]]:
    """(z, v) of each of ``rounds`` HO-SFL client steps of the profiled worker (a stand-in λ), and θc after them."""
    setup = build_setup(spec)
    w = profiled_worker(spec, setup, "hosfl")
    rep = w.replicas[0]
    got = []
    for t in range(rounds):
        seeds = round_seeds(spec.seed, t, spec.P)
        w.bind(rep.params)
        z = w.zo_forward(setup.inputs)["z"]
        lam = torch.randn(z.shape, generator=torch.Generator().manual_seed(t)).to(z.device)
        v = w.zo_scalars(setup.inputs, seeds, Projector(lam, z), None)
        w.apply_update(rep, seeds, v)
        got.append((z, v))
    return got, [p.detach().clone() for p in rep.params]


@pytest.mark.slow  # ~20 s alone with a cold inductor cache (its first compile in a process), 4-7 s warm
def test_compiled_zo_step_gives_the_update_of_eager_forwards():
    """Two ZO client steps of the quickstart's small CNN (z, the P scalars, the seeded update) with zo.compile=default
    against zo.compile=off, both perturbing by copy."""
    spec = ProfileSpec(model="small_cnn", cut=1, batch=8, num_perturbations=3, perturb_mode="copy")
    eager, eager_params = zo_steps(spec)
    compiled, compiled_params = zo_steps(replace(spec, compile="default"))
    for (z0, v0), (z1, v1) in zip(eager, compiled):
        torch.testing.assert_close(z1, z0, **TOL)
        torch.testing.assert_close(v1, v0, **TOL)  # λᵀ(z̃ − z): z̃ − z ~ μ, so rounding of z shows here first
    for a, b in zip(compiled_params, eager_params):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.slow  # two in-process runs, one compiling: 28 s alone with a cold inductor cache, 7 s warm
def test_compiled_run_matches_the_eager_run(tmp_path, monkeypatch):
    """A few rounds end to end (per-client replicas, latency hiding on): the same losses and accuracies, and θc,
    within the tolerance; the run's own end-of-run check has every replica where the server's history puts it."""
    calls = {"n": 0}
    forward = CompiledForward.__call__

    def counting(self, inputs):
        calls["n"] += 1
        return forward(self, inputs)

    monkeypatch.setattr(CompiledForward, "__call__", counting)
    got = {}
    for mode in ("off", "default"):
        _, r, summary, rows = run_in_process([*TINY_OVERRIDES, COPY, "clients.replicas=per_client", "zo.overlap=true",
                                              f"zo.compile={mode}", f"job.out_dir={tmp_path / mode}"])  # fmt: skip
        assert summary["status"] == "completed"
        assert (r.worker.compiled is None) == (mode == "off")
        assert (calls["n"] == 0) == (mode == "off")  # the compiled run's ZO forwards went through it
        got[mode] = (rows, [p.detach().clone() for p in r.worker.replicas[0].params])
    (rows_off, params_off), (rows_on, params_on) = got["off"], got["default"]
    assert [r["round"] for r in rows_on] == [r["round"] for r in rows_off]
    for a, b in zip(rows_on, rows_off):
        for key in ("train_loss", "eval_loss", "eval_accuracy"):
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], **{"rel": TOL["rtol"], "abs": TOL["atol"]}), key
    for a, b in zip(params_on, params_off):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="zo.compile=reduce-overhead captures CUDA graphs: no GPU")
def test_cuda_graphs_give_the_update_of_eager_forwards():
    """zo.compile=reduce-overhead (CUDA graphs) on the GPU against eager forwards there, noise drawn on the GPU."""
    spec = ProfileSpec(model="small_cnn", cut=1, batch=8, num_perturbations=3, perturb_mode="copy", device="cuda",
                       rng_device="cuda")  # fmt: skip
    eager, eager_params = zo_steps(spec, rounds=3)  # the third round replays the captured graphs
    graphed, graphed_params = zo_steps(replace(spec, compile="reduce-overhead"), rounds=3)
    for (z0, v0), (z1, v1) in zip(eager, graphed):
        torch.testing.assert_close(z1, z0, **TOL)
        torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-4)  # TF32 / other kernels on the GPU
    for a, b in zip(graphed_params, eager_params):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["zo.compile=max-autotune"], r"zo\.compile: 'max-autotune' \(choose one of \['off', 'default', "
                                      r"'reduce-overhead'\]\)"),  # fmt: skip
        (["zo.compile=default"], r"zo\.compile.*needs zo\.perturb_mode=copy, not hooks"),
        ([COPY, "zo.compile=default", "zo.perturb_batch=2"], r"zo\.compile.*use zo\.perturb_batch=1, not 2"),
        ([COPY, "zo.compile=default", "algorithm.name=zo_sfl"], r"zo\.compile.*implemented for hosfl, not "
                                                                r"algorithm\.name=zo_sfl"),  # fmt: skip
        ([COPY, "zo.compile=reduce-overhead"], r"zo\.compile.*CUDA graphs, which job\.device=cpu has none of"),
    ],
    ids=["unknown", "hooks", "perturb_batch", "other_method", "cpu_graphs"],
)
def test_compile_is_refused_in_one_line_where_it_does_not_apply(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        runner([*TINY_OVERRIDES, *overrides])
    assert "\n" not in str(err.value)


def test_compile_is_refused_over_weights_upcast_in_hooks():
    """A half-precision client computing in float32 upcasts one module at a time in hooks: refused by the worker."""
    spec = ProfileSpec(model="tiny:llama", cut=1, batch=2, seq=8, dtype="bfloat16", compute_dtype="float32", mu=1e-2,
                       perturb_mode="copy", compile="default")  # fmt: skip
    with pytest.raises(ConfigError, match=r"invalid value for zo\.compile: default \(the client upcasts"):
        profiled_worker(spec, build_setup(spec), "hosfl")


def test_compile_off_is_the_default_and_outside_the_identity_of_earlier_runs():
    from hosfl_dist.runfolder.identity import ADDED_KEYS

    assert load_config(None, TINY_OVERRIDES).zo.compile == "off"
    assert ADDED_KEYS[("zo", "compile")] == "off"
