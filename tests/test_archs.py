"""The packaged architectures (hosfl_dist/models/archs): each config.json loads, builds the published model, and
runs when shrunk; the Qwen3-8B split the paper's memory figures use has the expected sides."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from hosfl_dist.errors import ConfigError
from hosfl_dist.models.archs import ARCH_NAMES, arch_config, arch_fields
from hosfl_dist.models.hf_split import split_causal_lm

# Exact totals (tied embeddings counted once) as other code bases count the published checkpoints: keras-hub's
# Qwen3 and Gemma3 presets ("params"), the safetensors metadata of the Llama-3.2 checkpoints, and OPT-125M as
# every PyTorch count reports it. The model cards round them to 0.6B, 1.7B, 4.0B, 8.2B, 1.24B, 3.21B, 268M, 125M.
PARAMS = {
    "gemma-3-270m": 268_098_176,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "opt-125m": 125_239_296,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
}
QWEN3_NON_EMBEDDING = {"qwen3-0.6b": 0.44e9, "qwen3-1.7b": 1.4e9, "qwen3-4b": 3.6e9, "qwen3-8b": 6.95e9}
""""Number of Parameters (Non-Embedding)" on the Qwen3 model cards (input embedding and any untied lm_head out)."""

# Keys of the published files that transformers 5 reads through its backward-compatibility paths rather than
# as fields: rope_theta / rope_scaling / rope_local_base_freq become rope_parameters, torch_dtype becomes dtype.
LEGACY_KEYS = {"model_type", "rope_theta", "rope_scaling", "rope_local_base_freq", "torch_dtype"}


def _meta_model(config: PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return AutoModelForCausalLM.from_config(config)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied weight once


def _config_keys(config_cls: type[PretrainedConfig]) -> set[str]:
    """Every key the config class takes: dataclass fields (transformers 5), __init__ parameters, attribute_map."""
    keys = set(getattr(config_cls, "attribute_map", {}))
    for cls in config_cls.__mro__:
        if dataclasses.is_dataclass(cls):
            keys |= {f.name for f in dataclasses.fields(cls)}
        if "__init__" in vars(cls):
            keys |= set(inspect.signature(cls.__init__).parameters)
    return keys


def test_arch_names_are_the_papers_models():
    assert ARCH_NAMES == [
        "gemma-3-270m",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "opt-125m",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
        "qwen3-8b",
    ]


def test_an_unknown_arch_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown architecture 'qwen3-9b'; choose one of gemma-3-270m, .*qwen3-8b"):
        arch_config("qwen3-9b")


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_every_field_is_read_and_nothing_warns(name):
    """A misspelt key would silently become the family's default; transformers neither rejects nor warns."""
    fields = arch_fields(name)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # transformers' loggers do not propagate to pytest's caplog
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config = arch_config(name)
    finally:
        hf_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
    assert config.model_type == fields["model_type"]
    assert sorted(set(fields) - _config_keys(type(config)) - LEGACY_KEYS) == []
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        fields["num_hidden_layers"],
        fields["hidden_size"],
        fields["vocab_size"],
    )
    assert arch_fields(name) == fields, "arch_fields must hand out a fresh copy"


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_builds_the_published_parameter_count(name):
    config = arch_config(name)
    model = _meta_model(config)
    assert _numel(model) == PARAMS[name]
    if name in QWEN3_NON_EMBEDDING:
        embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
        assert (_numel(model) - embeddings) == pytest.approx(QWEN3_NON_EMBEDDING[name], rel=0.01)


def test_qwen3_8b_split_at_5_sizes():
    """The paper's Qwen3-8B client (k=5) fits a phone-class device in bf16; the server holds the rest."""
    client, server = split_causal_lm(_meta_model(arch_config("qwen3-8b")), 5)
    embed = 151_936 * 4096  # V·D
    # attention q,o: D·(32·128) each, k,v: D·(8·128) each; SwiGLU 3·D·12288; two RMSNorms D and q/k norms 128
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12_288 + 2 * 4096 + 2 * 128
    assert _numel(client) == embed + 5 * block == 1_587_062_016
    assert _numel(server) == 31 * block + 4096 + embed == 6_603_673_344  # final norm, untied lm_head
    assert 2 * _numel(client) == pytest.approx(3.2e9, rel=0.01)  # bytes in bf16
    assert _numel(client) + _numel(server) == PARAMS["qwen3-8b"]


def _shrunk(name: str) -> PretrainedConfig:
    """The family's config with widths / 16 and few blocks: every other field (RoPE scaling, norms, GQA ratio,
    Gemma-3's sliding/full pattern, soft-capping) as published."""
    fields = arch_fields(name)
    for key in ("hidden_size", "intermediate_size", "ffn_dim", "head_dim", "word_embed_proj_dim"):
        if key in fields:
            fields[key] //= 16
    fields["vocab_size"] = 512
    layer_types = fields.get("layer_types")
    if layer_types:  # up to the first full-attention block, with a window shorter than the test sequence
        fields["layer_types"] = layer_types[: layer_types.index("full_attention") + 1]
        fields["sliding_window"] = 4
    fields["num_hidden_layers"] = len(fields.get("layer_types") or [None, None])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.parametrize("name", ["gemma-3-270m", "llama-3.2-1b", "opt-125m", "qwen3-8b"])
def test_shrunk_family_runs_and_splits_exactly(name):
    config = _shrunk(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()  # eval: OPT's published dropout is 0.1
    ids = torch.randint(3, config.vocab_size, (2, 10))  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding on the second row
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        client, server = split_causal_lm(model, 1)
        split = server(client(ids, mask))
    assert logits.shape == (2, 10, config.vocab_size)
    assert torch.isfinite(logits).all()
    real = mask.bool()
    torch.testing.assert_close(split[real], logits[real])
