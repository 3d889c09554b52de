"""Learning-rate schedules: warmup + linear / cosine on both sides, a pure function of the round, so catch-up replay
stays bit-exact."""

from __future__ import annotations

import math

import pytest

from tiny import TINY_OVERRIDES, run_in_process

from hosfl_dist.config import OptimConfig, load_config
from hosfl_dist.core.optim import lr_at
from hosfl_dist.errors import ConfigError
from hosfl_dist.runtime.checks import load_run_config


def test_warmup_then_linear_or_cosine_to_the_final_ratio():
    cos = OptimConfig(lr=1.0, schedule="cosine", warmup_rounds=4, final_lr_ratio=0.1)
    assert [lr_at(cos, t, 20) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cos, 4, 20) == 1.0 and lr_at(cos, 19, 20) == pytest.approx(0.1)
    assert lr_at(cos, 4 + 15 // 2, 20) < 0.6 < lr_at(cos, 4 + 15 // 4, 20)
    lin = OptimConfig(lr=2.0, schedule="linear")
    assert [lr_at(lin, t, 5) for t in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert lr_at(lin, 99, 5) == 0.0  # past the planned end: the final rate
    assert lr_at(OptimConfig(lr=0.3), 7, 10) == 0.3 and not OptimConfig().scheduled
    half = OptimConfig(lr=1.0, schedule="cosine")
    assert lr_at(half, 5, 11) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


SCHEDULED = [
    "clients.optim.schedule=cosine",
    "clients.optim.warmup_rounds=3",
    "clients.optim.final_lr_ratio=0.1",
    "server.optim.schedule=linear",
    "server.optim.warmup_rounds=2",
]


def test_replicas_that_catch_up_equal_the_always_current_one_under_a_schedule(tmp_path):
    """Per-client replicas replay missed rounds with those rounds' rates: bit-identical to the shared replica."""
    _, _, a, rows_a = run_in_process([*TINY_OVERRIDES, *SCHEDULED, f"job.out_dir={tmp_path / 'a'}"])
    _, _, b, rows_b = run_in_process([*TINY_OVERRIDES, *SCHEDULED, "clients.replicas=shared",
                                      f"job.out_dir={tmp_path / 'b'}"])  # fmt: skip
    _, _, c, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'c'}"])
    for r in rows_a + rows_b:
        r.pop("wall_time_s")
    assert rows_a == rows_b and a["client_digests"] == b["client_digests"] and a["server_digest"] == b["server_digest"]
    assert a["client_digests"] != c["client_digests"] and a["server_digest"] != c["server_digest"]  # it took effect


def test_schedules_are_refused_where_they_are_not_implemented():
    with pytest.raises(ConfigError, match=r"clients\.optim\.schedule.*implemented for (\w+/)?hosfl\b"):
        load_run_config(None, [*TINY_OVERRIDES, "algorithm.name=sfl", "clients.optim.schedule=cosine"])
    with pytest.raises(ConfigError, match=r"final_lr_ratio"):
        load_config(None, ["server.optim.final_lr_ratio=2"])
