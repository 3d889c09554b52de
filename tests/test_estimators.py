"""The zeroth-order step as one component (``zo.estimator``, hosfl_dist.core.estimators): the default is the Gaussian
two-point estimator the loose functions of hosfl_dist.core.zo compute, the package's Rademacher one draws ±1 and
trains, a plug-in's estimator (docs/python-api.md, "A zeroth-order estimator of your own") is the one a run uses, and
a name that is unknown or that a method cannot use is one line."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from hosfl_dist.config import ZOConfig, load_config
from hosfl_dist.core import zo
from hosfl_dist.core.estimators import (
    GaussianTwoPoint,
    RademacherTwoPoint,
    ZOEstimator,
    build_estimator,
    estimator_names,
    register_estimator,
)
from hosfl_dist.core.params import slot_tensors, trainable_slots
from hosfl_dist.errors import ConfigError, PluginError
from hosfl_dist.runfolder.identity import comparable_config
from hosfl_dist.runtime.checks import load_run_config
from tiny import ROOT, TINY_OVERRIDES, page_block, run_one_thread, user_folder, user_module

SPHERE = page_block('register_estimator("sphere"')
"""The page's myestimator.py: u's slice of each tensor uniform on the sphere of radius √n."""
COUNTED = '''
"""The paper's estimator under another name, counting the calls a run makes of it."""
from hosfl_dist.core.estimators import GaussianTwoPoint, register_estimator

CALLS = {"perturbed": 0, "projector": 0, "coefficients": 0, "step": 0, "built": 0}


class Counted(GaussianTwoPoint):
    def __init__(self, zo):
        super().__init__(zo)
        CALLS["built"] += 1

    def perturbed(self, *args, **kwargs):
        CALLS["perturbed"] += 1
        return super().perturbed(*args, **kwargs)

    def projector(self, lam, z):
        CALLS["projector"] += 1
        return super().projector(lam, z)

    def coefficients(self, scalars):
        CALLS["coefficients"] += 1
        return super().coefficients(scalars)

    def step(self, *args, **kwargs):
        CALLS["step"] += 1
        return super().step(*args, **kwargs)


class Broken(GaussianTwoPoint):
    def __init__(self, zo):
        raise KeyError("no μ today")


