"""Pure zeroth-order math: seeds, perturbation without writes, projection, reconstruction, tensorwise optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from hosfl_dist.config import OptimConfig
from hosfl_dist.core.optim import OPTIMIZER_IMPLS, TensorwiseOptimizer, build_torch_optimizer, client_impl
from hosfl_dist.core.params import groups, trainable_slots
from hosfl_dist.core.seeding import mix_seed, round_seeds
from hosfl_dist.core.zo import (
    NoiseCache,
    noise_like,
    perturbed,
    perturbed_tensor,
    perturbed_tensors,
    project,
    reconstruct,
    reconstruct_group,
    scalar_coefficients,
)


def small_model(dtype=torch.float64, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)  # d_c = 15 + 8 = 23


def test_seeds_are_stable_and_distinct():
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert mix_seed(1, 2, 3) != mix_seed(1, 3, 2)
    s = round_seeds(0, 5, 4)
    assert len(set(s)) == 4 and s == round_seeds(0, 5, 4) and s != round_seeds(0, 6, 4)
    assert all(0 <= x < 2**63 for x in s)


def test_noise_is_regenerated_identically_per_tensor():
    p = torch.zeros(3, 5)
    a, b = noise_like(p, 7, 0), noise_like(p, 7, 0)
    assert torch.equal(a, b)
    assert not torch.equal(a, noise_like(p, 7, 1))  # each tensor has its own stream
    assert noise_like(p.double(), 7, 0).dtype == torch.float64


def test_a_shared_generator_and_scratch_draw_the_same_numbers():
    """perturbed and reconstruct reseed one generator per pass and draw into a scratch buffer: the numbers must be
    those of a fresh generator per tensor (the replicas' contract), for every dtype a parameter can have."""
    gen, scratch = torch.Generator(), torch.empty(64)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for i, shape in enumerate([(3, 5), (4, 1, 2, 2), (7,)]):
            p = torch.zeros(shape, dtype=dtype)
            want = noise_like(p, 11, i)
            got = noise_like(p, 11, i, "cpu", gen, scratch)
            assert got.shape == p.shape and got.dtype == dtype and torch.equal(got, want)
    p = torch.randn(6, 5)
    seeds, coeffs = [3, 4, 5], [0.5, -1.25, 2.0]
    naive = torch.zeros_like(p)
    for s, c in zip(seeds, coeffs):
        naive.add_(noise_like(p, s, 2), alpha=c)
    assert torch.equal(reconstruct(p, 2, seeds, coeffs), naive)


def test_a_noise_cache_gives_the_draws_noise_like_makes_keeps_them_unwritten_and_stays_within_its_limit():
    """NoiseCache: the numbers are noise_like's for every dtype; perturbing and rebuilding ĝ through it equal doing
    so without it and leave the kept draws as they were; past its limit it draws instead of keeping."""
    params = [torch.randn(3, 5), torch.randn(4, 1, 2, 2, dtype=torch.float64), torch.randn(7).bfloat16()]
    seeds, coeffs = [3, 4, 5], [0.5, -1.25, 2.0]
    for limit in (1 << 20, 4 * (15 + 16)):  # everything, or the first two draws of the first tensor only
        cache, gen = NoiseCache(limit), torch.Generator()
        for _ in range(2):  # the second pass reads what the first kept
            for i, p in enumerate(params):
                for s in seeds:
                    assert torch.equal(cache.noise(p, s, i, "cpu", gen), noise_like(p, s, i))
                    want = noise_like(p, s, i).mul_(1e-3).add_(p)
                    assert torch.equal(perturbed_tensor(p, s, i, 1e-3, "cpu", gen, cache), want)
                assert torch.equal(reconstruct(p, i, seeds, coeffs, "cpu", cache), reconstruct(p, i, seeds, coeffs))
        kept = dict(cache._draws)
        assert cache.held <= limit and cache.held == sum(u.numel() * 4 for u in kept.values())
        assert len(kept) == (9 if limit == 1 << 20 else 2)
        for (s, i), u in kept.items():  # float32 as drawn, never written by a perturbation
            assert u.dtype == torch.float32 and torch.equal(u, noise_like(torch.zeros(u.numel()), s, i))


def test_perturbed_forward_matches_explicit_parameters_and_leaves_theta_bit_identical():
    model = small_model()
    x = torch.randn(6, 4, dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    slots = trainable_slots(model)
    mu, seed = 1e-3, 1234
    explicit = {n: p + mu * noise_like(p, seed, i) for i, (n, p) in enumerate(model.named_parameters())}
    want = functional_call(model, explicit, (x,))
    for mode in ("hooks", "copy"):
        with torch.no_grad(), perturbed(slots, seed, mu, mode=mode):
            got = model(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(a is model.get_parameter(n) for a, (n, _) in zip(model.parameters(), model.named_parameters()))


def test_hooks_mode_refuses_a_tensor_read_outside_its_module_forward():
    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return x @ self.lin.weight.T  # reads lin.weight without calling lin

    m = Direct()
    try:
        with torch.no_grad(), perturbed(trainable_slots(m), 1, 1e-3):
            m(torch.randn(1, 2))
    except RuntimeError as exc:
        assert "perturb_mode=copy" in str(exc)
    else:
        raise AssertionError("unperturbed tensor went unnoticed")


def zo_estimate(model, x, lam, seeds, mu):
    slots = trainable_slots(model)
    with torch.no_grad():
        z = model(x)
        scalars = []
        for s in seeds:
            with perturbed(slots, s, mu):
                scalars.append(project(lam, model(x), z))
    coeffs = scalar_coefficients(torch.stack(scalars), mu)
    return torch.cat([reconstruct(p, i, seeds, coeffs).reshape(-1) for i, p in enumerate(model.parameters())])


def test_zo_estimate_aligns_with_true_gradient_as_p_grows():
    """cos(ĝ, ∇θ λᵀf_c) grows with P and approaches 1 when P >> d_c (here d_c = 23)."""
    model = small_model()
    x = torch.randn(8, 4, dtype=torch.float64)
    lam = torch.randn(8, 2, dtype=torch.float64)
    (lam * model(x)).sum().backward()
    true = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    cos = {}
    for P in (1, 8, 64, 4096):
        vals = []
        for rep in range(4):
            g = zo_estimate(model, x, lam, round_seeds(rep, 0, P), 1e-4)
            vals.append(torch.nn.functional.cosine_similarity(g, true, dim=0).item())
        cos[P] = sum(vals) / len(vals)
    assert cos[1] < cos[8] < cos[64] < cos[4096], cos
    assert cos[4096] > 0.98, cos
    assert cos[1] < 0.6, cos  # one direction in 23 dimensions: far from the gradient


MIXED = [(3, 5), (4, 1, 2, 2), (7,), (300, 301), (1,), (33,), (70000,)]
"""Shapes around the CPU kernels' vector widths and the 2^18-element group limit (the last two groups split)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_grouped_passes_give_the_per_tensor_bits(dtype):
    """perturbed_tensors and reconstruct_group (one buffer and one _foreach op per group) equal perturbed_tensor and
    reconstruct tensor by tensor, bit for bit, with and without a noise cache, a non-contiguous tensor included."""
    torch.manual_seed(0)
    params = [torch.randn(s, dtype=dtype) for s in MIXED] + [torch.randn(6, 4, dtype=dtype).t()]
    assert len(groups(params)) > 1
    seeds, coeffs, gen = [3, 4, 5], [0.5, -1.25, 2.0], torch.Generator()
    idx = list(range(len(params)))
    for cache in (None, NoiseCache(1 << 30), NoiseCache(4 * 100)):
        for s in seeds:
            got = perturbed_tensors(params, s, idx, 1e-3, "cpu", gen, cache)
            for i, p in enumerate(params):
                assert torch.equal(got[i], perturbed_tensor(p, s, i, 1e-3, "cpu", gen)), (cache, s, i)
        for run in groups(params):
            got = reconstruct_group([params[i] for i in run], run, seeds, coeffs, "cpu", cache)
            for i, g in zip(run, got):
                assert torch.equal(g, reconstruct(params[i], i, seeds, coeffs)), (cache, i)


def _loop_step(cfg: OptimConfig, params: list[torch.Tensor], grads: list[torch.Tensor], state: list, step: int, lr):
    """The tensor-by-tensor update TensorwiseOptimizer ran before its _foreach ops (the reference of its bits)."""
    import math

    for i, (p, g) in enumerate(zip(params, grads)):
        st = state[i]
        if cfg.name == "adamw":
            if not st:
                st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            p.mul_(1.0 - lr * cfg.weight_decay)
            m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
            v.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
            denom = v.sqrt().div_(math.sqrt(1.0 - cfg.beta2**step)).add_(cfg.eps)
            p.addcdiv_(m, denom, value=-lr / (1.0 - cfg.beta1**step))
        else:
            if cfg.weight_decay:
                g = g.add(p, alpha=cfg.weight_decay)
            if cfg.momentum:
                if "momentum" not in st:
                    st["momentum"] = g.clone()
                else:
                    st["momentum"].mul_(cfg.momentum).add_(g)
                g = st["momentum"]
            p.add_(g, alpha=-lr)


@pytest.mark.parametrize("fused", [True, False], ids=["foreach", "loop"])  # loop: what devices other than the CPU run
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "cfg",
    [
        OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1),
        OptimConfig(name="sgd", lr=1e-2, momentum=0.9, weight_decay=0.01),
        OptimConfig(name="sgd", lr=1e-2),
    ],
    ids=["adamw", "sgd_momentum", "sgd"],
)
def test_tensorwise_optimizer_keeps_the_bits_of_the_per_tensor_loop(cfg, dtype, fused, monkeypatch):
    """The _foreach update equals the tensor-by-tensor loop bit for bit, moments included (half precision too,
    where torch's in-place _foreach_mul_ would round differently), and so does its loop (core.foreach off the CPU)."""
    from hosfl_dist.core import foreach

    if not fused:
        monkeypatch.setattr(foreach, "fused", lambda tensors: False)
    torch.manual_seed(0)
    ours = [torch.randn(s, dtype=dtype) for s in MIXED]
    ref = [t.clone() for t in ours]
    opt, state = TensorwiseOptimizer(cfg, ours), [{} for _ in ours]
    for step in range(1, 4):
        grads = [torch.randn_like(t) for t in ours]
        opt.step(ours, lambda ids, ps: [grads[i] for i in ids])
        _loop_step(cfg, ref, grads, state, step, cfg.lr)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    moments = [t for st in state for _, t in sorted(st.items())]
    assert all(torch.equal(a, b) for a, b in zip(opt.state_tensors(), moments))


def test_projection_is_lambda_dot_difference():
    lam, zt, z = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(project(lam, zt, z), (lam.double() * (zt.double() - z.double())).sum())


def test_tensorwise_adamw_matches_torch_adamw():
    cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=5e-4)
    torch.manual_seed(0)
    p_ours = [torch.randn(5, 3), torch.randn(4)]
    p_ref = [nn.Parameter(t.clone()) for t in p_ours]
    ref = torch.optim.AdamW(p_ref, lr=1e-2, weight_decay=5e-4, foreach=False)
    ours = TensorwiseOptimizer(cfg, p_ours)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in p_ours]
        ours.step(p_ours, lambda ids, ps: [grads[i] for i in ids])
        for p, g in zip(p_ref, grads):
            p.grad = g.clone()
        ref.step()
    for a, b in zip(p_ours, p_ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def test_tensorwise_sgd_momentum_matches_torch_sgd():
    cfg = OptimConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-3)
    p_ours = [torch.randn(6)]
    p_ref = [nn.Parameter(p_ours[0].clone())]
    ref = torch.optim.SGD(p_ref, lr=0.1, momentum=0.9, weight_decay=1e-3)
    ours = TensorwiseOptimizer(cfg, p_ours)
    for _ in range(4):
        g = torch.randn(6)
        ours.step(p_ours, lambda ids, ps: [g])
        p_ref[0].grad = g.clone()
        ref.step()
    torch.testing.assert_close(p_ours[0], p_ref[0].detach())


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_torch_optimizer_on_the_cpu_is_the_loop_over_tensors_and_every_impl_takes_the_same_steps(name):
    """``auto`` (what runs build) leaves the implementation to torch: on the CPU the loop, bit for bit what runs
    built before; foreach and fused take the same steps up to rounding; an unknown implementation is refused."""
    cfg = OptimConfig(name=name, lr=1e-2, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(4)]

    def run(impl):
        params = [t.clone().requires_grad_(True) for t in start] + [torch.zeros(2)]  # a frozen one is left out
        opt = build_torch_optimizer(cfg, params, impl)
        assert len(opt.param_groups[0]["params"]) == 2
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return params[:2]

    loop = run("for_loop")
    assert all(torch.equal(a, b) for a, b in zip(run("auto"), loop))
    for impl in set(OPTIMIZER_IMPLS) - {"auto", "for_loop"}:
        for a, b in zip(run(impl), loop):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="optimizer impl 'fast': expected one of auto, for_loop, foreach, fused"):
        build_torch_optimizer(cfg, start, "fast")


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_first_order_client_steps_with_foreach_where_it_gives_the_loops_bits(name):
    """client_impl: foreach for float32/float64 tensors, whose steps equal the loop's bit for bit; torch's own
    choice for half precision (whose foreach momentum rounds differently)."""
    cfg = OptimConfig(name=name, lr=1e-2, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in [(5, 3), (7,), (300, 31)]]
    assert client_impl(start) == "foreach" and client_impl([t.bfloat16() for t in start]) == "auto"
    runs = []
    for impl in ("for_loop", client_impl(start)):
        params = [t.clone().requires_grad_(True) for t in start]
        opt, g = build_torch_optimizer(cfg, params, impl), torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
