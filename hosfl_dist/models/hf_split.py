"""Cut a Hugging Face decoder LM at block k into a client part f_c and a server part f_s, and add LoRA.

f_c = embeddings (+ OPT's learned positions and project_in) + decoder blocks 0..k-1; it sends the server
exactly two tensors, whatever the architecture:

    "z"              (B, T, D) float  the hidden state after block k-1 (the paper's z = f_c(x; θ_c))
    "attention_mask" (B, T)           the 2-D padding mask, 1 = token, 0 = padding, as the caller gave it

Everything else the server needs is a function of these two, so it is rebuilt there rather than sent:
the 4-D causal / sliding-window masks, RoPE positions (Llama, Qwen3 and Gemma-3 use arange(T) whatever the
padding, exactly as their unsplit forward does without explicit position_ids), Gemma-3's local and global
rotary tables, and OPT's mask-derived positions.
f_s = decoder blocks k..L-1 + final norm (+ OPT's project_out) + lm_head (+ Gemma-3's final logit soft-capping).

Both parts call the model's own submodules, in the order and with the arguments of the unsplit forward
(transformers 5.x), so client-then-server logits equal the unsplit logits bit for bit. No KV cache is used:
the unsplit model's prefill cache does not change a single forward's output.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hosfl_dist.errors import ConfigError
from hosfl_dist.models.hf_load import SUPPORTED_MODEL_TYPES


@dataclass
class _Parts:
    """The submodules of one supported model that the two halves are built from."""

    model_type: str  # "opt", "gemma3_text", "llama", "qwen3" (multimodal "gemma3" is resolved to gemma3_text)
    config: PretrainedConfig  # the text config the decoder layers and masks were built with
    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module | None  # None for OPT-350m style post-LN models without a final norm
    lm_head: nn.Module
    rotary_emb: nn.Module | None = None  # None for OPT (learned absolute positions)
    embed_positions: nn.Module | None = None  # OPT only
    project_in: nn.Module | None = None  # OPT only, when word_embed_proj_dim != hidden_size
    project_out: nn.Module | None = None
    softcap: float | None = None  # Gemma3ForCausalLM's final_logit_softcapping


def _parts(model: PreTrainedModel) -> _Parts:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"cannot split model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "opt":
        dec = model.model.decoder
        return _Parts(
            model_type="opt",
            config=model.config,
            embed_tokens=dec.embed_tokens,
            layers=dec.layers,
            norm=dec.final_layer_norm,
            lm_head=model.lm_head,
            embed_positions=dec.embed_positions,
            project_in=dec.project_in,
            project_out=dec.project_out,
        )
    if model_type == "gemma3":
        # Gemma3ForConditionalGeneration: text-only inputs go straight to its language model, and its forward
        # applies no final soft-capping (unlike Gemma3ForCausalLM), so neither does the server.
        base, config, softcap = model.model.language_model, model.config.get_text_config(), None
        model_type = "gemma3_text"
    else:
        base, config = model.model, model.config
        softcap = config.final_logit_softcapping if model_type == "gemma3_text" else None
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError("cannot split a Gemma-3 model with use_bidirectional_attention=True (not a causal LM)")
    return _Parts(
        model_type=model_type,
        config=config,
        embed_tokens=base.embed_tokens,
        layers=base.layers,
        norm=base.norm,
        lm_head=model.lm_head,
        rotary_emb=base.rotary_emb,
        softcap=softcap,
    )


def num_decoder_layers(model: PreTrainedModel) -> int:
    """Number of decoder blocks L of a supported model; valid cut layers are 1..L-1."""
    return len(_parts(model).layers)


def _layer_types(config: PretrainedConfig, n_layers: int) -> list[str]:
    # Llama and OPT configs have no layer_types: every layer is full causal attention.
    return list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)


def _opt_positions(attention_mask: Tensor) -> Tensor:
    # OPTDecoder.forward without cache: position of each token among the real tokens, -1 on padding.
    positions = torch.cumsum(attention_mask, dim=1)  # (B, T)
    return (positions * attention_mask - 1).long()


class _Blocks(nn.Module):
    """Runs a contiguous slice of decoder blocks the way the unsplit base model's forward does."""

    def __init__(self, parts: _Parts, layers: list[nn.Module], layer_types: list[str]) -> None:
        super().__init__()
        self.config = parts.config
        self.model_type = parts.model_type
        self.layers = nn.ModuleList(layers)
        self.layer_types = layer_types
        # Each side gets its own copy of the (parameter-free) rotary module so moving one part to another
        # device never moves the other's buffers; the config stays shared.
        rotary = parts.rotary_emb
        self.rotary_emb = None if rotary is None else copy.deepcopy(rotary, memo={id(parts.config): parts.config})

    def run_blocks(self, h: Tensor, attention_mask: Tensor) -> Tensor:
        """h (B, T, D) through the blocks; masks and positions are rebuilt from the (B, T) padding mask."""
        if self.model_type == "opt":
            position_ids = _opt_positions(attention_mask)  # (B, T)
            mask = create_causal_mask(
                config=self.config, inputs_embeds=h, attention_mask=attention_mask, past_key_values=None
            )
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_ids=position_ids)
            return h

        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T), as without a cache
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": h,
            "attention_mask": attention_mask,
            "past_key_values": None,
            "position_ids": position_ids,
        }
        needed = set(self.layer_types)
        masks = {}
        if "full_attention" in needed:
            masks["full_attention"] = create_causal_mask(**mask_kwargs)
        if "sliding_attention" in needed:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        if self.model_type == "gemma3_text":
            # Gemma-3 has a local (sliding) and a global RoPE base: one (cos, sin) pair per layer type.
            rope = {t: self.rotary_emb(h, position_ids, t) for t in needed}
        else:
            shared = self.rotary_emb(h, position_ids)
            rope = dict.fromkeys(needed, shared)
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            h = layer(
                h, attention_mask=masks[layer_type], position_embeddings=rope[layer_type], position_ids=position_ids
            )
        return h


