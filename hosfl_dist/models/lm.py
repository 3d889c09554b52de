"""Split language models from the config: load a decoder LM, cut it at ``split.cut``, add LoRA, attach the task.

What the client sends per batch is ``{"z": (B, T, D), "attention_mask": (B, T)}`` (see ``hf_split``); both are
counted as uplink activation traffic. The server part ends in the task head:
- classification (SST-2, RTE, WSC, sentiment): :class:`LabelWordServer` outputs the label words' logits at the last
  real token, (B, n_labels), so :class:`~hosfl_dist.tasks.classification.ClassificationTask` (CE + accuracy) applies;
- SQuAD: the server outputs logits only at the positions the loss reads (``predict``, derived from the labels on the
  server: (N, V), never (B, T, V)), trained with the causal LM loss on the answer; evaluation generates greedily
  through the split with KV caches on both sides (:class:`~hosfl_dist.tasks.generation.GenerationTask`) and scores
  SQuAD F1 / EM.
Where the weights come from is :mod:`hosfl_dist.models.sources`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.config import Config, DataConfig, ModelConfig, SplitConfig
from hosfl_dist.core.seeding import Stream, stream_seed
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import ActivationSpec, SplitModel
from hosfl_dist.models.hf_split import (
    HFClient,
    HFServer,
    apply_lora,
    lora_init_values,
    num_decoder_layers,
    split_causal_lm,
)
from hosfl_dist.models.sources import DTYPES, KNOWN_DEPTHS, is_hub_id, load_tokenizer, model_config, resolve, weights_of
from hosfl_dist.tasks.classification import ClassificationTask, last_real_index
from hosfl_dist.tasks.generation import GenerationTask


def hub_requirements(model: ModelConfig, data: DataConfig) -> list[str]:
    """What of the model and data sections needs the Hugging Face hub (empty when everything is local)."""
    needs = []
    if model.name == "hf" and is_hub_id(model.source):
        needs.append(f"model.source={model.source!r} is a hub model")
    if data.source == "hub":
        needs.append(f"data.source=hub loads {data.name} with datasets.load_dataset")
    return needs


def check_without_hub(model: ModelConfig, split: SplitConfig) -> dict[str, Any]:
    """The checks of a hub config that need no download: the cut against the model's known depth."""
    depth = KNOWN_DEPTHS.get(model.source)
    if depth is not None and not 1 <= split.cut < depth:
        raise ConfigError(
            f"invalid value for split.cut: {split.cut} ({model.source} has {depth} decoder blocks; "
            f"need 1 <= cut < {depth})"
        )
    return {"decoder_blocks": depth, "client_blocks": split.cut}


class LabelWordServer(nn.Module):
    """f_s of a classification task: the label words' logits at the last real token, (B, n_labels).

    Equal to ``classification_logits(HFServer(act), mask, ids)``, but the final norm and the lm_head run on the B
    last-token states only (norm and head act per position), not on all B·T positions and V vocabulary columns.
    """

    def __init__(self, server: HFServer, label_word_ids: Sequence[int]) -> None:
        super().__init__()
        self.server = server
        self.register_buffer("label_ids", torch.tensor(list(label_word_ids), dtype=torch.long), persistent=False)

    def forward(self, act: dict[str, Tensor]) -> Tensor:
        s = self.server
        mask = act["attention_mask"]
        h = s.run_blocks(act["z"], mask)  # (B, T, D)
        h = h[torch.arange(h.shape[0], device=h.device), last_real_index(mask).to(h.device)]  # (B, D)
        return s.head(h)[:, self.label_ids]  # the head of HFServer.forward on the selected states: (B, n_labels)


class ZeroOrderClient(nn.Module):
    """f_c kept in eval mode (no dropout) whatever ``train()`` says: z and the P perturbed z̃_p of Eq. 13 must
    differ only by the perturbation μu_p, not by dropout masks (MeZO also runs its forwards in eval mode)."""

    def __init__(self, client: HFClient) -> None:
        super().__init__()
        self.client = client

    def train(self, mode: bool = True) -> ZeroOrderClient:
        super().train(mode)
        self.client.eval()
        return self

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        return self.client(input_ids, attention_mask)


