"""The zeroth-order step as one component, built from ``zo`` (:class:`~hosfl_dist.config.ZOConfig`), and the registry
``zo.estimator`` selects it from.

A :class:`ZOEstimator` is what every zeroth-order method asks for, in the order a step runs:

  draw / perturb   forwards at θ ± μu_p, u_p regenerated from the seed s_p, θ never written: ``perturbed``,
                   ``perturbed_batch``, ``pair``; the round's draws kept for the update: ``noise_cache``
  project          λ onto the P perturbations, v_p = λᵀ(z̃_p − z) (Eq. 13): ``projector``
  coefficients     c_p = v̄_p / (Pμ) from the aggregated scalars (HO-SFL, Eq. 15): ``coefficients``; (f₊ − f₋) / (2μ)
                   from a two-point pair (ZO-SFL, MU-SplitFed): ``pair_coefficient``
  reconstruct      ĝ = Σ_p c_p u_p from the seeds, group by group, and the optimizer's step on it (Eq. 15-16):
                   ``reconstruct_group``, ``step``

The math is :mod:`hosfl_dist.core.zo`'s functions; an estimator fixes their arguments (μ, the generator's device, the
perturbation mode) and u's distribution (:attr:`ZOEstimator.noise`). The package registers ``gaussian`` (u ~ N(0, I),
the paper's, the default) and ``rademacher`` (u uniform on {±1}^d: the same unbiasedness, E[uuᵀ] = I, with |u|² = d
exactly); a plug-in (``job.plugins``) registers its own subclass with :func:`register_estimator`. Every replica of a
run builds the same estimator from the same config, so the seeds still regenerate the same u everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from hosfl_dist.config import ZOConfig
from hosfl_dist.core.optim import TensorwiseOptimizer
from hosfl_dist.core.params import Slots
from hosfl_dist.core.plugins import plugin_call
from hosfl_dist.core.registry import Registry
from hosfl_dist.core.zo import (
    Noise,
    NoiseCache,
    Projector,
    gaussian_,
    perturbed,
    perturbed_batch,
    rademacher_,
    reconstruct_group,
    scalar_coefficients,
)

T = TypeVar("T")


class ZOEstimator:
    """The seeded two-point estimator of one run: ĝ = Σ_p c_p u_p, u_p drawn from :attr:`noise` by seed.

    Subclasses change u's distribution (:attr:`noise`) or any step below; what they return must keep the shapes and
    the float64/float32 conventions the methods rely on (``coefficients``: plain floats, one per seed).
    """

    noise: ClassVar[Noise] = gaussian_
    """u's distribution (:data:`~hosfl_dist.core.zo.Noise`): fills a flat float32 tensor in place from a reseeded
    generator, mean 0 and covariance I."""

    def __init__(self, zo: ZOConfig) -> None:
        self.mu = zo.mu
        self.rng_device = zo.rng_device
        self.perturb_mode = zo.perturb_mode
        self.fill: Noise = type(self).noise  # the class's function, not bound to the instance

    # -- draw and perturb ------------------------------------------------------------------------------------------
    def noise_cache(self, limit_bytes: float) -> NoiseCache | None:
        """A keeper of one round's draws of u within ``limit_bytes`` (0: None, every draw made again)."""
        return NoiseCache(limit_bytes, self.fill) if limit_bytes else None

    def perturbed(
        self, slots: Slots, seed: int, sign: int = 1, cache: NoiseCache | None = None
    ) -> AbstractContextManager[None]:
        """A context in which the module of ``slots`` runs at θ + sign·μ·u(seed), θ unwritten (Eq. 12)."""
        return perturbed(slots, seed, sign * self.mu, self.rng_device, self.perturb_mode, cache, self.fill)

    def perturbed_batch(
        self, forward: Callable[[], Tensor], slots: Slots, seeds: Sequence[int], cache: NoiseCache | None = None
    ) -> Tensor:
        """``forward()`` at θ + μ·u(s) for every seed, as one batched forward: (len(seeds), *out.shape)."""
        return perturbed_batch(forward, slots, seeds, self.mu, self.rng_device, cache, self.fill)

    def pair(self, slots: Slots, seed: int, fn: Callable[[int], T]) -> tuple[T, T]:
        """(fn(+1) at θ + μu, fn(−1) at θ − μu), u regenerated from ``seed``, without autograd; θ is never written."""
        with torch.no_grad():
            with self.perturbed(slots, seed, +1):
                plus = fn(+1)
            with self.perturbed(slots, seed, -1):
                minus = fn(-1)
        return plus, minus

    # -- project -----------------------------------------------------------------------------------------------------
    def projector(self, lam: Tensor, z: Tensor) -> Projector:
        """v_p = λᵀ(z̃_p − z) for each z̃_p it is given (Eq. 13), λᵀz taken once now."""
        return Projector(lam, z)

    # -- coefficients ------------------------------------------------------------------------------------------------
    def coefficients(self, scalars: Sequence[float] | Tensor) -> list[float]:
        """c_p of ĝ = Σ_p c_p u_p from the aggregated scalars v̄ (Eq. 15): v̄_p / (Pμ)."""
        return scalar_coefficients(scalars, self.mu)

    def pair_coefficient(self, plus: float, minus: float) -> float:
        """The coefficient of u from a two-point pair of losses: (f₊ − f₋) / (2μ)."""
        return (plus - minus) / (2 * self.mu)

    # -- reconstruct -------------------------------------------------------------------------------------------------
    def reconstruct_group(
        self,
        params: Sequence[Tensor],
        indices: Sequence[int],
        seeds: Sequence[int],
        coeffs: Sequence[float],
        cache: NoiseCache | None = None,
    ) -> list[Tensor]:
        """ĝ_i = Σ_p c_p u_{p,i} for a group of tensors of one device and dtype (trainable tensors ``indices``)."""
        return reconstruct_group(params, indices, seeds, coeffs, self.rng_device, cache, self.fill)

    def step(
        self,
        opt: TensorwiseOptimizer,
        params: Sequence[Tensor],
        seeds: Sequence[int],
        coeffs: Sequence[float],
        cache: NoiseCache | None = None,
    ) -> None:
        """θ ← opt(θ, ĝ) with ĝ = Σ_p c_p u_p regenerated group by group from the seeds (Eq. 16)."""
        opt.step(params, lambda ids, ps: self.reconstruct_group(ps, ids, seeds, coeffs, cache))


