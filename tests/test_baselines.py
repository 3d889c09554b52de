"""The baselines (SFL, SplitLoRA, FSL-SAGE, ZO-SFL, MU-SplitFed): what makes each one that method.

Each method's first round is recomputed by hand on the unsplit model (one client, one step, plain SGD) and compared
with what the runtime produced; traffic is checked against the pattern of the paper's Table 5; and every method
gives the same result whether one worker hosts all clients or two workers host half each.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.exchange import aggregate, server_seed, step_seed
from hosfl_dist.algorithms.fsl_sage import FSLSageServer, build_aux
from hosfl_dist.config import load_config
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.estimators import ZOEstimator
from hosfl_dist.core.params import bound, slot_tensors, trainable_slots
from hosfl_dist.core.zo import noise_like
from hosfl_dist.data import FederatedData, build_data
from hosfl_dist.data.vision import shared_data_dir
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import SplitModel, build_split_model
from hosfl_dist.runtime.build import data_sections, method_config
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport, LocalCollective, count_exchange
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.wire import PAPER_CATEGORIES, CommMeter
from tiny import run_in_process, server_of

BASELINES = ("sfl", "fsl_sage", "zo_sfl", "mu_splitfed")
SGD = ["clients.optim.name=sgd", "server.optim.name=sgd", "clients.optim.weight_decay=0", "server.optim.weight_decay=0"]


@pytest.fixture
def small(tmp_path):
    """Synthetic 4-class images, small CNN cut after block 1: z is (4, 4, 4) per sample."""
    return [
        "data.name=synthetic",
        "model.name=small_cnn",
        "model.width=4",
        "split.cut=1",
        "clients.batch_size=8",
        "clients.optim.lr=1e-2",
        "server.optim.lr=1e-2",
        "train.eval_batch_size=500",
        "job.progress=false",
        f"job.out_dir={tmp_path / 'run'}",
    ]


run = run_in_process


def one_step(small, alg, clients=1, extra=()):
    """Overrides for one round in which each of ``clients`` clients takes exactly one step of B = 8 samples."""
    return (
        small
        + SGD
        + [
            f"algorithm.name={alg}",
            f"clients.total={clients}",
            f"clients.per_round={clients}",
            f"data.train_max_samples={8 * clients}",
            f"train.budget_samples={8 * clients}",
            "train.eval_every_samples=1000",
            "clients.optim.lr=0.1",
            "server.optim.lr=0.1",
            *extra,
        ]
    )


def fresh(cfg) -> tuple[SplitModel, FederatedData]:
    """θ^0 and the data streams exactly as the engine built them (everything derives from job.seed)."""
    data = build_data(data_sections(cfg))
    return build_split_model(cfg, data.info, get_algorithm(cfg.algorithm.name).zeroth_order_client), data


def trainable(module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in slot_tensors(trainable_slots(module))]


def loss_at(split: SplitModel, client_params, server_params, x, y) -> torch.Tensor:
    """ℓ(f_s(f_c(x; θc); θs), y) of the unsplit model at the given tensors."""
    with (
        bound(trainable_slots(split.client), client_params),
        bound(trainable_slots(split.server), server_params),
    ):
        return split.task.loss(split.server(split.client(x)), y)


def runtime_theta(engine):
    return [p.detach() for p in engine.server.client_model], trainable(engine.server.model)


def z_bytes(cfg) -> int:
    return 4 * cfg.model.width * 4 * 4 * cfg.clients.batch_size  # one batch of z, float32


def model_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in slot_tensors(trainable_slots(module)))


# -- SFL -------------------------------------------------------------------------------------------------------------
def test_sfl_clients_backprop_and_fedavg_parallel_server_copies(small):
    """SFLv1: each client back-propagates λ through f_c; each has its own θs_m copy stepped from θs^t (parallel,
    not sequential); after the round θc and θs are the FedAvg of the per-client results."""
    cfg, engine, summary, _ = run(one_step(small, "sfl", clients=2))
    split, data = fresh(cfg)
    c0, s0 = trainable(split.client), trainable(split.server)
    per_client = []
    for m in (0, 1):
        x, y = data.next_batch(m)
        c = [p.clone().requires_grad_(True) for p in c0]
        s = [p.clone().requires_grad_(True) for p in s0]
        grads = torch.autograd.grad(loss_at(split, c, s, x, y), c + s)  # full backprop of the unsplit model
        new = [p - 0.1 * g for p, g in zip(c + s, grads)]
        per_client.append((new[: len(c)], new[len(c) :]))
    want_c = aggregate(c0, [pc[0] for pc in per_client], [1.0, 1.0])
    want_s = aggregate(s0, [pc[1] for pc in per_client], [1.0, 1.0])
    got_c, got_s = runtime_theta(engine)
    torch.testing.assert_close(got_c, want_c)
    torch.testing.assert_close(got_s, want_s)
    b = summary["comm"]["bytes"]
    assert b["uplink_model"] == b["downlink_model"] == 2 * model_bytes(split.client)  # weights up and down
    assert b["downlink_gradients"] == 2 * z_bytes(cfg)  # λ for every step
    assert b["uplink_activations"] == 2 * (z_bytes(cfg) + 8 * 8)  # z and int64 labels
    assert b["uplink_scalars"] == b["downlink_scalars_seeds"] == 0


def test_splitlora_refuses_a_model_without_lora(small):
    with pytest.raises(ConfigError, match="needs LoRA adapters on both sides"):
        InProcessRunner(
            load_config(None, small + ["algorithm.name=splitlora", "clients.total=2", "clients.per_round=2"])
        ).setup()


def test_splitlora_exchanges_only_the_lora_adapters(tmp_path):
    """SplitLoRA on a tiny random Llama (model.name=hf) with LoRA on both sides: only the adapters train and travel,
    the base weights never move."""
    if not (shared_data_dir() / "sentiment_multiemo").is_dir():
        pytest.skip("the offline sentiment data (shared/data/sentiment_multiemo) is not beside the checkout")
    overrides = [
        "algorithm.name=splitlora",
        "model.name=hf",
        "model.source=tiny:llama",
        "split.cut=1",
        "lora.r=2",
        "data.name=sentiment_multiemo",
        "data.max_length=16",
        "data.train_max_samples=64",
        "data.eval_max_samples=16",
        "clients.total=4",
        "clients.per_round=2",
        "clients.batch_size=8",
        "clients.optim.lr=1e-2",
        "server.optim.lr=1e-2",
        "train.budget_samples=64",
        "train.eval_every_samples=1000",
        "train.eval_batch_size=16",
        "job.progress=false",
        f"job.out_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(None, overrides)
    engine = InProcessRunner(cfg).setup()
    client = engine.split.client
    lora = {n: p.detach().clone() for n, p in client.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in client.named_parameters() if not p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    summary = engine.run()
    b = summary["comm"]["bytes"]
    lora_bytes = sum(p.numel() * p.element_size() for p in lora.values())
    assert b["uplink_model"] == b["downlink_model"] == 2 * 2 * lora_bytes  # 2 rounds x 2 clients, adapters only
    assert b["downlink_gradients"] > 0
    final = engine.worker.final_params
    assert any(not torch.equal(a, f) for a, f in zip(lora.values(), final))  # the adapters trained
    for n, p in client.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the base model never moved


# -- ZO-SFL ----------------------------------------------------------------------------------------------------------
def test_zo_sfl_step_is_two_point_spsa_and_no_gradient_comes_down(small):
    """g = [ℓ(θ + μz) − ℓ(θ − μz)] / 2μ on the whole model, θc −= lr·g·u, θs −= lr·g·v; two z's up, one float down."""
    mu = 1e-2
    cfg, engine, summary, _ = run(one_step(small, "zo_sfl", extra=[f"zo.mu={mu}"]))
    split, data = fresh(cfg)
    c0, s0 = trainable(split.client), trainable(split.server)
    x, y = data.next_batch(0)
    seed = step_seed(cfg.job.seed, 0, 0, 0)
    u = [noise_like(p, seed, i) for i, p in enumerate(c0)]
    v = [noise_like(p, server_seed(seed), i) for i, p in enumerate(s0)]
    with torch.no_grad():
        lp = loss_at(split, [p + mu * n for p, n in zip(c0, u)], [p + mu * n for p, n in zip(s0, v)], x, y).item()
        lm = loss_at(split, [p - mu * n for p, n in zip(c0, u)], [p - mu * n for p, n in zip(s0, v)], x, y).item()
    g = (lp - lm) / (2 * mu)
    got_c, got_s = runtime_theta(engine)
    torch.testing.assert_close(got_c, [p - 0.1 * g * n for p, n in zip(c0, u)])
    torch.testing.assert_close(got_s, [p - 0.1 * g * n for p, n in zip(s0, v)])
    b = summary["comm"]["bytes"]
    assert b["uplink_activations"] == 2 * z_bytes(cfg) + 8 * 8  # z₊ and z₋, labels once
    assert b["downlink_gradients"] == 0
    assert b["downlink_scalars_seeds"] == 4  # the float32 g, seeds are never sent
    assert b["uplink_model"] == b["downlink_model"] == model_bytes(split.client)


