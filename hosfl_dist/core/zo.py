"""Pure zeroth-order math: per-tensor noise, write-free perturbation, scalar projection and gradient reconstruction.

Noise is never materialised as one d_c-sized vector. Each trainable tensor i gets its own slice of u_p, drawn from a
generator seeded with ``tensor_seed(s_p, i)``: every replica regenerates exactly the same numbers in any order, one
tensor at a time. Perturbation never writes to θc (floating-point ``θ + μu − μu`` is not θ), so after any number of
perturbed forwards every replica is bit-identical to one that ran none.

u's distribution is a :data:`Noise` (``noise=``, standard normal by default): every function here draws through it,
so the estimator that picks it (:mod:`hosfl_dist.core.estimators`, ``zo.estimator``) changes no other line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from hosfl_dist.core import foreach
from hosfl_dist.core.params import Slots, bound, groups, slot_tensors
from hosfl_dist.core.seeding import mix_seed


Noise = Callable[[Tensor, torch.Generator], Tensor]
"""u's distribution: ``noise(out, gen)`` fills ``out`` — one trainable tensor's slice of u, flat float32 on the
generator's device — in place from ``gen`` (reseeded for that tensor by the caller) and returns it. Its numbers must
be a function of ``gen``'s alone (every replica regenerates them), with mean 0 and covariance I."""


def gaussian_(out: Tensor, gen: torch.Generator) -> Tensor:
    """u ~ N(0, I): ``torch.randn`` into ``out`` (a fresh ``torch.randn`` is the same numbers: empty, then normal_)."""
    return torch.randn(out.numel(), generator=gen, out=out)


def rademacher_(out: Tensor, gen: torch.Generator) -> Tensor:
    """u uniform on {−1, +1}^d (mean 0, covariance I, |u|² = d exactly): fair bits from ``gen`` mapped to ±1."""
    return torch.randint(0, 2, (out.numel(),), generator=gen, out=out).mul_(2).sub_(1)


def tensor_seed(seed: int, index: int) -> int:
    """Seed of the slice of u that belongs to trainable tensor ``index``."""
    return mix_seed(seed, index)


def noise_like(
    param: Tensor,
    seed: int,
    index: int,
    rng_device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    out: Tensor | None = None,
    noise: Noise = gaussian_,
) -> Tensor:
    """u_{p,i} ~ N(0, I) (or ``noise``'s distribution) shaped like ``param``, regenerated from (s_p, i) on
    ``rng_device`` then moved to param.

    The draw is always float32 on ``rng_device`` so that replicas on different devices or dtypes see the same stream.
    ``generator`` (on ``rng_device``) is reseeded here, so one generator serves a whole pass over θc instead of one
    per tensor; ``out`` (float32, contiguous, at least ``param.numel()`` elements, on ``rng_device``) receives the
    draw instead of a fresh tensor. Neither changes a number: the stream is a function of the seed alone.
    """
    gen = generator if generator is not None else torch.Generator(device=rng_device)
    return _like(_draw(param.numel(), seed, index, rng_device, gen, out, noise), param)


def _draw(
    numel: int,
    seed: int,
    index: int,
    rng_device: str | torch.device,
    gen: torch.Generator,
    out: Tensor | None = None,
    noise: Noise = gaussian_,
) -> Tensor:
    """The flat float32 draw of (seed, index) on ``rng_device`` (into ``out`` where given)."""
    gen.manual_seed(tensor_seed(seed, index))
    if out is None:
        return noise(torch.empty(numel, device=rng_device, dtype=torch.float32), gen)
    return noise(out[:numel], gen)


def _like(u: Tensor, param: Tensor) -> Tensor:
    """A flat draw shaped like ``param``, on its device and in its dtype."""
    u = u.view(param.shape)
    if u.dtype != param.dtype or u.device != param.device:  # .to() parses its arguments even when it does nothing
        u = u.to(device=param.device, dtype=param.dtype)
    return u


