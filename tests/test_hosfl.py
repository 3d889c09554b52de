"""HO-SFL end to end through the in-process runtime: catch-up exactness, traffic, server round semantics."""

from __future__ import annotations


import pytest
import torch

from hosfl_dist.algorithms.hosfl import HOSFLServer, SeedScalarHistory
from hosfl_dist.config import OptimConfig, load_config
from hosfl_dist.errors import ProtocolError
from hosfl_dist.models import SplitModel, build_split_model
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.optim import TensorwiseOptimizer
from hosfl_dist.runtime.server_group import local_endpoint
from hosfl_dist.transport.inprocess import InProcessTransport
from hosfl_dist.core.seeding import round_seeds, sample_clients
from hosfl_dist.core.zo import reconstruct, reconstruct_group, scalar_coefficients
from tiny import run_in_process, server_of


run = run_in_process


def test_stale_replica_replaying_50_rounds_is_bit_identical_adamw():
    """Algorithm 3: a replica that missed 50 rounds replays (seeds, v̄) and equals the live one, optimizer included."""
    torch.manual_seed(0)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    init = [torch.randn(s) for s in shapes]
    cfg = OptimConfig(name="adamw", lr=1e-3, weight_decay=5e-4)
    live = [t.clone() for t in init]
    stale = [t.clone() for t in init]
    opt_live, opt_stale = TensorwiseOptimizer(cfg, live), TensorwiseOptimizer(cfg, stale)
    P, mu = 5, 1e-3
    history = []
    for t in range(50):
        seeds = round_seeds(3, t, P)
        scalars = torch.randn(P) * 10.0 ** (t % 3)
        history.append((seeds, scalars))
        coeffs = scalar_coefficients(scalars, mu)
        opt_live.step(live, lambda ids, ps: [reconstruct(p, i, seeds, coeffs) for i, p in zip(ids, ps)])
    assert not torch.equal(live[0], init[0])
    for seeds, scalars in history:  # catch-up, later, from the same history
        coeffs = scalar_coefficients(scalars, mu)
        opt_stale.step(stale, lambda ids, ps: reconstruct_group(ps, ids, seeds, coeffs))
    assert tensors_digest(live + opt_live.state_tensors()) == tensors_digest(stale + opt_stale.state_tensors())


def test_per_client_replicas_catch_up_and_match_the_shared_shortcut(tiny_overrides, tmp_path):
    """Real per-client replicas (each catching up through Algorithm 3) give bit-identical results to one shared,
    always-current replica, and every replica ends identical."""
    _, e1, s1, rows1 = run(tiny_overrides + ["clients.replicas=per_client"])
    _, e2, s2, rows2 = run(tiny_overrides + ["clients.replicas=shared", f"job.out_dir={tmp_path / 'shared'}"])
    for a, b in zip(rows1, rows2):
        a.pop("wall_time_s"), b.pop("wall_time_s")
    assert rows1 == rows2
    assert s1["client_digests"] == s2["client_digests"]
    assert s1["server_digest"] == s2["server_digest"]
    # catch-up really happened: some client was sampled after missing rounds
    cfg = load_config(None, tiny_overrides)
    seen = {}
    missed = False
    for t in range(s1["rounds"]):
        for m in sample_clients(cfg.job.seed, t, cfg.clients.total, cfg.clients.per_round):
            missed |= m in seen and seen[m] < t - 1
            seen[m] = t
    assert missed
    assert rows1[-1]["eval_accuracy"] > 0.5  # 4 classes: chance is 0.25


