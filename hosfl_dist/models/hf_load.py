"""Build or load the Hugging Face decoder LMs that `hf_split` cuts in two.

`tiny_causal_lm` makes small random models from config objects (tests and smoke runs, no downloads);
`load_causal_lm` loads a real checkpoint from the hub, a local directory or a GGUF file, and `load_tokenizer` its
tokenizer alone; both turn every way that can fail into one `ConfigError` line naming the source. Which of them a
``model.source`` means is decided in one place, :mod:`hosfl_dist.models.sources`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
)

from hosfl_dist.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("opt", "gemma3_text", "llama", "qwen3", "gemma3")
"""`config.model_type` values that `split_causal_lm` can cut. "gemma3" is the multimodal Gemma-3 checkpoint;
only its language model and lm_head are used (the vision tower is ignored, inputs are text only)."""

TINY_ARCHS: tuple[str, ...] = ("opt", "gemma3", "llama", "qwen3")

# Small enough that a forward pass takes milliseconds on one core, large enough to keep each architecture's
# distinguishing features: GQA (2 KV heads for 4 query heads) where the family has it, Gemma-3's sliding + full
# layers with a window shorter than the test sequences and its final logit soft-capping, tied embeddings
# (as in OPT-125M, Gemma-3-270M, Llama-3.2-1B, Qwen3-0.6B) so that `untie` has something to do.
_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,  # larger than HF's 0.02 so attention is far from uniform and masks matter
}
_ROPE: dict[str, Any] = {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0}
_TINY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {**_COMMON, **_ROPE}),
    "qwen3": (Qwen3Config, {**_COMMON, **_ROPE}),
    "gemma3": (
        Gemma3TextConfig,
        {
            **_COMMON,
            **_ROPE,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "opt": (
        OPTConfig,
        # OPT's real configs use dropout 0.1; zero keeps train-mode forwards deterministic for the ZO side.
        {
            **_COMMON,
            "ffn_dim": 128,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "pad_token_id": 1,
            "bos_token_id": 2,
            "eos_token_id": 2,
        },
    ),
}


def tiny_causal_lm(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny randomly initialised causal LM of family `arch`, identical for equal `seed` and overrides.

    `overrides` replace config fields (e.g. `word_embed_proj_dim=32` for an OPT with project_in/out);
    `attn_implementation` picks the attention kernel: "sdpa" (the default, as `from_pretrained` picks) or
    "eager". Returned in eval() mode; the global torch RNG is left as it was.
    """
    attn_implementation = overrides.pop("attn_implementation", "sdpa")
    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The config of :func:`tiny_causal_lm` (``overrides`` replace its fields)."""
    if arch not in _TINY_CONFIGS:
        raise ConfigError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    config_cls, defaults = _TINY_CONFIGS[arch]
    return config_cls(**{**defaults, **overrides})


def _looks_like_path(source: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that names the filesystem must exist locally, and
    # failing here avoids a slow, misleading hub lookup for a mistyped path.
    return os.path.isabs(source) or source.startswith(("./", "../", "~")) or os.path.exists(source)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _checked(source: str, gguf_file: str | None, local_files_only: bool) -> tuple[str, str, dict[str, Any]]:
    """(source, where, from_pretrained kwargs) after the local checks that avoid a slow, misleading hub lookup."""
    if gguf_file is None and source.endswith(".gguf"):
        source, gguf_file = os.path.split(source)
        source = source or "."
    if _looks_like_path(source):
        source = os.path.expanduser(source)
        if not os.path.isdir(source):
            raise ConfigError(f"cannot load model {source!r}: no such directory")
        if gguf_file is not None and not os.path.isfile(os.path.join(source, gguf_file)):
            raise ConfigError(f"cannot load model {source!r}: no GGUF file {gguf_file!r} in it")
    where = source if gguf_file is None else os.path.join(source, gguf_file)
    kwargs: dict[str, Any] = {"local_files_only": local_files_only}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return source, where, kwargs


def load_causal_config(source: str, gguf_file: str | None = None, local_files_only: bool = False) -> PretrainedConfig:
    """The config of a checkpoint (hub id, local directory or GGUF file), checked to be a supported model type."""
    source, where, kwargs = _checked(source, gguf_file, local_files_only)
    # from_pretrained fails in many types (OSError, HFValidationError, connection errors, ImportError for a
    # missing gguf package, ...); all of them mean "this source cannot be used", reported in one line.
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except Exception as err:
        raise ConfigError(f"cannot load model {where!r}: {_one_line(err)}") from err
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"cannot load model {where!r}: model_type {config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def load_causal_lm(
    source: str,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    local_files_only: bool = False,
    progress: bool = False,
) -> PreTrainedModel:
    """Load a causal LM in eval() mode from a hub id, a local HF directory, a directory holding `gguf_file`, or a
    path to a `.gguf` file. GGUF weights are dequantised to `dtype`. transformers' own progress bars of the load
    (de-quantising GGUF tensors, loading weights) are shown only with `progress`.

    Raises ConfigError naming `source` when the model cannot be loaded or its type is not supported.
    """
    config = load_causal_config(source, gguf_file, local_files_only)
    source, where, kwargs = _checked(source, gguf_file, local_files_only)
    try:
        with transformers_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype, **kwargs)
    except Exception as err:
        raise ConfigError(f"cannot load model {where!r}: {_one_line(err)}") from err
    return model.eval()


@contextlib.contextmanager
def transformers_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars while a model loads, shown only when ``shown``: its "Loading weights" bar goes
    through its tqdm hook; the GGUF reader's "Converting and de-quantizing GGUF tensors..." calls ``tqdm.auto``
    directly (transformers 5.x), past that hook, so its module's name is pointed at a disabled bar meanwhile. In a
    log file each bar is one line of carriage returns."""
    if shown:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    previous = hf_logging.set_tqdm_hook(lambda factory, args, kwargs: factory(*args, **{**kwargs, "disable": True}))
    gguf_bar = getattr(gguf_utils, "tqdm", None)
    if gguf_bar is not None:
        gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)
        if gguf_bar is not None:
            gguf_utils.tqdm = gguf_bar


def load_tokenizer(
    source: str, gguf_file: str | None = None, local_files_only: bool = False
) -> PreTrainedTokenizerBase | None:
    """The tokenizer a checkpoint ships (read without loading the weights), or None when it ships none."""
    source, where, kwargs = _checked(source, gguf_file, local_files_only)
    return _load_tokenizer(source, where, kwargs)


# Any of these marks a local directory that ships a tokenizer (a GGUF file always embeds one).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _load_tokenizer(source: str, where: str, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase | None:
    local_without_files = not any(os.path.isfile(os.path.join(source, name)) for name in _TOKENIZER_FILES)
    if os.path.isdir(source) and "gguf_file" not in kwargs and local_without_files:
        # AutoTokenizer would otherwise build an empty tokenizer of the model's default class.
        logger.warning("no tokenizer files in %s; returning no tokenizer", where)
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as err:  # noqa: BLE001 - a checkpoint without a tokenizer is still a usable model
        logger.warning("no tokenizer loaded for %s (%s)", where, _one_line(err))
        return None
    if len(tokenizer) == 0:
        logger.warning("the tokenizer of %s is empty; returning no tokenizer", where)
        return None
    return tokenizer