class NoiseCache:
    """The float32 draws u_{p,i} of one set of seeds, kept while they fit in ``limit_bytes``.

    Every client of a round perturbs with the round's P seeds, and the update regenerates the same draws (Eq. 15):
    a worker that keeps them draws each once per round instead of once per client plus once per replica updated.
    The stream is a function of (seed, tensor index) alone, so a kept draw is the number a fresh one would be. Draws
    are kept in the order they are made until the next would pass the limit; the rest are drawn every time.
    """

    def __init__(self, limit_bytes: float, noise: Noise = gaussian_) -> None:
        self.limit = limit_bytes
        self.fill = noise
        """u's distribution: every draw this cache makes or keeps is this one's."""
        self.held = 0
        self._draws: dict[tuple[int, int], Tensor] = {}

    def noise(
        self,
        param: Tensor,
        seed: int,
        index: int,
        rng_device: str | torch.device,
        generator: torch.Generator,
        scratch: Tensor | None = None,
    ) -> Tensor:
        """:func:`noise_like`'s u for ``param``: the kept draw, or a fresh one (kept if it fits). Read-only: it may
        be the kept tensor itself."""
        key = (seed, index)
        u = self._draws.get(key)
        if u is None:
            nbytes = param.numel() * 4
            if self.held + nbytes > self.limit:
                return noise_like(param, seed, index, rng_device, generator, scratch, self.fill)
            u = self._draws[key] = _draw(param.numel(), seed, index, rng_device, generator, None, self.fill)
            self.held += nbytes
        return _like(u, param)


def perturbed_tensor(
    param: Tensor,
    seed: int,
    index: int,
    mu: float,
    rng_device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    cache: NoiseCache | None = None,
    noise: Noise = gaussian_,
) -> Tensor:
    """θ_i + μ·u_i as one new tensor: the fresh noise is scaled and shifted in place, so no other θ-sized buffer is
    alive at the same time. Bit-identical to ``param + mu * noise_like(...)`` (same multiply, and a + b == b + a).
    With ``cache``, u comes from it (and the product is a new tensor: the kept draw is not written); ``noise``: u's
    distribution (a cache's is its own)."""
    if cache is not None:
        gen = generator if generator is not None else torch.Generator(device=rng_device)
        return torch.mul(cache.noise(param, seed, index, rng_device, gen), mu).add_(param)
    return noise_like(param, seed, index, rng_device, generator, noise=noise).mul_(mu).add_(param)


def draw_flat(
    params: Sequence[Tensor],
    seed: int,
    indices: Sequence[int],
    rng_device: str | torch.device,
    gen: torch.Generator,
    out: Tensor | None = None,
    noise: Noise = gaussian_,
) -> tuple[Tensor, list[Tensor]]:
    """The draws u_i of a group of tensors (``params[j]`` is trainable tensor ``indices[j]``, all of one device and
    dtype) as one flat buffer and its views shaped like each param: (flat, views).

    Each slice is :func:`noise_like`'s draw (one reseed per tensor), made into ``out`` (float32 on ``rng_device``,
    at least the group's size) or a fresh buffer; a device or dtype change is one copy of the whole buffer instead
    of one per tensor, and converts every element as the per-tensor copy did.
    """
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    flat = torch.empty(total, device=rng_device, dtype=torch.float32) if out is None else out[:total]
    offset = 0
    for i, n in zip(indices, sizes):
        gen.manual_seed(tensor_seed(seed, i))
        noise(flat[offset : offset + n], gen)
        offset += n
    p0 = params[0]
    if p0.dtype != flat.dtype or p0.device != flat.device:
        flat = flat.to(device=p0.device, dtype=p0.dtype)
    return flat, [u.view(p.shape) for u, p in zip(flat.split(sizes), params)]


def perturbed_tensors(
    params: Sequence[Tensor],
    seed: int,
    indices: Sequence[int],
    mu: float,
    rng_device: str | torch.device,
    gen: torch.Generator,
    cache: NoiseCache | None = None,
    noise: Noise = gaussian_,
) -> list[Tensor]:
    """θ_i + μ·u_i for each of ``params`` (trainable tensors ``indices``), one op per pass over each group of
    :func:`~hosfl_dist.core.params.groups` instead of one per tensor. The same numbers as :func:`perturbed_tensor`,
    tensor by tensor: a product and a sum are each rounded once, however the kernel is vectorised, and the sums run
    tensor by tensor as before (:mod:`hosfl_dist.core.foreach`). Without ``cache`` the results are views of one
    buffer per group; with it, the kept draws are scaled into new tensors."""
    out: list[Tensor] = []
    for run in groups(params):
        ps, ids = [params[j] for j in run], [indices[j] for j in run]
        if cache is not None:
            us = foreach.muled([cache.noise(p, seed, i, rng_device, gen) for p, i in zip(ps, ids)], mu)
        else:
            flat, us = draw_flat(ps, seed, ids, rng_device, gen, noise=noise)
            flat.mul_(mu)
        foreach.add_(us, ps)
        out += us
    return out