class HFClient(_Blocks):
    """f_c: embeddings and decoder blocks 0..k-1 of a Hugging Face causal LM."""

    def __init__(self, parts: _Parts, k: int) -> None:
        types = _layer_types(parts.config, len(parts.layers))
        super().__init__(parts, list(parts.layers[:k]), types[:k])
        self.embed_tokens = parts.embed_tokens  # Gemma-3's scales by sqrt(D) itself
        self.embed_positions = parts.embed_positions
        self.project_in = parts.project_in

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        """input_ids, attention_mask (B, T) -> {"z": (B, T, D), "attention_mask": (B, T)}, the uplink message."""
        h = self.embed_tokens(input_ids)  # (B, T, D_embed)
        if self.model_type == "opt":
            pos = self.embed_positions(attention_mask, 0, position_ids=_opt_positions(attention_mask))
            if self.project_in is not None:
                h = self.project_in(h)  # (B, T, D)
            h = h + pos.to(h.device)
        z = self.run_blocks(h, attention_mask)  # (B, T, D)
        return {"z": z, "attention_mask": attention_mask}


class HFServer(_Blocks):
    """f_s: decoder blocks k..L-1, final norm and lm_head of a Hugging Face causal LM."""

    def __init__(self, parts: _Parts, k: int, lm_head: nn.Module) -> None:
        types = _layer_types(parts.config, len(parts.layers))
        super().__init__(parts, list(parts.layers[k:]), types[k:])
        self.norm = parts.norm
        self.project_out = parts.project_out
        self.lm_head = lm_head
        self.softcap = parts.softcap

    def forward(self, act: dict[str, Tensor]) -> Tensor:
        """act: the client's message {"z": (B, T, D), "attention_mask": (B, T)} -> logits (B, T, V)."""
        h = self.run_blocks(act["z"], act["attention_mask"])  # (B, T, D)
        if self.norm is not None:
            h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)  # (B, T, D_embed)
        logits = self.lm_head(h)  # (B, T, V)
        if self.softcap is not None:
            # Gemma-3: logits = c * tanh(logits / c), in the same three steps as Gemma3ForCausalLM.
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits


def split_causal_lm(model: PreTrainedModel, k: int, untie: bool = True) -> tuple[HFClient, HFServer]:
    """Cut `model` after its first k decoder blocks (1 <= k < L) into (f_c, f_s).

    Both parts hold the model's own submodules, so the model and its parts share weights (and `apply_lora` on
    a part also adds the adapters to `model`). With `untie`, a
    lm_head tied to the input embedding is deep-copied for the server, so client and server share no
    Parameter (they live in different processes); with untie=False the tie is kept.
    """
    parts = _parts(model)
    n_layers = len(parts.layers)
    if not 1 <= k < n_layers:
        raise ConfigError(
            f"cut layer k={k} is out of range: the model has {n_layers} decoder layers, need 1 <= k < {n_layers}"
        )
    client_params = {id(p) for p in parts.embed_tokens.parameters()}
    lm_head = parts.lm_head
    if untie and any(id(p) in client_params for p in lm_head.parameters()):
        lm_head = copy.deepcopy(lm_head)  # a fresh Parameter with its own storage
    return HFClient(parts, k), HFServer(parts, k, lm_head)


def apply_lora(
    module: nn.Module,
    target_modules: list[str],
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    seed: int = 0,
) -> nn.Module:
    """Inject LoRA adapters into `module` in place and freeze everything but them; returns `module`.

    LoRA B starts at zero (peft's default) so outputs are unchanged; A is drawn from a local generator seeded
    with `seed` (peft's kaiming-uniform law), so replicas built in different processes start identical and
    the global RNG is untouched. An empty `target_modules` adds nothing and freezes every parameter.
    """
    if target_modules:
        config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
        try:
            with torch.random.fork_rng(devices=[]):  # peft's own A init draws from the global RNG
                inject_adapter_in_model(config, module)
        except ValueError as err:  # peft: "Target modules {...} not found in the base model"
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"LoRA target_modules {list(target_modules)} not found: {reason}") from err
        gen = torch.Generator().manual_seed(seed)
        for name, sub in module.named_modules():
            if name.endswith("lora_A.default"):
                # Drawn on the CPU then copied, so the values do not depend on the module's device.
                weight = torch.empty(sub.weight.shape)
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
                with torch.no_grad():
                    sub.weight.copy_(weight)
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
    return module