def test_the_rounds_noise_kept_whole_in_part_or_not_at_all_changes_no_bit(tiny_overrides, tmp_path, monkeypatch):
    """zo.noise_cache_mb: a worker that keeps the round's draws (all of them, some, none) computes the same bits, and
    keeping them all draws each once per round instead of once per client and once more per replica updated."""
    import hosfl_dist.core.zo as zo

    draws = {"n": 0}
    seed_of = zo.tensor_seed

    def counted(seed: int, index: int) -> int:  # every draw seeds its generator once; a kept draw does not
        draws["n"] += 1
        return seed_of(seed, index)

    monkeypatch.setattr(zo, "tensor_seed", counted)
    results = {}
    for mb in (64, 0.0003, 0):  # all, the first few tensors' draws, none (the default)
        draws["n"] = 0
        _, _, summary, rows = run([*tiny_overrides, f"zo.noise_cache_mb={mb}", f"job.out_dir={tmp_path / str(mb)}"])
        for r in rows:
            r.pop("wall_time_s")
        results[mb] = (rows, summary["client_digests"], summary["server_digest"], draws["n"])
    assert results[64][:3] == results[0.0003][:3] == results[0][:3]
    assert results[64][3] < results[0.0003][3] < results[0][3]


@pytest.mark.parametrize("per_client", [False, True], ids=["shared", "per_client"])
def test_perturbed_forwards_batched_take_the_steps_of_one_at_a_time(tiny_overrides, tmp_path, per_client):
    """zo.perturb_batch: P=3 perturbed forwards in batches of 2 (a batch and a rest) or all 3 at once (with latency
    hiding too) give the scalars, losses and accuracies of one at a time up to the kernels' rounding; every replica of
    a batched run still ends where the server's history puts it (the run checks the digests)."""
    replicas = [f"clients.replicas={'per_client' if per_client else 'shared'}"]
    got = {}
    for k, extra in ((1, []), (2, []), (3, ["zo.overlap=true"])):
        _, _, summary, rows = run([*tiny_overrides, *replicas, *extra, f"zo.perturb_batch={k}",
                                   f"job.out_dir={tmp_path / str(k)}"])  # fmt: skip
        assert summary["status"] == "completed"
        got[k] = rows
    keys = ("train_loss", "eval_loss", "eval_accuracy")
    for k in (2, 3):
        assert [r["round"] for r in got[k]] == [r["round"] for r in got[1]]
        for a, b in zip(got[k], got[1]):
            for key in keys:
                if b.get(key) is not None:
                    assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (k, key)


def test_a_client_that_cannot_run_batched_is_a_one_line_error_naming_the_key():
    """A forward vmap refuses (here one that draws random numbers) stops with a ConfigError naming zo.perturb_batch."""
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.measure.modes import ProfileSpec, build_setup, profiled_worker

    spec = ProfileSpec(model="small_cnn", cut=1, batch=4, perturb_batch=2)
    setup = build_setup(spec)
    worker = profiled_worker(spec, setup, "hosfl")
    worker.bind(worker.replicas[0].params)
    seq = worker.zo_activations(setup.inputs, [7, 8, 9])
    worker.perturb_batch = 1
    one = worker.zo_activations(setup.inputs, [7, 8, 9])
    for a, b in zip(seq, one):
        torch.testing.assert_close(a, b)
    worker.perturb_batch = 2
    worker.module.register_forward_hook(lambda mod, args, out: out + 0 * torch.rand_like(out))
    with pytest.raises(ConfigError) as err:
        worker.zo_activations(setup.inputs, [7, 8, 9])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("invalid value for zo.perturb_batch: 2 (") and "zo.perturb_batch=1" in msg


def test_hosfl_traffic_is_dimension_free(tiny_overrides):
    cfg, engine, summary, rows = run(tiny_overrides)
    b = summary["comm"]["bytes"]
    rounds, K, P, B = summary["rounds"], cfg.clients.per_round, cfg.zo.num_perturbations, cfg.clients.batch_size
    assert b["uplink_model"] == 0 and b["downlink_model"] == 0
    assert b["uplink_scalars"] == rounds * K * P * 4  # P float32 scalars per client per round, nothing else
    # λ has z's shape: downlink gradients = uplink activations minus the labels (int64 per sample)
    assert b["downlink_gradients"] == b["uplink_activations"] - rounds * K * B * 8
    z_bytes = 4 * (cfg.model.width * 4 * 4) * B  # small_cnn cut=1 on 8x8 input: (width, 4, 4) float32
    assert b["downlink_gradients"] == rounds * K * z_bytes
    # v̄ (P float32) + seeds (P int64) per sampled client per round, plus catch-up history
    assert b["downlink_scalars_seeds"] >= rounds * K * P * (4 + 8)
    # the last metrics row already holds the final training traffic (only the end-of-run replica check follows)
    assert {k: v for k, v in rows[-1]["comm"].items() if k != "eval"} == {k: v for k, v in b.items() if k != "eval"}