@contextlib.contextmanager
def perturbed(
    slots: Slots,
    seed: int,
    mu: float,
    rng_device: str | torch.device = "cpu",
    mode: str = "hooks",
    cache: NoiseCache | None = None,
    noise: Noise = gaussian_,
) -> Iterator[None]:
    """Run forwards at θ + μ·u(seed) without modifying θ; ``slots`` = :func:`trainable_slots` of the module.

    mode="hooks": a forward pre-hook on each owner module swaps its trainable tensors for freshly computed
    θ_i + μ·u_i and the forward hook swaps θ_i back, so at most one module's perturbed copy is alive at a time
    (client memory stays at inference level). Every trainable tensor must be read through its owner's forward;
    a tensor that was not (e.g. read directly by a parent) raises instead of silently staying unperturbed.
    mode="copy": perturbed copies of all trainable tensors are swapped in for the whole block (d_c extra memory,
    works for any access pattern). ``cache``: where u comes from (:class:`NoiseCache`; None: drawn every time, from
    ``noise``).
    """
    gen = torch.Generator(device=rng_device)  # one generator, reseeded per tensor
    if mode == "copy":
        originals = [mod._parameters[name] for mod, name in slots]
        try:
            with torch.no_grad():
                moved = perturbed_tensors(originals, seed, range(len(originals)), mu, rng_device, gen, cache, noise)
            for (mod, name), p in zip(slots, moved):
                mod._parameters[name] = p
            yield
        finally:
            for (mod, name), p in zip(slots, originals):
                mod._parameters[name] = p
        return
    if mode != "hooks":
        raise ValueError(f"unknown perturbation mode {mode!r} (hooks or copy)")

    by_owner: dict[int, list[tuple[int, str]]] = {}
    owners: dict[int, nn.Module] = {}
    for i, (mod, name) in enumerate(slots):
        by_owner.setdefault(id(mod), []).append((i, name))
        owners[id(mod)] = mod
    saved: dict[int, list[Tensor]] = {}
    seen: set[int] = set()

    def pre_hook(mod: nn.Module, args: object) -> None:
        entries = by_owner[id(mod)]
        saved[id(mod)] = [mod._parameters[name] for _, name in entries]
        indices = [i for i, _ in entries]
        with torch.no_grad():
            moved = perturbed_tensors(saved[id(mod)], seed, indices, mu, rng_device, gen, cache, noise)
        for (_, name), p in zip(entries, moved):
            mod._parameters[name] = p
        seen.update(indices)

    def post_hook(mod: nn.Module, args: object, out: object) -> None:
        for (_, name), p in zip(by_owner[id(mod)], saved.pop(id(mod))):
            mod._parameters[name] = p

    handles = []
    for mod in owners.values():
        handles.append(mod.register_forward_pre_hook(pre_hook))
        handles.append(mod.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for key, originals in saved.items():  # a forward that raised mid-module: put θ back
            for (_, name), p in zip(by_owner[key], originals):
                owners[key]._parameters[name] = p
    missing = [i for i in range(len(slots)) if i not in seen]
    if missing:
        mod, name = slots[missing[0]]
        raise RuntimeError(
            f"trainable tensor {type(mod).__name__}.{name} was not read through its module's forward, so hook-based "
            "perturbation cannot reach it; use zo.perturb_mode=copy for this model"
        )


def perturbed_batch(
    forward: Callable[[], Tensor],
    slots: Slots,
    seeds: Sequence[int],
    mu: float,
    rng_device: str | torch.device = "cpu",
    cache: NoiseCache | None = None,
    noise: Noise = gaussian_,
) -> Tensor:
    """``forward()`` at θ + μ·u(s) for every seed in ``seeds``, as one batched forward: (len(seeds), *out.shape).

    Each trainable tensor i becomes a stack of its perturbed copies (the same numbers as :func:`perturbed_tensor`'s,
    seed by seed), bound in its slot inside ``torch.func.vmap``; what reads no trainable tensor is computed once, and
    everything after the first one runs as one forward of a len(seeds)-times batch. θ is never written. Costs
    len(seeds)·|θ| for the stacks and len(seeds)× the forward's activations. A forward that draws random numbers
    (dropout) is refused by vmap, as are ops it cannot batch; their errors come from torch.
    """
    gen = torch.Generator(device=rng_device)
    params = slot_tensors(slots)
    with torch.no_grad():
        stacks = [p.new_empty((len(seeds), *p.shape)) for p in params]
        for k, s in enumerate(seeds):  # one seed's perturbed copies alive beside the stacks
            moved = perturbed_tensors(params, s, range(len(params)), mu, rng_device, gen, cache, noise)
            torch._foreach_copy_([st[k] for st in stacks], moved)
        del moved

    def at(tensors: list[Tensor]) -> Tensor:
        with bound(slots, tensors):
            return forward()

    return torch.func.vmap(at, randomness="error")(stacks)


PROJECT_CHUNK = 1 << 16
"""Elements per float64 slice of a projection: the float64 copies never exceed this size, so a projection needs
~1 MB of scratch instead of z-sized buffers (up to this size it is one dot)."""


def dot64(lam: Tensor, a: Tensor) -> Tensor:
    """λᵀa over all elements, accumulated in float64 slice by slice."""
    lam, a = lam.reshape(-1), a.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=lam.device)
    for s in range(0, lam.numel(), PROJECT_CHUNK):
        e = s + PROJECT_CHUNK
        total += torch.dot(lam[s:e].double(), a[s:e].double())
    return total


