"""SQuAD at scale: the LM loss from logits at the labelled positions only, greedy decoding with KV caches on both
sides of the split (token for token the no-cache path's), and data.eval_max_samples on every text task."""

from __future__ import annotations

import pytest
import torch

from hosfl_dist.algorithms.base import ServerBase, WorkerBase
from hosfl_dist.config import load_config
from hosfl_dist.data import build_data
from hosfl_dist.errors import ProtocolError
from hosfl_dist.evaluation.client import Evaluator
from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.models import SplitModel, server_forward
from hosfl_dist.models.hf_load import tiny_causal_lm
from hosfl_dist.models.hf_split import split_causal_lm
from hosfl_dist.models.sources import tiny_tokenizer
from hosfl_dist.runtime.build import data_sections, method_config
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.tasks.generation import IGNORE_INDEX, GenerationTask, lm_loss
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport
from tiny import lm_overrides, server_of, write_text_files

ARCHS = ("llama", "qwen3", "gemma3", "opt")


def prompts(side: str, pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts of 10, 6 and 3 tokens padded to T=10 on ``side`` (longer than Gemma-3's window of 4)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 10), generator=gen)  # (B, T)
    mask = torch.ones(3, 10, dtype=torch.long)
    for row, n in enumerate((10, 6, 3)):
        pad = slice(n, None) if side == "right" else slice(0, 10 - n)
        mask[row, pad], ids[row, pad] = 0, pad_id
    return {"input_ids": ids, "attention_mask": mask}


def rows_seen(module: torch.nn.Module) -> list[int]:
    """Rows of every input of ``module`` from now on (its forward hook)."""
    seen: list[int] = []
    module.register_forward_hook(lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    return seen


# ------------------------------------------------------------------------------------- logits only where labels are


@pytest.mark.parametrize("arch", ARCHS)
def test_selected_logits_give_the_full_logits_loss_and_lambda(arch):
    model = tiny_causal_lm(arch)
    client, server = split_causal_lm(model, 2)
    task = GenerationTask(tiny_tokenizer(), "right", max_positions=None)
    x = prompts("right", model.config.pad_token_id or 0)
    labels = torch.full((3, 10), IGNORE_INDEX)
    labels[0, 6:10] = x["input_ids"][0, 6:10]  # a 4-token answer at the end of row 0
    labels[1, 3:6] = x["input_ids"][1, 3:6]  # and 3 tokens before row 1's padding; row 2 has none
    with torch.no_grad():
        act = client(**x)
    z_full = act["z"].clone().requires_grad_(True)
    z_sel = act["z"].clone().requires_grad_(True)

    full = server({**act, "z": z_full})  # (B, T, V)
    loss_full = task.loss(full, labels)
    (lam_full,) = torch.autograd.grad(loss_full, z_full)  # λ = ∂ℓ/∂z

    head_rows = rows_seen(server.lm_head)
    out = server_forward(server, {**act, "z": z_sel, **task.server_inputs(labels)})
    sums, counts = task.sample_losses(out, labels)
    loss_sel = sums.sum() / counts.sum()
    (lam_sel,) = torch.autograd.grad(loss_sel, z_sel)

    assert head_rows == [7] and out.shape == (7, full.shape[-1])  # the head saw the 7 predicting positions only
    assert counts.tolist() == [4.0, 3.0, 0.0] and sums.dtype == torch.float32 and sums[2] == 0
    # Same states, the head on 7 rows instead of 30: equal up to the matmul's float32 rounding.
    torch.testing.assert_close(loss_sel, loss_full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lam_sel, lam_full, rtol=1e-5, atol=1e-8)
    for row in range(2):  # each sample's sum is its own LM loss times its token count
        torch.testing.assert_close(sums[row], lm_loss(full[row : row + 1], labels[row : row + 1]) * counts[row])
    # The loss of full logits is the same contract: sums.sum() / counts.sum() of its own sample losses.
    full_sums, full_counts = task.sample_losses(full, labels)
    assert loss_full.item() == (full_sums.sum() / full_counts.sum()).item()


def test_a_batch_without_labelled_tokens_has_zero_loss_and_a_graph():
    model = tiny_causal_lm("qwen3")
    client, server = split_causal_lm(model, 2)
    task = GenerationTask(tiny_tokenizer(), "right", max_positions=None)
    labels = torch.full((3, 10), IGNORE_INDEX)
    act = client(**prompts("right", 0))
    out = server({**act, **task.server_inputs(labels)})
    sums, counts = task.sample_losses(out, labels)
    assert out.shape[0] == 0 and counts.sum() == 0 and sums.requires_grad
    loss = task.loss(out, labels)
    assert loss.item() == 0.0 and loss.requires_grad


def _loss_and_grads(server, act, labels, task, chunk):
    """(ℓ, λ and the gradients of the head's trained weights) of one server pass, with ``chunk`` token losses per
    chunk (0: the (N, V) logits path)."""
    server.loss_chunk_tokens = chunk
    task.loss_chunk_tokens = chunk
    z = act["z"].clone().requires_grad_(True)
    out = server_forward(server, {**act, "z": z, **task.server_inputs(labels)})
    sums, counts = task.sample_losses(out, labels)
    loss = sums.sum() / counts.sum()
    head = [p for p in (server.norm.weight, server.lm_head.weight) if p.requires_grad]
    grads = torch.autograd.grad(loss, [z, *head])
    return out, loss, grads


@pytest.mark.parametrize("trained_head", [False, True], ids=["frozen_head", "trained_head"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])  # gemma3: soft-capped logits
def test_chunked_token_losses_give_the_unchunked_loss_lambda_and_head_gradients(arch, trained_head):
    """server.loss_chunk_tokens: the token losses, chunk by chunk, give the (N, V) logits path's loss, λ and (a
    trained head's) the gradients of norm and lm_head, up to float32 rounding, for chunks that do and do not divide
    N; without a graph they are the same numbers."""
    model = tiny_causal_lm(arch)
    client, server = split_causal_lm(model, 2, untie=True)
    for p in server.parameters():
        p.requires_grad_(False)
    for p in (server.norm.weight, server.lm_head.weight):
        p.requires_grad_(trained_head)
    task = GenerationTask(tiny_tokenizer(), "right", max_positions=None)
    x = prompts("right", model.config.pad_token_id or 0)
    labels = torch.full((3, 10), IGNORE_INDEX)
    labels[0, 3:10] = x["input_ids"][0, 3:10]
    labels[1, 2:6] = x["input_ids"][1, 2:6]
    with torch.no_grad():
        act = client(**x)
    logits, want_loss, want = _loss_and_grads(server, act, labels, task, 0)
    assert logits.dim() == 2
    for chunk in (1, 4, 64):
        out, loss, got = _loss_and_grads(server, act, labels, task, chunk)
        assert out.shape == (logits.shape[0],) and out.dtype == torch.float32
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        with torch.no_grad():
            again = server_forward(server, {**act, **task.server_inputs(labels)})
        torch.testing.assert_close(again, out.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("trained_head", [False, True], ids=["frozen_head", "trained_head"])
def test_chunked_token_losses_hold_one_chunk_of_logits_at_a_time(trained_head):
    """No tensor computed with the vocabulary as its last dimension has more rows than a chunk, forward or backward:
    the (N, V) logits and their gradient never exist."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_causal_lm("qwen3")
    client, server = split_causal_lm(model, 2, untie=True)
    server.lm_head.weight.requires_grad_(trained_head)
    vocab = server.lm_head.weight.shape[0]
    task = GenerationTask(tiny_tokenizer(), "right", max_positions=None, loss_chunk_tokens=3)
    server.loss_chunk_tokens = 3
    x = prompts("right", model.config.pad_token_id or 0)
    labels = x["input_ids"].masked_fill(x["attention_mask"] == 0, IGNORE_INDEX)  # N = 16 predicted tokens
    with torch.no_grad():
        act = client(**x)
    rows: list[int] = []

    class Rows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # the weight seen through t() / detach(), not a product
                return out
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == vocab:
                    rows.append(t.shape[0])
            return out

    z = act["z"].clone().requires_grad_(True)
    with Rows():
        out = server_forward(server, {**act, "z": z, **task.server_inputs(labels)})
        task.loss(out, labels).backward()
    assert out.shape == (16,) and rows and max(rows) <= 3
    assert z.grad is not None and (server.lm_head.weight.grad is not None) == trained_head


def test_a_squad_run_with_chunked_losses_trains_as_the_unchunked_one(tmp_path, text_files, monkeypatch):
    """End to end (in-process HO-SFL on the tiny SQuAD set): server.loss_chunk_tokens changes the losses only by
    float rounding, and the server's training passes go through the chunks."""
    from hosfl_dist.models import hf_split
    from tiny import run_in_process

    calls: list[int] = []
    inner = hf_split.chunked_token_losses
    monkeypatch.setattr(hf_split, "chunked_token_losses", lambda *a: calls.append(a[3]) or inner(*a))
    runs = []
    for chunk in (0, 3):
        overrides = lm_overrides(tmp_path / f"chunk{chunk}", text_files, task="squad", arch="qwen3")
        _, _, _, rows = run_in_process([*overrides, f"server.loss_chunk_tokens={chunk}"])
        runs.append([r["train_loss"] for r in rows if r.get("train_loss") is not None])
        assert (set(calls) == {3}) if chunk else not calls
    assert runs[0] and len(runs[0]) == len(runs[1])
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ KV-cached generation


def server_and_worker(arch: str, side: str, max_new_tokens: int = 12) -> tuple[EvalServer, Evaluator]:
    """The real evaluation server and the worker's evaluator on a tiny LM cut at 2, behind an in-process endpoint."""
    model = tiny_causal_lm(arch)
    client, server = split_causal_lm(model, 2)
    task = GenerationTask(tiny_tokenizer(), side, max_positions=None, max_new_tokens=max_new_tokens)
    split = SplitModel(client, server, task)
    cfg = load_config(None, [])
    srv = EvalServer(server, task)
    endpoint = ServerEndpoint(server_of(cfg, split, ServerBase), evaluator=srv)
    return srv, Evaluator(WorkerBase(method_config(cfg), split, None, [], InProcessTransport(endpoint), None))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_generation_equals_the_no_cache_path(arch, side):
    srv, evaluator = server_and_worker(arch, side)
    split = evaluator.worker.split
    task = split.task
    x = prompts(side, split.client.config.pad_token_id or 0)
    task.eos_id = None  # random weights: make rows end at different steps, by EOS and by the position limit
    evaluator.kv_cache = False
    free = evaluator.generate(x, key=0)
    task.eos_id, task.max_positions = int(free[1, 3]), 15
    ref = evaluator.generate(x, key=0)
    assert ref.shape == (3, 12) and (ref[0, 5:] == -1).all()  # row 0 hits the limit (10 + 5 positions)
    assert (ref[1] == -1).any() and (ref[2] != -1).all()  # row 1 stops at EOS; row 2 runs all 12 steps

    sent: list[tuple[int, ...]] = []
    original = srv.eval_next_token
    srv.eval_next_token = lambda act, **kw: sent.append(tuple(act["z"].shape)) or original(act, **kw)
    head_rows = rows_seen(srv.model.lm_head)
    evaluator.kv_cache = True
    got = evaluator.generate(x, key=1)

    assert torch.equal(got, ref), f"cached {got.tolist()} != reference {ref.tolist()}"
    d = sent[0][-1]
    assert sent[0] == (3, 10, d)  # the prompts once, then the newest token of each row that goes on
    assert all(s[1:] == (1, d) for s in sent[1:]) and sent[-1][0] == 1 and len(sent) == 12
    assert head_rows == [s[0] for s in sent]  # the head ran at one position per row


def test_the_no_cache_step_computes_the_head_at_the_last_token_only():
    srv, evaluator = server_and_worker("llama", "right", max_new_tokens=3)
    head_rows = rows_seen(srv.model.lm_head)
    evaluator.kv_cache = False
    evaluator.generate(prompts("right", 0), key=0)
    assert head_rows == [3, 3, 3]


def test_the_server_keeps_one_cache_and_refuses_steps_it_cannot_continue():
    srv, evaluator = server_and_worker("qwen3", "left", max_new_tokens=4)
    client = evaluator.worker.split.client
    x = prompts("left", 0)
    kv = client.new_cache()
    act = client(**x, past_key_values=kv)
    first = srv.eval_next_token(act, cache="a")["token"]
    assert srv._cache.key == "a" and srv._cache.columns == 10
    assert first.shape == (3,)
    step = {"z": act["z"][:2, -1:], "attention_mask": torch.ones(2, 11, dtype=torch.long)}  # 2 rows' next token
    with pytest.raises(ProtocolError, match="without its prompts"):
        srv.eval_next_token(step, cache="b")
    with pytest.raises(ProtocolError, match="3 rows"):
        srv.eval_next_token(step, cache="a")  # 2 rows sent, 3 held, none dropped
    with pytest.raises(ProtocolError, match="not a list of its rows"):
        srv.eval_next_token(step, cache="a", keep=torch.tensor([0, 5]))
    srv.eval_next_token(client(**x, past_key_values=client.new_cache()), cache="c")  # new prompts replace "a"
    assert srv._cache.key == "c"
    srv.eval_generated(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, 1, dtype=torch.uint8))
    assert srv._cache is None  # the batch is decoded: its cache is gone


# ------------------------------------------------------------------------------------------ SQuAD through the runner


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_text_files(tmp_path_factory.mktemp("text"))


def test_squad_evaluation_with_caches_equals_the_reference_in_process(tmp_path, text_files):
    extra = ["data.eval_max_samples=3", "train.eval_batch_size=2"]
    overrides = lm_overrides(tmp_path / "run", text_files, task="squad", arch="qwen3", side="right")
    cfg = load_config(None, overrides + extra)
    engine = InProcessRunner(cfg).setup()
    server = engine.evaluator  # the evaluation server beside the algorithm's
    engine.split.task.max_new_tokens = 8  # random weights never stop early: 8 steps are enough to compare
    scored = []
    original = server.eval_generated
    server.eval_generated = lambda tokens, labels: scored.append(tokens) or original(tokens, labels)

    def evaluate(kv_cache: bool) -> tuple[torch.Tensor, dict, int]:
        scored.clear()
        before = engine.meter.snapshot()["eval"]
        Evaluator(engine.worker, kv_cache=kv_cache).evaluate(0)
        metrics = engine.endpoint.locked(server.pop_metrics)
        return torch.cat([t.flatten() for t in scored]), metrics, engine.meter.snapshot()["eval"] - before

    ref, ref_metrics, ref_bytes = evaluate(kv_cache=False)
    got, got_metrics, got_bytes = evaluate(kv_cache=True)
    assert [len(t) for t in scored] == [2, 1]  # data.eval_max_samples=3 in batches of 2
    assert torch.equal(got, ref) and got_metrics == ref_metrics
    assert server._cache is None
    assert got_bytes < ref_bytes / 3  # z of one token a step instead of the whole sequence


# ------------------------------------------------------------------------------------------ data.eval_max_samples


@pytest.mark.parametrize("task", ["sst2", "squad"])
def test_eval_max_samples_applies_to_every_text_task(tmp_path, text_files, task):
    overrides = lm_overrides(tmp_path, text_files, task=task)
    full = build_data(data_sections(load_config(None, [*overrides, "data.eval_max_samples=0"])))
    cut = build_data(data_sections(load_config(None, [*overrides, "data.eval_max_samples=5"])))
    assert full.info["eval_size"] > 5 and cut.info["eval_size"] == 5
    assert [len(y) for _, y in cut.eval_batches(2)] == [2, 2, 1]

    def prompts_of(data, n):  # the real tokens of the first n evaluation prompts
        text = data.eval_text
        return [ids[m.bool()].tolist() for ids, m in zip(text.input_ids[:n], text.attention_mask[:n])]

    assert prompts_of(cut, 5) == prompts_of(full, 5)  # the first five examples
