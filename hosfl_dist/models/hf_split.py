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
The server may add a side input of its own, ``"predict"`` (B, T) bool, computed from what it already holds (the
labels, or the mask): the head then runs at those positions only, so no (B, T, V) logits exist (V is 150k for Qwen3).
With ``"targets"`` (N,) as well (``server.loss_chunk_tokens``), f_s returns the N token losses instead of logits,
computed over chunks of positions (:func:`chunked_token_losses`), so not even (N, V) float32 logits exist at once.

Both parts call the model's own submodules, in the order and with the arguments of the unsplit forward
(transformers 5.x), so client-then-server logits equal the unsplit logits bit for bit. Training uses no KV cache (the
unsplit model's prefill cache does not change a single forward's output). Greedy decoding in evaluation does: each
side keeps a ``DynamicCache`` of its own blocks (:meth:`_Blocks.new_cache`) and runs only the newest token, with
the positions and masks the unsplit forward derives from a cache (``past_key_values`` of ``run_blocks``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import Tensor, nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hosfl_dist.errors import ConfigError
from hosfl_dist.models.hf_load import SUPPORTED_MODEL_TYPES

_CACHE = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
"""The keyword the masks and decoder layers take the KV cache by: transformers renamed ``past_key_values`` to ``cache``
during 5.x (the old name warns, and goes in 5.40); older releases know only ``past_key_values``."""


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

    def __init__(self, parts: _Parts, layers: list[nn.Module], layer_types: list[str], first: int) -> None:
        super().__init__()
        self.config = parts.config
        self.model_type = parts.model_type
        self.layers = nn.ModuleList(layers)
        self.layer_types = layer_types
        # A cache has a slot per block of the whole model (each block's attention updates the slot of its own layer
        # number); the masks of each attention type are sized against the first block of that type on this side.
        self.cache_slot = {t: first + layer_types.index(t) for t in set(layer_types)}
        # Each side gets its own copy of the (parameter-free) rotary module so moving one part to another
        # device never moves the other's buffers; the config stays shared.
        rotary = parts.rotary_emb
        self.rotary_emb = None if rotary is None else copy.deepcopy(rotary, memo={id(parts.config): parts.config})

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for :meth:`run_blocks` (sliding-window slots keep only the window, as in the unsplit
        model); this side fills the slots of its own blocks."""
        return DynamicCache(config=self.config)

    def run_blocks(self, h: Tensor, attention_mask: Tensor, past_key_values: Cache | None = None) -> Tensor:
        """h (B, T, D) through the blocks; masks and positions are rebuilt from the (B, T) padding mask.

        With ``past_key_values`` (a :meth:`new_cache` that holds the first T - q positions), h is (B, q, D), the
        newest q positions only, while ``attention_mask`` still covers all T; the blocks append their keys and values
        to the cache. Positions are those of the unsplit forward with a cache: T - q + arange(q) (OPT: the mask's).
        """
        past = 0 if past_key_values is None else attention_mask.shape[1] - h.shape[1]
        if self.model_type == "opt":
            position_ids = _opt_positions(attention_mask)[:, past:]  # (B, q)
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=h,
                attention_mask=attention_mask,
                layer_idx=self.cache_slot["full_attention"],
                **{_CACHE: past_key_values},
            )
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_ids=position_ids, **{_CACHE: past_key_values})
            return h

        position_ids = torch.arange(past, past + h.shape[1], device=h.device).unsqueeze(0)  # (1, q), padding included
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": h,
            "attention_mask": attention_mask,
            _CACHE: past_key_values,
            "position_ids": position_ids,
        }
        needed = set(self.layer_types)
        masks = {}
        if "full_attention" in needed:
            masks["full_attention"] = create_causal_mask(**mask_kwargs, layer_idx=self.cache_slot["full_attention"])
        if "sliding_attention" in needed:
            slot = self.cache_slot["sliding_attention"]
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs, layer_idx=slot)
        if self.model_type == "gemma3_text":
            # Gemma-3 has a local (sliding) and a global RoPE base: one (cos, sin) pair per layer type.
            rope = {t: self.rotary_emb(h, position_ids, t) for t in needed}
        else:
            shared = self.rotary_emb(h, position_ids)
            rope = dict.fromkeys(needed, shared)
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            h = layer(
                h,
                attention_mask=masks[layer_type],
                position_embeddings=rope[layer_type],
                position_ids=position_ids,
                **{_CACHE: past_key_values},
            )
        return h


class HFClient(_Blocks):
    """f_c: embeddings and decoder blocks 0..k-1 of a Hugging Face causal LM."""

    def __init__(self, parts: _Parts, k: int) -> None:
        types = _layer_types(parts.config, len(parts.layers))
        super().__init__(parts, list(parts.layers[:k]), types[:k], first=0)
        self.embed_tokens = parts.embed_tokens  # Gemma-3's scales by sqrt(D) itself
        self.embed_positions = parts.embed_positions
        self.project_in = parts.project_in

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, past_key_values: Cache | None = None
    ) -> dict[str, Tensor]:
        """input_ids, attention_mask (B, T) -> {"z": (B, T, D), "attention_mask": (B, T)}, the uplink message.

        With ``past_key_values`` (see :meth:`_Blocks.run_blocks`), input_ids are the newest q tokens (B, q) and z is
        (B, q, D); the mask covers all T positions and is sent whole.
        """
        h = self.embed_tokens(input_ids)  # (B, q, D_embed)
        if self.model_type == "opt":
            past = attention_mask.shape[1] - input_ids.shape[1]
            pos = self.embed_positions(attention_mask, past, position_ids=_opt_positions(attention_mask)[:, past:])
            if self.project_in is not None:
                h = self.project_in(h)  # (B, q, D)
            h = h + pos.to(h.device)
        z = self.run_blocks(h, attention_mask, past_key_values)  # (B, q, D)
        return {"z": z, "attention_mask": attention_mask}


def chunked_token_losses(
    head: Callable[[Tensor], Tensor], h: Tensor, targets: Tensor, chunk: int, head_params: Sequence[Tensor] = ()
) -> Tensor:
    """Float32 cross-entropy of ``head(h)`` (N, V) against ``targets`` (N,), per row, (N,), computed ``chunk`` rows at
    a time, so that at most one chunk's (chunk, V) logits and their gradient are alive instead of (N, V) in the
    model's dtype plus float32. ``head`` must act on each row alone (norm, linear, soft-capping do).

    - the head frozen (no tensor of ``head_params`` trains: LoRA runs): each chunk's gradient ∂ce_i/∂h_i is taken
      in the forward, beside its loss, and the logits dropped; the backward scales those rows by the upstream
      gradient (Liger's fused linear cross-entropy). The head runs once forward and once backward, as unchunked;
    - a trained head: the backward recomputes each chunk's logits (non-reentrant ``torch.utils.checkpoint``, random
      state kept), the head's gradients accumulating across chunks; the head runs twice forward.

    The numbers are the unchunked ``cross_entropy(head(h).float())``, its λ and gradients up to float rounding (a
    matmul over fewer rows may block its sums differently, and a frozen head's λ is scaled after the matmul).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")

    def piece(hc: Tensor, tc: Tensor) -> Tensor:
        return F.cross_entropy(head(hc).float(), tc, reduction="none")  # (n,) float32

    n = h.shape[0]
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)] or [(0, 0)]
    if not (torch.is_grad_enabled() and h.requires_grad):
        with torch.no_grad():
            return torch.cat([piece(h[s:e], targets[s:e]) for s, e in spans])
    if not any(p.requires_grad for p in head_params):
        return _FrozenHeadLosses.apply(h, targets, piece, spans)
    from torch.utils.checkpoint import checkpoint

    return torch.cat([checkpoint(piece, h[s:e], targets[s:e], use_reentrant=False) for s, e in spans])


class _FrozenHeadLosses(torch.autograd.Function):
    """Token losses of a frozen, row-wise head with their gradients taken chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, targets: Tensor, piece: Callable, spans: list) -> Tensor:
        losses, grads = [], []
        for s, e in spans:
            with torch.enable_grad():
                hc = h[s:e].detach().requires_grad_(True)
                ce = piece(hc, targets[s:e])  # (n,) float32
                (g,) = torch.autograd.grad(ce.sum(), hc)  # row i: ∂ce_i/∂h_i (rows do not mix)
            losses.append(ce.detach())
            grads.append(g)
        ctx.save_for_backward(torch.cat(grads))  # (N, D)
        return torch.cat(losses)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (g,) = ctx.saved_tensors
        return (grad.unsqueeze(-1) * g).to(g.dtype), None, None, None


class HFServer(_Blocks):
    """f_s: decoder blocks k..L-1, final norm and lm_head of a Hugging Face causal LM."""

    def __init__(self, parts: _Parts, k: int, lm_head: nn.Module) -> None:
        types = _layer_types(parts.config, len(parts.layers))
        super().__init__(parts, list(parts.layers[k:]), types[k:], first=k)
        self.norm = parts.norm
        self.project_out = parts.project_out
        self.lm_head = lm_head
        self.softcap = parts.softcap
        self.loss_chunk_tokens = 0
        """Rows per chunk of the token losses when the activation carries ``"targets"`` (``server.loss_chunk_
        tokens``; 0: all rows in one chunk)."""

    def forward(self, act: dict[str, Tensor], past_key_values: Cache | None = None) -> Tensor:
        """act: the client's message {"z": (B, T, D), "attention_mask": (B, T)} -> logits (B, T, V).

        With ``act["predict"]`` (B, T) bool, the logits at the selected positions only, (N, V) in row-major order:
        the head runs inside this forward (where an FSDP-sharded root has its parameters gathered) on N states.
        ``past_key_values``: decode the newest positions with a KV cache (see :meth:`_Blocks.run_blocks`).
        With ``act["targets"]`` (N,) as well, the float32 token losses (N,) against them instead of logits,
        ``loss_chunk_tokens`` positions at a time (:func:`chunked_token_losses`).
        """
        h = self.run_blocks(act["z"], act["attention_mask"], past_key_values)  # (B, T, D)
        predict = act.get("predict")
        if predict is not None:
            h = h[predict.to(h.device)]  # (N, D); norm and head act per position
        targets = act.get("targets")
        if targets is not None:
            if predict is None:
                raise ValueError("token losses need the positions they are taken at (act['predict'])")
            chunk = self.loss_chunk_tokens or max(1, h.shape[0])
            params = [p for m in (self.norm, self.project_out, self.lm_head) if m is not None for p in m.parameters()]
            return chunked_token_losses(self.head, h, targets.to(h.device), chunk, params)  # (N,) float32
        return self.head(h)

    def head(self, h: Tensor) -> Tensor:
        """Final norm (+ project_out) + lm_head (+ soft-capping) on hidden states (..., D) -> logits (..., V)."""
        if self.norm is not None:
            h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)  # (..., D_embed)
        logits = self.lm_head(h)  # (..., V)
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
    the global RNG is untouched. An empty `target_modules` adds nothing and freezes every parameter. The adapters
    are float32 whatever the base weights' dtype.
    """
    if target_modules:
        config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
        try:
            with torch.random.fork_rng(devices=[]):  # peft's own A init draws from the global RNG
                inject_adapter_in_model(config, module)
        except ValueError as err:  # peft: "Target modules {...} not found in the base model"
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"LoRA target_modules {list(target_modules)} not found: {reason}") from err
        if not any(p.is_meta for p in module.parameters()):  # a meta-device model draws A when it is materialised
            with torch.no_grad():
                for (sub, _), weight in lora_init_values(module, seed).items():
                    sub.weight.copy_(weight)
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name and param.dtype != torch.float32:
            # trainable tensors are float32 whatever the base dtype (a bf16 step of lr·g rounds to no change);
            # peft casts the adapter's input to its dtype and the sum back to the base layer's
            param.data = param.data.float()
    return module


def lora_init_values(module: nn.Module, seed: int) -> dict[tuple[nn.Module, str], Tensor]:
    """The initial LoRA A matrices of ``module`` (peft's kaiming-uniform law), in module order from one generator
    seeded with ``seed``: (lora_A module, "weight") -> float32 CPU tensor. Drawn on the CPU, so the values depend on
    neither the module's device nor whether it is materialised yet."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, sub in module.named_modules():
        if name.endswith("lora_A.default"):
            weight = torch.empty(sub.weight.shape)
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
            out[(sub, "weight")] = weight
    return out
