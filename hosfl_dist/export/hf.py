"""A split decoder LM back in one piece, as Hugging Face and PEFT folders.

The two parts of a restored run hold the model's own submodules (``hf_split``), with peft's LoRA layers injected on
each side. The unsplit model is rebuilt on the meta device and cut at the same block (:func:`split_causal_lm` with
``untie=False``): its two halves are skeletons that name every submodule of the parts, so loading the parts' state
dicts into them (``assign``) fills the whole model without a copy, and a LoRA module of a part is found under the
whole model's name. Two outputs:

- ``merged``: each LoRA layer merged into its base weight (B·A·α/r added in float32, cast to the weight's dtype) and
  unwrapped; the whole model saved with ``save_pretrained`` (config.json, safetensors shards, generation_config.json)
  and the tokenizer beside it;
- ``peft``: one adapter of the whole model (adapter_config.json, adapter_model.safetensors) naming the client's and
  the server's LoRA modules by their full names, for ``PeftModel.from_pretrained(base, DIR)``. Its
  ``base_model_name_or_path`` names the base by its source, so that the folder travels: the hub id or the local
  folder the run read; for GGUF, package, tiny and architecture-only sources (no Hugging Face folder exists), a
  Hugging Face folder of the frozen weights the run used, written once under ``$HOSFL_CACHE/bases/<digest>`` (the
  digest of those weights: the next export of the same base writes nothing). ``copy_base`` writes the base into
  ``DIR/base`` instead and names it by the relative path ``base``: the folder then holds everything it needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from hosfl_dist.export.restore import ExportError, Restored
from hosfl_dist.models.hf_split import HFClient, HFServer, split_causal_lm
from hosfl_dist.models.sources import DTYPES, is_hub_id, load_tokenizer, model_config, resolve
from hosfl_dist.safe_files import readable

ADAPTER = "default"
"""The adapter name ``inject_adapter_in_model`` gives the LoRA layers."""
BASE = "base"
"""The folder of the base model inside a ``peft`` export written with ``--copy-base`` (named by this relative path)."""
BASES = "bases"
"""The folder under ``$HOSFL_CACHE`` of the bases written for ``peft`` exports, one per digest of their weights."""


def hf_parts(restored: Restored) -> tuple[HFClient, HFServer]:
    """The decoder halves inside the run's client and server modules (past ZeroOrderClient and the task heads)."""
    client = next(m for m in restored.split.client.modules() if isinstance(m, HFClient))
    server = next(m for m in restored.split.server.modules() if isinstance(m, HFServer))
    return client, server


def lora_layers(part: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in ``part``, layer) of every LoRA layer peft injected."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in part.named_modules() if isinstance(m, LoraLayer)]


def fold_lora(part: nn.Module, merge: bool) -> None:
    """Replace each LoRA layer of ``part`` by its base layer, with the adapter merged into it (``merge``) or dropped."""
    for name, layer in lora_layers(part):
        if merge:
            layer.merge(safe_merge=True, adapter_names=[ADAPTER])  # NaN-checked; the weight keeps its dtype
        parent, _, child = name.rpartition(".")
        setattr(part.get_submodule(parent) if parent else part, child, layer.get_base_layer())


def skeleton(restored: Restored) -> tuple[PreTrainedModel, HFClient, HFServer]:
    """The unsplit model on the meta device (buffers real) and its halves cut as the run cut it."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    cfg = restored.cfg
    config = model_config(resolve(cfg.model.source, cfg.model.gguf_file))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.model.dtype], attn_implementation="sdpa")
    client, server = split_causal_lm(model, cfg.split.cut, untie=False)
    return model.eval(), client, server


def full_names(model: nn.Module, part: nn.Module) -> dict[str, str]:
    """{name in ``part``: name in ``model``} of every submodule ``part`` shares with ``model``."""
    where = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    return {n: where[id(m)] for n, m in part.named_modules() if id(m) in where}


def join(restored: Restored, client: HFClient, server: HFServer) -> PreTrainedModel:
    """The whole model holding the parts' tensors (LoRA folded already); tied embeddings stay tied where the two
    copies are still equal (LoRA never trained either of them), else the config unties them."""
    model, skel_c, skel_s = skeleton(restored)
    for skel, part in ((skel_c, client), (skel_s, server)):
        try:
            skel.load_state_dict(part.state_dict(), strict=True, assign=True)
        except RuntimeError as exc:
            raise ExportError(f"the restored model does not fit {restored.cfg.model.source}: {exc}") from None
    left = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if left:
        raise ExportError(f"the restored parts leave {left[:3]} of the whole model without values")
    text = model.config.get_text_config()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(text, "tie_word_embeddings", False):
        if torch.equal(head.weight, embed.weight):
            head.weight = embed.weight
        else:
            text.tie_word_embeddings = False
            model.config.tie_word_embeddings = False
    return model


def tokenizer_of(restored: Restored) -> Any:
    """The tokenizer the run used (read from the model's source: for GGUF, its metadata)."""
    return load_tokenizer(resolve(restored.cfg.model.source, restored.cfg.model.gguf_file))


def save_model(model: PreTrainedModel, tok: Any, out: Path, max_shard_size: str) -> None:
    """``save_pretrained`` + tokenizer + a generation config that names the tokenizer's special tokens."""
    gen = model.generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, key, None) is None and getattr(tok, key, None) is not None:
            setattr(gen, key, getattr(tok, key))
    from hosfl_dist.models.hf_load import transformers_bars

    with transformers_bars(False):  # "Writing model shards": a line of carriage returns in a log
        model.save_pretrained(out, max_shard_size=max_shard_size)
    if not (out / "generation_config.json").is_file():
        gen.save_pretrained(out)
    tok.save_pretrained(out)