register_estimator("counted", Counted)
register_estimator("broken", Broken)
'''
SPHERE_MOD, COUNTED_MOD = user_module("myestimator"), user_module("counted")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    yield user_folder(tmp_path, monkeypatch, {"myestimator": SPHERE, "counted": COUNTED})
    from hosfl_dist.core import estimators

    for name in ("sphere", "counted", "broken"):
        estimators._ESTIMATORS.pop(name, None)  # the registry lists the package's own to the other tests
    for name in (SPHERE_MOD, COUNTED_MOD):
        sys.modules.pop(name, None)


def tiny(tmp_path, name: str, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, *extra, f"job.out_dir={tmp_path / name}"]


def digests(summary: dict) -> tuple[set[str], str]:
    return set(summary["client_digests"].values()), summary["server_digest"]


# -- the component -------------------------------------------------------------------------------------------------
def test_the_default_is_the_gaussian_two_point_estimator_and_a_default_run_keeps_its_identity():
    assert ZOConfig().estimator == "gaussian" and {"gaussian", "rademacher"} <= set(estimator_names())
    assert type(build_estimator(ZOConfig())) is GaussianTwoPoint
    assert type(build_estimator(ZOConfig(estimator="rademacher"))) is RademacherTwoPoint
    # a run recorded before the key existed is the same run as a default one now; another estimator is another run
    assert "estimator" not in comparable_config(load_config(None, TINY_OVERRIDES))["zo"]
    rad = comparable_config(load_config(None, [*TINY_OVERRIDES, "zo.estimator=rademacher"]))
    assert rad["zo"]["estimator"] == "rademacher"


def test_the_gaussian_component_computes_what_the_functions_of_core_zo_do():
    """Each step of the component against the function it stands for, in the same process: the same numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    slots, x, mu = trainable_slots(model), torch.randn(4, 6), 1e-3
    est = build_estimator(ZOConfig(mu=mu))
    seeds = [11, 12, 13]
    with torch.no_grad():
        z = model(x)
        for s in seeds:
            with est.perturbed(slots, s):
                got = model(x)
            with zo.perturbed(slots, s, mu):
                want = model(x)
            assert torch.equal(got, want) and not torch.equal(got, z)
        plus, minus = est.pair(slots, 11, lambda sign: model(x))
        with zo.perturbed(slots, 11, mu):
            assert torch.equal(plus, model(x))
        with zo.perturbed(slots, 11, -mu):
            assert torch.equal(minus, model(x))
        batched = est.perturbed_batch(lambda: model(x), slots, seeds)  # (P, 4, 3)
        assert torch.equal(batched, zo.perturbed_batch(lambda: model(x), slots, seeds, mu))
    lam = torch.randn_like(z)
    v = torch.stack([est.projector(lam, z)(z + 0.01 * k) for k in range(3)])
    assert torch.equal(v, torch.stack([zo.project(lam, z + 0.01 * k, z) for k in range(3)]))
    assert est.coefficients(v) == zo.scalar_coefficients(v, mu)
    assert est.pair_coefficient(2.0, 1.0) == (2.0 - 1.0) / (2 * mu)
    params = slot_tensors(slots)
    got = est.reconstruct_group(params, range(len(params)), seeds, [0.5, -1.0, 2.0])
    want = zo.reconstruct_group(params, range(len(params)), seeds, [0.5, -1.0, 2.0])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rademacher_draws_plus_or_minus_one_regenerated_from_the_seed_and_kept_alike():
    p = torch.zeros(300, 7)
    u = zo.noise_like(p, 5, 2, noise=zo.rademacher_)
    assert set(u.unique().tolist()) == {-1.0, 1.0} and abs(float(u.mean())) < 0.1
    assert torch.equal(u, zo.noise_like(p, 5, 2, noise=zo.rademacher_))  # regenerated, not kept
    assert not torch.equal(u, zo.noise_like(p, 5, 3, noise=zo.rademacher_))  # another tensor, another draw
    est = RademacherTwoPoint(ZOConfig())
    cache = est.noise_cache(1 << 20)
    assert cache is not None and est.noise_cache(0) is None
    assert torch.equal(cache.noise(p, 5, 2, "cpu", torch.Generator()), u)
    # ĝ = Σ_p c_p u_p with the estimator's u, from the seeds, with or without the round's kept draws
    g = est.reconstruct_group([p], [2], [5, 6], [0.5, -2.0])[0]
    want = 0.5 * u - 2.0 * zo.noise_like(p, 6, 2, noise=zo.rademacher_)
    torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert torch.equal(est.reconstruct_group([p], [2], [5, 6], [0.5, -2.0], cache)[0], g)


# -- in a run ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alg", ["hosfl", "zo_sfl", "mu_splitfed"])
def test_rademacher_trains_every_zeroth_order_method_with_its_own_draws(tmp_path, alg):
    gauss = run_one_thread(tiny(tmp_path, "g", f"algorithm.name={alg}"))
    rows, summary = run_one_thread(tiny(tmp_path, "r", f"algorithm.name={alg}", "zo.estimator=rademacher"))
    assert summary["status"] == "completed"
    assert digests(summary) != digests(gauss[1])  # other u: other numbers, on the client and the server
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]  # (ZO-SFL and MU-SplitFed by ~0.5% in the tiny run's steps)


def test_an_estimator_a_method_cannot_use_or_an_unknown_one_is_one_line_exit_2(tmp_path):
    for alg in ("sfl", "fsl_sage", "frozen_client"):
        with pytest.raises(ConfigError) as exc:
            load_run_config(None, tiny(tmp_path, "x", f"algorithm.name={alg}", "zo.estimator=rademacher"))
        said = str(exc.value)
        assert said.startswith("invalid value for zo.estimator: 'rademacher' (zeroth-order estimators are used by ")
        assert f"not algorithm.name={alg}" in said and "hosfl" in said and "\n" not in said
    load_run_config(None, tiny(tmp_path, "x", "algorithm.name=sfl"))  # the default: nothing to refuse
    res = subprocess.run([sys.executable, "-m", "hosfl_dist.run", *tiny(tmp_path, "x", "zo.estimator=gausian"),
                          "--check"], cwd=ROOT, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == ("error: invalid value for zo.estimator: 'gausian' (choose one of ['gaussian', "
                                  "'rademacher']; did you mean 'gaussian'?)")  # fmt: skip


def test_a_plugin_estimator_is_the_one_every_part_of_a_run_calls(tmp_path, plugins):
    """The counting estimator is the Gaussian one: the same bits as the default, and every step went through it."""
    counted = importlib.import_module(COUNTED_MOD)
    default = run_one_thread(tiny(tmp_path, "g"))
    rows, summary = run_one_thread(tiny(tmp_path, "c", f"job.plugins=[{COUNTED_MOD}]", "zo.estimator=counted"))
    assert digests(summary) == digests(default[1]) and rows == default[0]
    calls, rounds = counted.CALLS, summary["rounds"]
    k, p = 3, 3  # TINY_OVERRIDES: clients.per_round, zo.num_perturbations
    assert calls["built"] >= 2  # the server's (its base replica replays) and the worker's
    assert calls["projector"] == k * rounds  # one λ per counted client per round
    assert calls["perturbed"] == k * p * rounds  # each client's P perturbed forwards
    assert calls["coefficients"] == calls["step"] > 0  # every update rebuilt through it, live or replayed


def test_a_plugin_estimator_from_the_page_trains_and_its_faults_are_one_line(tmp_path, plugins):
    sphere = importlib.import_module(SPHERE_MOD)
    u = sphere.sphere_(torch.empty(400), torch.Generator().manual_seed(3))
    torch.testing.assert_close(u.norm() ** 2, torch.tensor(400.0))
    default = run_one_thread(tiny(tmp_path, "g"))
    rows, summary = run_one_thread(tiny(tmp_path, "s", f"job.plugins=[{SPHERE_MOD}]", "zo.estimator=sphere"))
    assert summary["status"] == "completed" and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert digests(summary) != digests(default[1])
    importlib.import_module(COUNTED_MOD)
    with pytest.raises(ConfigError) as exc:  # the plug-ins' names beside the package's
        build_estimator(ZOConfig(estimator="spere"))
    assert str(exc.value) == ("invalid value for zo.estimator: 'spere' (choose one of ['broken', 'counted', "
                              "'gaussian', 'rademacher', 'sphere']; did you mean 'sphere'?)")  # fmt: skip
    with pytest.raises(PluginError) as exc:
        build_estimator(ZOConfig(estimator="broken"))
    assert str(exc.value) == (f"plug-in {COUNTED_MOD}: zeroth-order estimator broken: Broken(zo section) raised "
                              "KeyError: 'no μ today'")  # fmt: skip
    with pytest.raises(ValueError, match="'gaussian' is registered twice"):
        register_estimator("gaussian", sphere.SphereTwoPoint)
    with pytest.raises(ValueError, match="not a subclass of ZOEstimator"):
        register_estimator("plain", object)  # type: ignore[arg-type]
    assert issubclass(sphere.SphereTwoPoint, ZOEstimator)
