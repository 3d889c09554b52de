"""Scale: role-aware construction (meta device, per-role materialisation, shards), the data-parallel server step
(shares, micro-batches, activation checkpointing) and the memory report, at CI size on tiny models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.compute import Upload
from hosfl_dist.config import load_config
from hosfl_dist.data import data_info
from hosfl_dist.errors import ProtocolError
from hosfl_dist.models import build_split_model
from hosfl_dist.models.materialize import RandomWeights, param_bytes
from hosfl_dist.runtime.fsdp import shard_server_model
from hosfl_dist.runtime.build import data_sections, server_side
from hosfl_dist.runtime.server_compute import make_shares, plan
from hosfl_dist.runtime.server_group import ServerGroup

sys.path.insert(0, str(Path(__file__).parent))
from tiny import lm_overrides, read_run, run_one_thread, torchrun, write_text_files  # noqa: E402


# -- plan: how a round's rows are spread over ranks and micro-batches ------------------------------------------------
def _uploads(shapes: dict[int, tuple[int, int]]) -> dict[int, Upload]:
    """client -> (rows, tokens per row) of an LM upload."""
    return {
        m: Upload({"z": torch.zeros(n, t, 4), "attention_mask": torch.ones(n, t, dtype=torch.long)}, torch.zeros(n))
        for m, (n, t) in shapes.items()
    }


def _covered(shares: list) -> list[tuple[int, int]]:
    rows = []
    for pieces, padding in shares:
        for piece, pad in zip(pieces, padding):
            if not pad:
                rows += [(m, r) for m, a, b in piece for r in range(a, b)]
    return rows


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("micro", [0, 24, 40])
def test_plan_covers_every_row_once_in_order_with_equal_pass_counts(ranks, micro):
    ups = _uploads({1: (4, 8), 3: (4, 8), 5: (2, 12)})
    shares = plan(ups, ranks, micro)
    assert _covered(shares) == [(m, r) for m in (1, 3, 5) for r in range(ups[m].rows)]  # each row once, in order
    assert len({len(p) for p, _ in shares}) == 1  # FSDP: the same number of passes on every rank
    for pieces, padding in shares:
        for piece, pad in zip(pieces, padding):
            tokens = sum((b - a) * ups[m].tokens_per_row for m, a, b in piece)
            assert not micro or tokens <= max(micro, 12) or pad
            assert len({ups[m].shape_key for m, _, _ in piece}) == 1  # shapes are never mixed
            assert len({m for m, _, _ in piece}) == 1  # uploads of several shapes: one client per pass


def test_plan_shares_end_at_client_boundaries_when_there_are_enough_clients():
    shares = plan(_uploads({0: (4, 8), 1: (4, 8), 2: (4, 8), 3: (4, 8)}), 2, 0)
    segments = [[seg for piece in p for seg in piece] for p, _ in shares]
    assert segments == [[(0, 0, 4), (1, 0, 4)], [(2, 0, 4), (3, 0, 4)]]
    one = plan(_uploads({7: (4, 8)}), 2, 0)  # fewer clients than ranks: rows are split
    assert [p for p, _ in one] == [[[(7, 0, 2)]], [[(7, 2, 4)]]]


def test_shares_carry_only_their_rows():
    ups = _uploads({7: (4, 8)})
    ups[7].act["z"] = torch.arange(4.0).view(4, 1, 1).expand(4, 8, 4).clone()
    a, b = make_shares(ups, {7: 4.0}, 2, 0)
    assert a.uploads[7].rows == 2 and b.uploads[7].rows == 2 and b.offsets == {7: 2}
    assert torch.equal(b.uploads[7].act["z"][:, 0, 0], torch.tensor([2.0, 3.0]))


# -- one server step: micro-batches and activation checkpointing change memory, not the step -----------------------
def _server_and_batch(tmp_path: Path, extra: list[str], arch: str = "qwen3"):
    cfg = load_config(None, [*lm_overrides(tmp_path, tmp_path, arch=arch), *extra])
    split = build_split_model(cfg, data_info(data_sections(cfg)), True)
    server, _ = server_side(cfg, get_algorithm("hosfl"), split)
    gen = torch.Generator().manual_seed(0)
    batch = {}
    for i, m in enumerate(server.round_plan.sampled(0)):
        t = 6 + 2 * i  # different lengths: one pass per client, as trimmed text batches are
        z = torch.randn(4, t, 64, generator=gen)
        mask = torch.ones(4, t, dtype=torch.long)
        mask[0, -2:] = 0
        batch[m] = {"act": {"z": z, "attention_mask": mask}, "labels": torch.tensor([0, 1, 1, 0])}
    return server, batch


def _step(tmp_path: Path, extra: list[str]) -> tuple[dict, list[torch.Tensor]]:
    server, batch = _server_and_batch(tmp_path, extra)
    lams = server.submit(t=0, batch=batch)
    return lams, [p.detach().clone() for p in server.model.parameters()]


def test_micro_batched_step_equals_the_unbatched_step(tmp_path):
    lams, params = _step(tmp_path, [])
    lams_mb, params_mb = _step(tmp_path, ["server.micro_batch_tokens=12"])  # 1-2 rows per pass
    for m in lams:
        torch.testing.assert_close(lams_mb[m]["lam"], lams[m]["lam"], rtol=1e-5, atol=1e-7)
    changed = [not torch.equal(a, b) for a, b in zip(params, _step(tmp_path, ["server.optim.lr=1e-9"])[1])]
    assert any(changed)  # the comparison below compares stepped parameters
    for a, b in zip(params, params_mb):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_gives_the_same_step(tmp_path):
    lams, params = _step(tmp_path, [])
    lams_ac, params_ac = _step(tmp_path, ["server.activation_checkpointing=true"])
    for m in lams:
        assert torch.equal(lams_ac[m]["lam"], lams[m]["lam"])
    assert all(torch.equal(a, b) for a, b in zip(params, params_ac))


# -- the data-parallel step on a real 2-rank gloo group equals the single-rank step -------------------------------
def _dp_rank(rank: int, store_path: str, tmp: str, out: str, reshard: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        tmp_path = Path(tmp)
        cfg = load_config(None, lm_overrides(tmp_path, tmp_path, arch="qwen3"))
        shard = lambda mod: shard_server_model(mod, group, torch.device("cpu"), reshard)  # noqa: E731
        split = build_split_model(cfg, data_info(data_sections(cfg)), True, parts=("server",), shard=shard)
        server, evaluator = server_side(cfg, get_algorithm("hosfl"), split, group)
        step = ServerGroup(server, evaluator, group=group)
        _, batch = _server_and_batch(tmp_path, [])
        refused = []
        if rank == 0:  # rank 0 announces the call with its rows; each rank runs its share of them
            for call in ({"t": 1, "batch": batch}, {"t": 0, "batch": batch, "nope": 1}):  # a round from the future:
                try:  # refused on both ranks, which stay in step; arguments that do not fit: refused before the
                    step.execute("submit", call)  # announcement
                except (ProtocolError, TypeError) as exc:
                    refused.append(type(exc).__name__)
            lams = step.execute("submit", {"t": 0, "batch": batch})
            m = next(iter(batch))  # an evaluation: a forward with no backward, after which f_s must be sharded again
            step.execute("eval_batch", {"act": batch[m]["act"], "labels": batch[m]["labels"]})
            step.stop()
        else:
            step.follow()
        sharded = all(isinstance(p, DTensor) for p in server.model.parameters())
        if not sharded:  # (for the comparison below, where the evaluation left f_s gathered)
            for module in server.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        full = [p.full_tensor() for p in server.model.parameters()]
        mine = param_bytes(server.model)
        if rank == 0:
            torch.save({"lams": lams, "params": full, "param_bytes": mine, "sharded": sharded, "refused": refused}, out)
        else:
            torch.save({"sharded": sharded}, f"{out}.rank1")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "reshard", [pytest.param(True, marks=pytest.mark.slow), False], ids=["reshard_after_forward", "kept_gathered"]
)  # 9 s each: one in the default tier
def test_data_parallel_step_over_two_ranks_equals_one_rank(tmp_path, reshard):
    """Two server ranks, each with half the clients' rows and an FSDP2 shard of θs: λ_m and the stepped θs equal the
    one-rank server's bit for bit (whole clients per rank, each client's rows in one pass; FSDP averages the two
    shares exactly and the server doubles the average), whether each block's gathered weights are freed after its
    forward or kept for its backward (server.reshard_after_forward). After an evaluation (a forward with no
    backward) every rank holds its shard only, whichever the setting. A call refused on rank 0 (a round from the
    future; arguments that do not fit the method) leaves the group in step."""
    out = tmp_path / "dp.pt"
    mp.spawn(_dp_rank, args=(str(tmp_path / "store"), str(tmp_path), str(out), reshard), nprocs=2, join=True)
    got = torch.load(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lams, params = _step(tmp_path, [])
    finally:
        torch.set_num_threads(threads)
    for m in lams:
        assert torch.equal(got["lams"][m]["lam"], lams[m]["lam"])
    assert all(torch.equal(a, b) for a, b in zip(got["params"], params))
    full = sum(p.numel() * p.element_size() for p in params)
    assert abs(got["param_bytes"] - full / 2) < 0.02 * full  # rank 0 holds about half of f_s
    assert got["sharded"] and torch.load(f"{out}.rank1")["sharded"]
    assert got["refused"] == ["ProtocolError", "TypeError"]


# -- construction ----------------------------------------------------------------------------------------------------
def test_random_weights_do_not_depend_on_the_rows_asked_for():
    w = RandomWeights(seed=3, std=0.02)
    lin = torch.nn.Linear(8, 300_000)  # several random chunks
    whole = w.rows("x.weight", lin, "weight", torch.Size([300_000, 8]), 0, 300_000)
    part = w.rows("x.weight", lin, "weight", torch.Size([300_000, 8]), 131_000, 170_001)
    assert torch.equal(part, whole[131_000:170_001])
    assert 0.019 < float(whole.std()) < 0.021
    other = RandomWeights(seed=4, std=0.02).rows("x.weight", lin, "weight", torch.Size([300_000, 8]), 0, 10)
    assert not torch.equal(other, whole[:10])


def test_each_role_materialises_only_its_part(tmp_path):
    cfg = load_config(None, [*lm_overrides(tmp_path, tmp_path), "model.source=arch:qwen3-0.6b", "split.cut=5"])
    full_client = build_split_model(cfg, data_info(data_sections(cfg)), True, parts=())  # nothing but the LoRA tensors
    meta = [p for p in full_client.client.parameters() if p.is_meta]
    assert meta and all(not p.requires_grad for p in meta)  # frozen weights stay on the meta device
    assert param_bytes(full_client.client) == sum(
        p.numel() * 4 for p in full_client.client.parameters() if p.requires_grad
    )


def test_arch_source_builds_the_same_client_in_any_process(tmp_path):
    ovr = [*lm_overrides(tmp_path, tmp_path), "model.source=arch:opt-125m"]
    cfg = load_config(None, ovr)
    info = data_info(data_sections(cfg))
    a = build_split_model(cfg, info, True, parts=("client",))
    b = build_split_model(cfg, info, True, parts=("client",))
    c = build_split_model(load_config(None, [*ovr, "job.seed=1"]), info, True, parts=("client",))
    pa, pb, pc = (list(x.client.parameters()) for x in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))  # θ^0 follows job.seed
    assert all(not p.is_meta for p in pa) and all(p.is_meta for p in a.server.parameters() if not p.requires_grad)


def test_safetensors_directory_loads_by_slices_and_equals_the_checkpoint(tmp_path):
    from hosfl_dist.models.hf_load import tiny_causal_lm
    from hosfl_dist.models.sources import tiny_tokenizer

    model = tiny_causal_lm("llama", vocab_size=len(tiny_tokenizer()), seed=5)
    model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")
    ovr = [*lm_overrides(tmp_path, tmp_path), f"model.source={tmp_path / 'ckpt'}"]
    cfg = load_config(None, ovr)
    split = build_split_model(cfg, data_info(data_sections(cfg)), False)
    emb = split.client.embed_tokens.weight
    assert torch.equal(emb, model.model.embed_tokens.weight)
    assert torch.equal(split.server.server.lm_head.weight, model.lm_head.weight)  # tied: the embedding's values


# -- the memory report -------------------------------------------------------------------------------------------------
def test_in_process_summary_reports_the_whole_model_as_one_rank(tmp_path):
    files = write_text_files(tmp_path)
    ovr = lm_overrides(tmp_path / "run", files, arch="qwen3")
    _, summary = run_one_thread(ovr)
    cfg = load_config(None, ovr)
    whole = build_split_model(cfg, data_info(data_sections(cfg)), True)
    (entry,) = summary["memory"]
    assert entry["rank"] == 0 and entry["role"] == "in-process" and entry["peak_rss_bytes"] > 0
    assert entry["param_bytes"] == param_bytes(whole.client) + param_bytes(whole.server)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_server_group_of_two_reports_memory_per_rank_and_matches_in_process(tmp_path):
    files = write_text_files(tmp_path)
    ref_rows, ref = run_one_thread(lm_overrides(tmp_path / "ref", files, arch="qwen3"))
    ovr = [*lm_overrides(tmp_path / "run", files, arch="qwen3"), "server.ranks=2"]
    rc, out, _ = torchrun(4, ["-m", "hosfl_dist.run", *ovr])
    assert rc == 0, out[-3000:]
    rows, summary = read_run(tmp_path / "run")
    assert set(summary["client_digests"].values()) == set(ref["client_digests"].values())
    for a, b in zip(rows, ref_rows, strict=True):  # whole-client shares: training exact, evaluation to float rounding
        assert a["comm"] == b["comm"] and a["train_loss"] == b["train_loss"]
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    mem = {m["rank"]: m for m in summary["memory"]}
    assert [mem[r]["role"] for r in range(4)] == ["server", "server-shard", "worker", "worker"]
    cfg = load_config(None, lm_overrides(tmp_path, files, arch="qwen3"))
    whole = build_split_model(cfg, data_info(data_sections(cfg)), True)
    client, server = param_bytes(whole.client), param_bytes(whole.server)
    assert mem[2]["param_bytes"] == mem[3]["param_bytes"] == client  # a worker holds f_c, nothing of f_s
    assert abs(mem[0]["param_bytes"] - server / 2) < 0.05 * server  # each server rank about f_s / 2
    assert abs(mem[0]["param_bytes"] + mem[1]["param_bytes"] - server) < 0.01 * server
    assert all(m["peak_rss_bytes"] > 0 for m in mem.values())


# -- data per role ----------------------------------------------------------------------------------------------------
def test_the_server_builds_its_model_without_reading_any_data(tmp_path):
    cfg = load_config(None, lm_overrides(tmp_path, tmp_path / "no-such-folder"))  # the data files do not exist
    info = data_info(data_sections(cfg))
    assert info["kind"] == "classification" and len(info["label_word_ids"]) == 2


def test_a_worker_tokenises_only_its_clients_shards_and_gets_the_same_batches(tmp_path):
    from hosfl_dist.data import build_data
    from hosfl_dist.runtime.build import data_sections

    cfg = load_config(None, lm_overrides(tmp_path, write_text_files(tmp_path)))
    whole = build_data(data_sections(cfg))
    mine = build_data(data_sections(cfg), clients=[1, 3], evaluation=False)
    assert len(mine.train_text) == len(whole.shards[1]) + len(whole.shards[3]) < len(whole.train_text)
    assert len(mine.eval_labels) == 0 < len(whole.eval_labels)
    for _ in range(3):
        for m in (1, 3):
            (x, y), (x2, y2) = whole.next_batch(m), mine.next_batch(m)
            assert torch.equal(y, y2) and all(torch.equal(x[k], x2[k]) for k in x)