class GaussianTwoPoint(ZOEstimator):
    """u ~ N(0, I): the paper's estimator, ``zo.estimator=gaussian`` (the default)."""


class RademacherTwoPoint(ZOEstimator):
    """u uniform on {−1, +1}^d, ``zo.estimator=rademacher``: unbiased like the Gaussian (E[uuᵀ] = I) with a fixed
    norm |u|² = d, so a step's size depends on the scalars alone."""

    noise = rademacher_


_ESTIMATORS: Registry[type[ZOEstimator]] = Registry("zeroth-order estimator", "zo.estimator")


def register_estimator(name: str, cls: type[ZOEstimator]) -> type[ZOEstimator]:
    """Add ``cls`` (a :class:`ZOEstimator` subclass, built with the run's ``zo`` section) under ``name``; a name taken
    by another class, or a class that is not an estimator, is a ValueError."""
    if not (isinstance(cls, type) and issubclass(cls, ZOEstimator)):
        raise ValueError(f"zeroth-order estimator {name!r}: {cls!r} is not a subclass of ZOEstimator")
    return _ESTIMATORS.add(name, cls)


def estimator_names() -> list[str]:
    """Every registered ``zo.estimator``, the package's and the imported plug-ins'."""
    return _ESTIMATORS.names()


def get_estimator(name: str) -> type[ZOEstimator]:
    """The class registered under ``name``; a ConfigError listing the names (and the closest) otherwise."""
    return _ESTIMATORS.get_or_refuse(name)


def build_estimator(zo: ZOConfig) -> ZOEstimator:
    """The estimator ``zo.estimator`` names, built from ``zo``; what a plug-in's class raises is one line naming it."""
    cls = get_estimator(zo.estimator)
    with plugin_call(cls, f"zeroth-order estimator {zo.estimator}: {cls.__name__}(zo section)"):
        return cls(zo)


register_estimator("gaussian", GaussianTwoPoint)
register_estimator("rademacher", RademacherTwoPoint)