def test_server_round_is_order_independent_and_steps_once():
    """The endpoint gathers round t's K submits and the server runs them once, in client-id order."""
    cfg = load_config(None, ["data.name=synthetic", "model.width=4", "clients.total=4", "clients.per_round=3"])
    info = {"num_classes": 4, "input_shape": (1, 8, 8)}
    sampled = sample_clients(cfg.job.seed, 0, 4, 3)  # S_0 = [0, 1, 3]
    acts = {m: {"z": torch.randn(5, 4, 4, 4)} for m in sampled}
    labels = {m: torch.randint(0, 4, (5,)) for m in sampled}
    results = []
    for order in (sampled, sampled[::-1]):
        split: SplitModel = build_split_model(cfg, info, True)
        server = server_of(cfg, split, HOSFLServer)
        tr = InProcessTransport(local_endpoint(server))
        futs = {m: tr.call_async("submit", t=0, client=m, act=acts[m], labels=labels[m]) for m in order[:-1]}
        assert not any(f.done() for f in futs.values())  # nothing is computed before all K clients arrived
        last = order[-1]
        futs[last] = tr.call_async("submit", t=0, client=last, act=acts[last], labels=labels[last])
        lams = {m: futs[m].wait()["lam"] for m in order}
        results.append((lams, tensors_digest(split.server.parameters()), server.rounds_done))
    (l1, d1, r1), (l2, d2, r2) = results
    assert d1 == d2 and r1 == r2 == 1
    for m in l1:
        assert torch.equal(l1[m], l2[m])
    # λ_m is the gradient of client m's own loss with θs of round t, computed one by one here
    split = build_split_model(cfg, info, True)
    z = acts[1]["z"].clone().requires_grad_(True)
    split.task.loss(split.server(z), labels[1]).backward()
    torch.testing.assert_close(l1[1], z.grad)
    # a round from the future is refused rather than mixed: every client of that round gets the error
    tr = InProcessTransport(local_endpoint(server_of(cfg, build_split_model(cfg, info, True), HOSFLServer)))
    futs = [tr.call_async("submit", t=1, client=m, act=acts[m], labels=labels[m]) for m in sampled]
    for f in futs:
        with pytest.raises(ProtocolError, match="rounds must not mix"):
            f.wait()
    # activations from clients that were not sampled are refused too
    tr = InProcessTransport(local_endpoint(server_of(cfg, build_split_model(cfg, info, True), HOSFLServer)))
    futs = [tr.call_async("submit", t=0, client=m, act=acts[sampled[0]], labels=labels[sampled[0]]) for m in (0, 1, 2)]
    with pytest.raises(ProtocolError, match=r"activations from clients \[0, 1, 2\], sampled \[0, 1, 3\]"):
        futs[0].wait()


def test_history_is_trimmed_below_the_oldest_replica():
    h = SeedScalarHistory(2)
    for t in range(5):
        h.append(t, torch.tensor([t, t]), torch.tensor([0.5, 0.5]))
    h.trim(3)
    assert h.offset == 3 and len(h.seeds) == 2
    seeds, _ = h.window(3, 5)
    assert seeds[:, 0].tolist() == [3, 4]
    with pytest.raises(RuntimeError, match="trimmed"):
        h.window(1, 5)


class _Away:
    """λ on its way: ``done()`` says no until someone waits for it (as over a link, where it is still travelling)."""

    def __init__(self, pending) -> None:
        self.pending, self.taken = pending, False

    def done(self) -> bool:
        return self.taken

    def wait(self):
        self.taken = True
        return self.pending.wait()