# -- MU-SplitFed -----------------------------------------------------------------------------------------------------
def test_mu_splitfed_round_by_hand(small):
    """τ = 2 server ZO steps on the unperturbed z, then δ on z± with the updated θs, θc −= η_c δ u, and the global
    step θ^{t+1} = θ^t + η_g (θ_m − θ^t) on both sides."""
    mu, lr_c, lr_s, eta_g = 1e-2, 0.05, 0.1, 0.3
    extra = [f"zo.mu={mu}", f"clients.optim.lr={lr_c}", f"server.optim.lr={lr_s}", f"algorithm.global_lr={eta_g}"]
    cfg, engine, summary, _ = run(one_step(small, "mu_splitfed", extra=["algorithm.server_steps=2", *extra]))
    split, data = fresh(cfg)
    c0, s0 = trainable(split.client), trainable(split.server)
    x, y = data.next_batch(0)
    seed = step_seed(cfg.job.seed, 0, 0, 0)
    u = [noise_like(p, seed, i) for i, p in enumerate(c0)]
    s = [p.clone() for p in s0]
    with torch.no_grad():
        for k in range(2):
            vk = [noise_like(p, server_seed(seed, k), i) for i, p in enumerate(s)]
            lp = loss_at(split, c0, [p + mu * n for p, n in zip(s, vk)], x, y).item()
            lm = loss_at(split, c0, [p - mu * n for p, n in zip(s, vk)], x, y).item()
            s = [p - lr_s * (lp - lm) / (2 * mu) * n for p, n in zip(s, vk)]
        delta = (
            loss_at(split, [p + mu * n for p, n in zip(c0, u)], s, x, y).item()
            - loss_at(split, [p - mu * n for p, n in zip(c0, u)], s, x, y).item()
        ) / (2 * mu)
    c = [p - lr_c * delta * n for p, n in zip(c0, u)]
    got_c, got_s = runtime_theta(engine)
    torch.testing.assert_close(got_c, [a + eta_g * (b - a) for a, b in zip(c0, c)])
    torch.testing.assert_close(got_s, [a + eta_g * (b - a) for a, b in zip(s0, s)])
    b = summary["comm"]["bytes"]
    assert b["uplink_activations"] == 3 * z_bytes(cfg) + 8 * 8  # z, z₊, z₋
    assert b["downlink_gradients"] == 0 and b["downlink_scalars_seeds"] == 4