def write_merged(restored: Restored, out: Path, max_shard_size: str, step: Any = None) -> dict[str, Any]:
    """The unsplit model with both sides' LoRA merged in (see the module docstring)."""
    say = step or _quiet
    client, server = hf_parts(restored)
    adapters = len(lora_layers(client)) + len(lora_layers(server))
    with say(f"merging {adapters} LoRA layers into their weights"):
        fold_lora(client, merge=True)
        fold_lora(server, merge=True)
        whole = join(restored, client, server)
    with say(f"writing the model (safetensors shards of at most {max_shard_size}) and the tokenizer"):
        save_model(whole, tokenizer_of(restored), out, max_shard_size)
    return {"format": "merged", "lora_layers_merged": adapters}


def base_of(restored: Restored) -> str | None:
    """The base model a ``peft`` export points at when the run read a Hugging Face model (a hub id or a local folder);
    None when the export must write one."""
    cfg = restored.cfg
    source = resolve(cfg.model.source, cfg.model.gguf_file)
    if source.spec is not None or source.gguf_file is not None or cfg.model.source.startswith("pkg:"):
        return None
    if is_hub_id(cfg.model.source):
        return cfg.model.source
    return str(Path(source.path).resolve())


def write_peft(
    restored: Restored, out: Path, max_shard_size: str, copy_base: bool = False, step: Any = None
) -> dict[str, Any]:
    """One adapter over the unsplit model, client and server LoRA together (see the module docstring); ``step`` (a
    :class:`~hosfl_dist.logs.Steps`) says what takes long."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    say = step or _quiet
    client, server = hf_parts(restored)
    model, skel_c, skel_s = skeleton(restored)
    tensors: dict[str, torch.Tensor] = {}
    targets = []
    for part, skel in ((client, skel_c), (server, skel_s)):
        names = full_names(model, skel)
        for name, layer in lora_layers(part):
            full = names[name]
            targets.append(full)
            for kind in ("lora_A", "lora_B"):
                weight = getattr(layer, kind)[ADAPTER].weight
                tensors[f"base_model.model.{full}.{kind}.weight"] = weight.detach().contiguous().clone()
    if not targets:
        raise ExportError("the run trained no LoRA adapter (lora.client_targets and lora.server_targets are empty): "
                          "export --format merged")  # fmt: skip
    del model, skel_c, skel_s
    source = base_of(restored)
    tok = tokenizer_of(restored)
    base = source
    if source is None or copy_base:  # the frozen weights the run used, as a Hugging Face folder
        fold_lora(client, merge=False)
        fold_lora(server, merge=False)
        whole = join(restored, client, server)
        if copy_base:
            with say(f"writing the base model into {out.name}/{BASE} (--copy-base)"):
                save_model(whole, tok, out / BASE, max_shard_size)
            base = BASE
        else:
            base = shared_base(whole, tok, max_shard_size, say)
    lora = restored.cfg.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted(targets),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    with say("writing the adapter and the tokenizer"):
        config.save_pretrained(str(out))
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(out)
    shown = f"{BASE}/" if base == BASE else base
    return {"format": "peft", "base": shown, "base_source": source, "base_copied": copy_base,
            "lora_modules": len(targets)}  # fmt: skip


def _quiet(what: str) -> Any:
    import contextlib

    return contextlib.nullcontext()


def weights_digest(model: PreTrainedModel) -> str:
    """BLAKE2b of a model's config and state dict (names, dtypes, shapes, bytes): which base a folder holds."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def shared_base(model: PreTrainedModel, tok: Any, max_shard_size: str, say: Any) -> str:
    """The absolute path of ``$HOSFL_CACHE/bases/<digest>``, the base as a Hugging Face folder, written there unless
    an earlier export wrote it (into a hidden folder renamed into place, so a folder there is complete)."""
    import shutil

    from hosfl_dist.models.sources import cache_path

    with say("hashing the base model's weights"):
        digest = weights_digest(model)
    folder = Path(cache_path(BASES, digest))
    if (folder / "config.json").is_file():
        return str(folder)
    tmp = folder.with_name(f".{digest}.partial-{os.getpid()}")
    try:
        with say(f"writing the base model once to {folder} (the next export of this base reuses it)"):
            save_model(model, tok, tmp, max_shard_size)
            readable(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another export wrote it meanwhile
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)