def build(
    cfg: Config,
    data_info: dict[str, Any],
    zeroth_order_client: bool,
    parts: Sequence[str] = ("client", "server"),
    shard: Callable[[nn.Module], Any] | None = None,
) -> SplitModel:
    """f_c = embeddings + blocks 0..k-1 with LoRA on ``lora.client_targets``; f_s = the rest with LoRA on
    ``lora.server_targets`` and the task head. Only LoRA tensors are trainable (float32 whatever ``model.dtype``),
    so d_c is the client's LoRA size.

    The model is built on the meta device and only ``parts`` are materialised (:mod:`hosfl_dist.models.materialize`):
    a part not held gets its trainable tensors only (θc^0 for a server), its frozen weights stay on the meta device.
    ``shard`` (FSDP2's ``fully_shard`` over the server group) is applied to f_s before it is materialised, so a
    server rank allocates and fills only its shard. LoRA A is drawn from generators seeded by ``job.seed`` (B starts
    at zero), so every process, layout and replica starts from the same θc^0 and θs^0, and the initial split model
    equals the loaded one. A zeroth-order client runs without dropout (:class:`ZeroOrderClient`).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from hosfl_dist.models.materialize import materialize, materialize_trainable, parameter_names

    source = resolve(cfg.model.source, cfg.model.gguf_file)
    config = model_config(source)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary tables) real
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.model.dtype], attn_implementation="sdpa")
    model.eval()  # as from_pretrained returns it (no dropout unless a method turns train mode on)
    depth = num_decoder_layers(model)
    if not 1 <= cfg.split.cut < depth:
        raise ConfigError(
            f"invalid value for split.cut: {cfg.split.cut} ({cfg.model.source} has {depth} decoder blocks; "
            f"need 1 <= cut < {depth})"
        )
    names = parameter_names(model)
    client, server = split_causal_lm(model, cfg.split.cut, untie=True)
    if server.lm_head is not model.lm_head:  # the untied copy: the tensor the checkpoint ties it to
        names[(id(server.lm_head), "weight")] = names[(id(model.lm_head), "weight")]
    lora, seed = cfg.lora, cfg.job.seed
    init = {}
    for i, (part, targets) in enumerate(((client, lora.client_targets), (server, lora.server_targets))):
        apply_lora(part, targets, lora.r, lora.alpha, lora.dropout, seed=stream_seed(seed, Stream.LORA_INIT, i))
        values = lora_init_values(part, stream_seed(seed, Stream.LORA_INIT, i)) if targets else {}
        init.update({(id(m), a): v for (m, a), v in values.items()})
    client_part: nn.Module = ZeroOrderClient(client) if zeroth_order_client else client
    if data_info.get("kind") == "classification":
        server_part: nn.Module = LabelWordServer(server, data_info["label_word_ids"])
        task: Any = ClassificationTask()
    else:
        server_part = server
        max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        chunk = cfg.server.loss_chunk_tokens
        task = GenerationTask(load_tokenizer(source), cfg.data.padding_side, max_pos, loss_chunk_tokens=chunk)
        server.loss_chunk_tokens = chunk
    text = model.config.get_text_config()
    spec = ActivationSpec(
        {"z": (None, text.hidden_size), "attention_mask": (None,)},
        {"z": DTYPES[cfg.model.dtype], "attention_mask": torch.long},
        max_len=cfg.data.max_length,
        num_classes=len(data_info["label_word_ids"]) if data_info.get("kind") == "classification" else None,
        vocab=model.get_input_embeddings().num_embeddings,
    )
    device = torch.device(cfg.job.device)
    if cfg.server.activation_checkpointing:
        checkpoint_blocks(server.layers)
    if shard is not None:
        shard(server_part)
    weights = weights_of(source, config, cfg.model.dtype, seed) if parts else None
    for name, part in (("client", client_part), ("server", server_part)):
        if name in parts:
            materialize(part, device, weights, names, init)
        else:
            materialize_trainable(part, device, init)
    del weights  # a whole state dict (tiny, GGUF) is freed here
    return SplitModel(client_part, server_part, task, spec)


def checkpoint_blocks(layers: nn.ModuleList) -> None:
    """Recompute each decoder block in the backward instead of keeping its activations (``server.activation_
    checkpointing``): only each block's input stays alive between forward and backward.

    The block's ``forward`` is wrapped in place (non-reentrant ``torch.utils.checkpoint``), so module and parameter
    names — and checkpoints — do not change; FSDP2's hooks stay around the block's call, and the recomputation runs
    while its parameters are gathered for the backward.
    """
    from torch.utils.checkpoint import checkpoint

    for block in layers:
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
