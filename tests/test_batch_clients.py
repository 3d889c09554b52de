"""zo.batch_clients: a worker's clients of a round in one pass, against client by client (HO-SFL)."""

from __future__ import annotations

import pytest
import torch

from hosfl_dist.algorithms.hosfl import HOSFLWorker, cat_inputs, rows_of
from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.models.vision import BatchStatsNorm, _replace_bn
from hosfl_dist.runtime.build import method_config
from tiny import (
    TINY_OVERRIDES,
    assert_same_as,
    lm_overrides,
    run_in_process,
    run_one_thread,
    runner,
    torchrun,
    write_text_files,
)

KEYS = ("train_loss", "eval_loss", "eval_accuracy")


def counted_forwards(monkeypatch) -> dict[str, int]:
    """Count the client's forwards (z and every z̃ go through HOSFLWorker.zo_forward)."""
    calls = {"n": 0}
    forward = HOSFLWorker.zo_forward

    def counting(self, x):
        calls["n"] += 1
        return forward(self, x)

    monkeypatch.setattr(HOSFLWorker, "zo_forward", counting)
    return calls


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["zo.overlap=true"],  # the P z̃ of the concatenated batch run while λ is away
        ["zo.perturb_batch=2"],  # a batch of 2 seeds and a rest, each over the concatenated batch
        ["clients.replicas=per_client", "clients.dropout=0.3", "server.min_clients=1"],  # catch-ups, dropped rows
    ],
    ids=["plain", "overlap", "perturb_batch", "per_client_dropout"],
)
def test_clients_in_one_pass_take_the_steps_of_client_by_client(tmp_path, monkeypatch, extra):
    """One forward for the K=3 clients' z and one per seed for their z̃ (1 + P forwards a round, not K(1 + P)) give
    the losses, accuracies and θc of client by client up to the kernels' rounding (other batch sizes); the run checks
    that every replica ends where the server's history puts it."""
    calls = counted_forwards(monkeypatch)
    got = {}
    for on in (False, True):
        calls["n"] = 0
        _, r, summary, rows = run_in_process([*TINY_OVERRIDES, *extra, f"zo.batch_clients={str(on).lower()}",
                                              f"job.out_dir={tmp_path / str(on)}"])  # fmt: skip
        assert summary["status"] == "completed"
        params = [p.detach().clone() for p in r.worker.replicas[0].params]
        got[on] = (rows, params, calls["n"])
    (rows_1, params_1, n_1), (rows_k, params_k, n_k) = got[False], got[True]
    assert [r["round"] for r in rows_k] == [r["round"] for r in rows_1]
    for a, b in zip(rows_k, rows_1):
        for key in KEYS:
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(params_k, params_1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert n_k < n_1  # the batched run did run batched (evaluation's forwards are the same in both)


def test_inputs_that_do_not_stack_are_not_concatenated():
    """Text batches trimmed to their longest prompt differ past the rows: that round runs client by client."""
    a = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    b = {"input_ids": torch.zeros(3, 5, dtype=torch.long), "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    c = {"input_ids": torch.zeros(2, 7, dtype=torch.long), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    both = cat_inputs([a, b])
    assert both["input_ids"].shape == (5, 5) and rows_of(both) == 5 and rows_of(b) == 3
    assert cat_inputs([a, c]) is None
    assert cat_inputs([torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 8, 8)]) is None
    assert cat_inputs([torch.zeros(2, 3), torch.ones(1, 3)]).shape == (3, 3)


def test_a_tiny_lm_with_clients_in_one_pass_trains_as_client_by_client(tmp_path, monkeypatch):
    """Dict inputs (input_ids, attention_mask) and a side input travelling with z (the mask): a round whose batches
    have one length goes in one pass, one whose batches were trimmed to different lengths runs client by client; the
    run is that of client by client up to rounding."""
    files = write_text_files(tmp_path)
    together = []
    forward_together = HOSFLWorker._forward_together

    def recorded(self, jobs):
        together.append(forward_together(self, jobs))
        return together[-1]

    monkeypatch.setattr(HOSFLWorker, "_forward_together", recorded)
    got = {}
    for on in (False, True):
        _, _, summary, rows = run_in_process([*lm_overrides(tmp_path / str(on), files),
                                              f"zo.batch_clients={str(on).lower()}"])  # fmt: skip
        assert summary["status"] == "completed"
        got[on] = rows
    assert sorted(together) == [False, True]  # at data.max_length=40: rounds of 27 + 40 tokens, and of 40 + 40
    for a, b in zip(got[True], got[False], strict=True):
        for key in KEYS:
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_a_client_part_with_batch_statistics_is_refused_in_one_line():
    """A BatchNorm of f_c that normalises with its batch would mix the clients' rows: zo.batch_clients is refused."""
    r = runner([*TINY_OVERRIDES, "model.name=resnet18", "model.freeze_bn=code", "clients.batch_size=4"])
    _replace_bn(r.split.client, BatchStatsNorm, trainable_affine=False)  # a first-order client's f_c under code
    cfg = load_config(None, [*TINY_OVERRIDES, "model.name=resnet18", "model.freeze_bn=code", "zo.batch_clients=true"])
    w = r.worker
    with pytest.raises(ConfigError) as err:
        HOSFLWorker(method_config(cfg), r.split, r.data, sorted(w.hosted), w.transport, w.collective)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("invalid value for zo.batch_clients: true (")
    assert "batch statistics" in msg


def test_batch_clients_is_refused_for_a_method_that_does_not_batch_its_clients():
    with pytest.raises(ConfigError, match=r"zo\.batch_clients.*implemented for hosfl, not algorithm.name=zo_sfl"):
        runner([*TINY_OVERRIDES, "algorithm.name=zo_sfl", "zo.batch_clients=true"])


@pytest.mark.slow  # 18 s: torchrun and the in-process reference on two cores
def test_torchrun_equals_in_process_with_clients_in_one_pass(tmp_path):
    """1 server + 1 worker hosting the 6 clients (the in-process layout: the same clients share each pass) equal the
    in-process run bit for bit. With more workers a pass holds fewer clients, so kernels over other batch sizes may
    round otherwise."""
    cfg = [*TINY_OVERRIDES, "server.rpc_timeout_s=60", "zo.batch_clients=true", "zo.overlap=true"]
    ref = run_one_thread([*cfg, f"job.out_dir={tmp_path / 'inproc'}"])
    rc, out, _ = torchrun(2, ["-m", "hosfl_dist.run", *cfg, f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    assert_same_as(tmp_path / "run", ref)