@pytest.mark.parametrize("tau", [1, 3])
def test_mu_splitfed_steps_the_server_tau_times_per_client_step(small, monkeypatch, tau):
    calls = {"client": 0, "server": 0}
    real = ZOEstimator.step

    def spy(self, opt, params, seeds, coeffs, cache=None):
        calls["client" if len(params) == 2 else "server"] += 1  # small_cnn cut=1: 2 client tensors, 4 server
        return real(self, opt, params, seeds, coeffs, cache)

    monkeypatch.setattr(ZOEstimator, "step", spy)
    overrides = small + [
        "algorithm.name=mu_splitfed",
        f"algorithm.server_steps={tau}",
        "clients.total=4",
        "clients.per_round=2",
        "train.budget_samples=80",
        "train.eval_every_samples=1000",
    ]
    _, _, summary, _ = run(overrides)
    steps = summary["rounds"] * 2
    assert summary["rounds"] == 5  # one step per client per round: 80 / (2 clients · 8)
    assert calls == {"client": steps, "server": tau * steps}
    b = summary["comm"]["bytes"]
    split, _ = fresh(load_config(None, overrides))
    assert b["uplink_model"] == b["downlink_model"] == steps * model_bytes(split.client)  # full model every step


# -- FSL-SAGE --------------------------------------------------------------------------------------------------------
class RecordingTransport(InProcessTransport):
    """Records (method, result) of every client->server call."""

    def __init__(self, server):
        super().__init__(ServerEndpoint(server))
        self.log: list[tuple[str, object]] = []

    def call_async(self, method, **kwargs):
        fut = super().call_async(method, **kwargs)
        self.log.append((method, fut.value() if fut.done() else "pending"))
        return fut