class Projector:
    """v_p = λᵀ(z̃_p − z)  (Eq. 13), summed over the batch, computed as λᵀz̃_p − λᵀz in float64.

    λᵀz is taken once when λ arrives, so the client can drop z and keep only λ and the z̃ being projected: its
    peak is inference + |λ| (paper: 4.14 vs 4.01 GB) instead of inference + |z| + |λ| + P|z̃|. The products of
    float32 values are exact in float64 and the sums carry ~1e-16 relative error of Σ|λz|, orders of magnitude
    below the float32 rounding of z̃ itself, so nothing is lost against forming z̃ − z first.
    """

    def __init__(self, lam: Tensor, z: Tensor) -> None:
        if lam.shape != z.shape:
            raise ValueError(f"λ has shape {tuple(lam.shape)} but the activation z has {tuple(z.shape)}")
        self.lam = lam
        self.base = dot64(lam, z)

    def __call__(self, z_tilde: Tensor) -> Tensor:
        return dot64(self.lam, z_tilde) - self.base


def project(lam: Tensor, z_tilde: Tensor, z: Tensor) -> Tensor:
    """One projection v = λᵀ(z̃ − z), the same arithmetic as :class:`Projector`."""
    return Projector(lam, z)(z_tilde)


def scalar_coefficients(scalars: Sequence[float] | Tensor, mu: float) -> list[float]:
    """c_p = v̄_p / (Pμ), so that ĝ_c = Σ_p c_p u_p  (Eq. 15)."""
    s = torch.as_tensor(scalars, dtype=torch.float64).reshape(-1)
    return (s / (s.numel() * mu)).tolist()


def reconstruct(
    param: Tensor,
    index: int,
    seeds: Sequence[int],
    coeffs: Sequence[float],
    rng_device: str | torch.device = "cpu",
    cache: NoiseCache | None = None,
    noise: Noise = gaussian_,
) -> Tensor:
    """The slice of ĝ_c = 1/(Pμ) Σ_p v̄_p u_p for trainable tensor ``index``, regenerated from the seeds (or taken
    from ``cache`` where it holds them).

    The P draws share one generator and one float32 scratch buffer on ``rng_device`` (numbers as
    :func:`noise_like`'s), so the loop allocates nothing beyond ĝ_i itself.
    """
    return reconstruct_group([param], [index], seeds, coeffs, rng_device, cache, noise)[0]


def reconstruct_group(
    params: Sequence[Tensor],
    indices: Sequence[int],
    seeds: Sequence[int],
    coeffs: Sequence[float],
    rng_device: str | torch.device = "cpu",
    cache: NoiseCache | None = None,
    noise: Noise = gaussian_,
) -> list[Tensor]:
    """:func:`reconstruct` for a group of tensors of one device and dtype (trainable tensors ``indices``; one of
    :func:`~hosfl_dist.core.params.groups`): per seed, the group's draws go into one float32 scratch buffer and
    one op adds them to the ĝ_i (:func:`hosfl_dist.core.foreach.add_`), each sum the kernel :func:`reconstruct`'s
    (so the same bits), without a Python op per tensor. The ĝ_i are views of one buffer where the params are
    contiguous."""
    total = sum(p.numel() for p in params)
    if all(p.is_contiguous() for p in params):
        g = list(torch.zeros(total, device=params[0].device, dtype=params[0].dtype).split([p.numel() for p in params]))
        g = [gi.view(p.shape) for gi, p in zip(g, params)]
    else:
        g = [torch.zeros_like(p) for p in params]
    gen = torch.Generator(device=rng_device)
    scratch = torch.empty(total, device=rng_device, dtype=torch.float32)
    for s, c in zip(seeds, coeffs):
        if cache is None:
            us = draw_flat(params, s, indices, rng_device, gen, scratch, noise)[1]
        else:
            us, offset = [], 0
            for p, i in zip(params, indices):
                us.append(cache.noise(p, s, i, rng_device, gen, scratch[offset:]))
                offset += p.numel()
        foreach.add_(g, us, alpha=c)
    return g