@pytest.mark.parametrize(
    ("overlap", "held"),
    [("zo.overlap=false", False), ("zo.overlap=true", True), ("zo.overlap=auto", True),
     ("zo.overlap_memory_mb=0.01", False)],  # auto: the z̃ of 3 clients x P=3 take 0.0176 MiB
)  # fmt: skip
def test_latency_hiding_keeps_the_z_tilde_of_clients_whose_lambda_is_away_and_changes_no_bit(
    tiny_overrides, tmp_path, monkeypatch, caplog, overlap, held
):
    """Every upload of a round leaves before any perturbed forward; with latency hiding (zo.overlap, ``auto`` within
    zo.overlap_memory_mb) the P perturbed forwards of each client whose λ is away run then and are kept; the results
    are those of the run without it, bit for bit."""
    from hosfl_dist.algorithms.hosfl import HOSFLWorker
    from tiny import runner

    order: list[str] = []
    real_call = HOSFLWorker.zo_activations

    def zo_activations(self, x, seeds):
        order.append("z_tilde")
        return real_call(self, x, seeds)

    monkeypatch.setattr(HOSFLWorker, "zo_activations", zo_activations)
    reference = run_in_process([*tiny_overrides, "zo.overlap=false", f"job.out_dir={tmp_path / 'ref'}"])[2]
    order.clear()
    r = runner([*tiny_overrides, overlap, f"job.out_dir={tmp_path / 'run'}"])
    inner = r.worker.transport.call_async

    def call_async(method, **kwargs):
        order.append(method)
        got = inner(method, **kwargs)
        return _Away(got) if method == "submit" else got

    inner_many = r.worker.transport.call_many

    def call_many(method, calls):  # a worker's sampled clients' calls, sent together
        order.extend([method] * len(calls))
        got = inner_many(method, calls)
        return [_Away(g) for g in got] if method == "submit" else got

    monkeypatch.setattr(r.worker.transport, "call_async", call_async)
    monkeypatch.setattr(r.worker.transport, "call_many", call_many)
    caplog.clear()  # the reference run's line, where an earlier test left the package's logging on
    with caplog.at_level("INFO", logger="hosfl_dist.algorithms.hosfl"):
        summary = r.run()
    assert summary["client_digests"] == reference["client_digests"]
    assert summary["server_digest"] == reference["server_digest"] and summary["final"] == reference["final"]
    rounds = summary["rounds"]
    assert order.count("submit") == 3 * rounds
    assert order.count("z_tilde") == (3 * rounds if held else 0)
    if held:  # a round's three submits, then its three clients' perturbed forwards
        first = order.index("z_tilde")
        assert order[first - 3 : first] == ["submit"] * 3 and order[first : first + 3] == ["z_tilde"] * 3, order
    told = [m for m in caplog.messages if m.startswith("latency hiding")]
    assert len(told) == 1 and told[0].split(": ")[1].startswith("on" if held else "off"), told


def test_a_run_continues_with_latency_hiding_changed(tiny_overrides, tmp_path):
    """zo.overlap changes when the client's forwards run, never a bit: a run and its continuation may differ in it."""
    from hosfl_dist.runfolder.folder import config_differences
    from hosfl_dist.runfolder.identity import identity_differences

    out = tmp_path / "run"
    run_in_process([*tiny_overrides, "zo.overlap=false", f"job.out_dir={out}"])
    for changed in (["zo.overlap=true"], ["zo.overlap=auto", "zo.overlap_memory_mb=1"]):
        assert config_differences(out, load_config(None, [*tiny_overrides, *changed, f"job.out_dir={out}"])) == []
    assert config_differences(out, load_config(None, [*tiny_overrides, "zo.num_perturbations=4"])) == [
        "zo.num_perturbations"
    ]
    # a checkpoint written when zo.overlap was identity (false, then the default) still continues
    now = {"config": {"zo": {"mu": 1e-3}, "job": {"seed": 0}}}
    old = {"config": {"zo": {"mu": 1e-3, "overlap": False}, "job": {"seed": 0}}}
    assert identity_differences(old, now, code=False) == []
    assert identity_differences({"config": {"zo": {"mu": 1e-2}, "job": {"seed": 0}}}, now, code=False) == [
        "config key zo.mu"
    ]