def test_fsl_sage_client_step_uses_the_auxiliary_gradient(small):
    """θc −= lr·∂ℓ(a(f_c(x)))/∂θc with the auxiliary model a; θs is updated with the smashed batch at round end."""
    cfg, engine, summary, _ = run(one_step(small, "fsl_sage"))
    split, data = fresh(cfg)
    aux = build_aux(split, cfg.job.seed)
    c0, s0 = trainable(split.client), trainable(split.server)
    x, y = data.next_batch(0)
    c = [p.clone().requires_grad_(True) for p in c0]
    with bound(trainable_slots(split.client), c):
        grads = torch.autograd.grad(split.task.loss(aux(split.client(x)), y), c)
        z = split.client(x).detach()
    s = [p.clone().requires_grad_(True) for p in s0]
    with bound(trainable_slots(split.server), s):
        gs = torch.autograd.grad(split.task.loss(split.server(z), y), s)
    got_c, got_s = runtime_theta(engine)
    torch.testing.assert_close(got_c, [p - 0.1 * g for p, g in zip(c0, grads)])
    torch.testing.assert_close(got_s, [p - 0.1 * g for p, g in zip(s0, gs)])
    assert summary["comm"]["bytes"]["downlink_gradients"] == 0


def test_fsl_sage_clients_do_not_wait_and_get_aligned_auxiliary_models(small):
    """During local training a client only sends: smashed data every l-th step, answered with nothing; θs does not
    move until the round's uploads are in. The next round brings an aligned auxiliary model down."""
    cfg = load_config(
        None,
        small
        + [
            "algorithm.name=fsl_sage",
            "algorithm.server_update_interval=2",
            "clients.total=2",
            "clients.per_round=2",
            "data.train_max_samples=80",  # 40 per client: 5 steps per round
        ],
    )
    split, data = fresh(cfg)
    server = server_of(cfg, split, FSLSageServer)
    recording = RecordingTransport(server)
    transport = MeteredTransport(recording, FSLSageServer, CommMeter())
    collective = LocalCollective(transport.meter)
    worker = get_algorithm("fsl_sage").worker(method_config(cfg), split, data, range(2), transport, collective)
    theta_s0 = tensors_digest(server.model.parameters())
    real_upload = server.upload
    seen_at_upload = []

    def upload(**kw):
        seen_at_upload.append(tensors_digest(server.model.parameters()))
        return real_upload(**kw)

    server.upload = upload
    assert worker.run_round(0) == 2 * 5 * 8
    calls = [m for m, _ in recording.log]
    per_client = ["download", "submit", "submit", "submit", "upload"]  # steps 0, 2, 4 of 5
    assert calls == per_client * 2
    assert all(r is None for m, r in recording.log if m == "submit")  # nothing comes back: no λ to wait for
    assert seen_at_upload == [theta_s0]  # the K uploads are gathered into one call; θs moved only after it
    assert tensors_digest(server.model.parameters()) != theta_s0
    assert transport.meter.bytes["uplink_activations"] == 2 * 3 * (z_bytes(cfg) + 8 * 8)

    # round 1: each client's download carries its auxiliary model, aligned on its 24 smashed samples
    aux_bytes = model_bytes(server.aux)
    before = transport.meter.bytes["downlink_model"]
    z, y = server.align_sets[0]
    assert len(y) == 24
    target = server.true_gradients(z, y)

    def mismatch(params):
        with bound(server.aux_slots, params):
            zz = z.detach().requires_grad_(True)
            pred = torch.autograd.grad(server.task.loss(server.aux(zz), y) * len(y), zz)[0]
            return (pred - target).pow(2).sum().item()

    err0 = mismatch(server.aux_init)
    worker.run_round(1)
    assert transport.meter.bytes["downlink_model"] - before == 2 * (model_bytes(split.client) + aux_bytes)
    assert mismatch(server.aux_models[0][0]) < err0  # gradient matching brought a_0 closer to the server
    for p, q in zip(worker.aux_params[0], server.aux_models[0][0]):
        torch.testing.assert_close(p, q.detach())  # the client holds the aligned model


# -- all methods -----------------------------------------------------------------------------------------------------
TABLE5_PATTERN = {  # categories that carry training traffic (paper Table 5)
    "hosfl": {"uplink_activations", "uplink_scalars", "downlink_gradients", "downlink_scalars_seeds"},
    "sfl": {"uplink_activations", "uplink_model", "downlink_gradients", "downlink_model"},
    "fsl_sage": {"uplink_activations", "uplink_model", "downlink_model"},
    "zo_sfl": {"uplink_activations", "uplink_model", "downlink_model", "downlink_scalars_seeds"},
    "mu_splitfed": {"uplink_activations", "uplink_model", "downlink_model", "downlink_scalars_seeds"},
}


@pytest.mark.parametrize("alg", sorted(TABLE5_PATTERN))
def test_every_method_runs_to_the_budget_with_the_papers_traffic_pattern(small, alg):
    overrides = small + [
        f"algorithm.name={alg}",
        "clients.total=6",
        "clients.per_round=3",
        "data.train_max_samples=480",  # 80 per client: 10 steps per local epoch
        "train.budget_samples=600",  # not a multiple of a 240-sample round: the last round is shortened
        "train.eval_every_samples=240",
        "zo.num_perturbations=2",
    ]
    cfg, _, summary, rows = run(overrides)
    assert summary["status"] == "completed" and summary["algorithm"] == alg
    assert 600 <= summary["processed_samples"] < 600 + 3 * 8  # at most one batch per client past the budget
    assert rows[-1]["processed_samples"] == summary["processed_samples"]
    assert {"round", "processed_samples", "eval_accuracy", "eval_loss", "train_loss", "comm"} <= set(rows[-1])
    assert rows[-1]["train_loss"] is not None and math.isfinite(rows[-1]["train_loss"])
    b = summary["comm"]["bytes"]
    assert {c for c in PAPER_CATEGORIES if b[c] > 0} == TABLE5_PATTERN[alg]
    assert b["eval"] > 0


class ThreadCollective:
    """Sums among worker threads (stands in for the client workers' process group)."""

    def __init__(self, size: int, meter: CommMeter) -> None:
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)
        self.meter = meter

    def member(self, rank: int):
        outer = self

        class Member:
            is_leader = rank == 0

            def coordinate(self, t):
                outer.slots[rank] = t
                outer.barrier.wait()
                total = sum(outer.slots)
                outer.barrier.wait()  # nobody overwrites a slot before everyone has read them all
                return total

            def aggregate(self, exchange, rows, mine, fn):
                return count_exchange(outer.meter, exchange, rows, mine, fn(self.coordinate(rows)))

        return Member()


def run_rounds(cfg, hosted_sets, rounds):
    """Rounds with one server and one worker thread per hosted set; each worker has its own model and data."""
    spec = get_algorithm(cfg.algorithm.name)
    server = server_of(cfg, fresh(cfg)[0], spec.server)
    endpoint = ServerEndpoint(server)
    meter = CommMeter()
    group = ThreadCollective(len(hosted_sets), meter)
    workers = []
    for rank, hosted in enumerate(hosted_sets):
        split, data = fresh(cfg)
        transport = MeteredTransport(InProcessTransport(endpoint), spec.server, meter)
        workers.append(spec.worker(method_config(cfg), split, data, hosted, transport, group.member(rank)))
    errors, counts = [], {}

    def loop(rank, w):
        try:
            counts[rank] = [w.run_round(t) for t in range(rounds)]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=loop, args=(r, w)) for r, w in enumerate(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if errors:
        raise errors[0]
    assert len({tuple(c) for c in counts.values()}) == 1  # every worker returns the same processed samples
    training = {c: v for c, v in meter.snapshot().items() if c in PAPER_CATEGORIES}
    return tensors_digest([*server.client_model, *server.model.parameters()]), training


@pytest.mark.parametrize("alg", BASELINES)
def test_two_workers_hosting_half_the_clients_match_one_worker(small, alg):
    cfg = load_config(
        None,
        small
        + [
            f"algorithm.name={alg}",
            "clients.total=6",
            "clients.per_round=4",
            "data.train_max_samples=240",
            "data.partition=dirichlet",  # unequal shards: per-client steps and FedAvg weights differ
            "algorithm.server_update_interval=2",
        ],
    )
    one = run_rounds(cfg, [range(6)], rounds=3)
    two = run_rounds(cfg, [[0, 2, 4], [1, 3, 5]], rounds=3)
    assert one == two
