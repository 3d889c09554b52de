"""Text tasks in the federated pipeline: load, tokenise with the model's tokenizer, partition, batch.

Splits: ``sentiment_multiemo`` reads ``shared/data/sentiment_multiemo/{train,test}.jsonl`` (or ``data.root`` /
``data.train_path`` / ``data.eval_path``) as the SST-2 task. SST-2, RTE, WSC and SQuAD read ``data.train_path`` and
``data.eval_path`` with ``data.columns`` (``data.source=local``), or the hub's train and validation splits
(``data.source=hub``; GLUE test labels are hidden, so validation is the evaluation split, as in the paper).

Batches are dicts ``{"input_ids", "attention_mask"}`` (B, T) with the columns that are padding in every row of the
batch dropped. Labels: classification (B,) label index; SQuAD training (B, T) token labels; SQuAD evaluation the gold
answers as UTF-8 bytes (N, A, L), scored after generation (see ``models.lm.GenerationTask``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hosfl_dist.config import DataConfig, ModelConfig
from hosfl_dist.data import DataSections, FederatedData, partition
from hosfl_dist.data.partition import iid_partition
from hosfl_dist.data.text import (
    CUSTOM,
    SENTIMENT_COLUMNS,
    TextTaskSpec,
    TokenizedTextData,
    custom_task,
    get_task,
    label_word_ids,
    load_text_split,
    local_sentiment_paths,
    tokenize_split,
)
from hosfl_dist.errors import ConfigError
from hosfl_dist.core.seeding import Stream, generator, stream_seed
from hosfl_dist.models.sources import load_tokenizer, resolve
from hosfl_dist.tasks.generation import encode_answers

HUB_SPLITS = {"train": "train", "eval": "validation"}


class TextFederatedData(FederatedData):
    """:class:`FederatedData` over tokenised text: batches are trimmed of all-padding columns."""

    def __init__(
        self,
        train: TokenizedTextData,
        evaluation: TokenizedTextData,
        eval_labels: Tensor,
        shards: Sequence[np.ndarray],
        batch_size: int,
        seed: int,
        info: dict[str, Any],
        row_of: Tensor | None = None,
    ) -> None:
        super().__init__(
            {"input_ids": train.input_ids, "attention_mask": train.attention_mask},
            train.labels,
            {"input_ids": evaluation.input_ids, "attention_mask": evaluation.attention_mask},
            eval_labels,
            shards,
            batch_size,
            seed,
            info,
            row_of=row_of,
        )
        self.train_text, self.eval_text = train, evaluation

    def next_batch(self, client: int) -> tuple[dict[str, Tensor], Tensor]:
        b = self.train_text.select(self.rows(self.stream(client).next_indices()), trim=True)
        return {"input_ids": b.input_ids, "attention_mask": b.attention_mask}, b.labels

    def eval_batches(self, batch_size: int) -> Iterator[tuple[dict[str, Tensor], Tensor]]:
        n = len(self.eval_labels)
        for start in range(0, n, batch_size):
            idx = torch.arange(start, min(n, start + batch_size))
            b = self.eval_text.select(idx, trim=True)
            yield {"input_ids": b.input_ids, "attention_mask": b.attention_mask}, self.eval_labels[idx]


def task_spec(data: DataConfig) -> TextTaskSpec:
    """The task of ``data.name``: a preset, or the user's (``data.name=custom``: ``data.task``, ``data.template``,
    ``data.label_words``)."""
    if data.name == CUSTOM:
        return custom_task(data.task, data.template, data.label_words)
    return get_task(data.name)  # sentiment_multiemo: its own name, SST-2's prompt (TextTaskSpec.shape)


def text_files(data: DataConfig) -> tuple[str, str] | None:
    """(train, eval) local files of the configured text data set; None when it comes from the hub."""
    if data.name == "sentiment_multiemo":
        if data.source == "hub":
            raise ConfigError("data.source=hub: sentiment_multiemo is a local data set; use data.source=local")
        from hosfl_dist.data.vision import shared_data_dir

        train_path, eval_path = data.train_path, data.eval_path
        if not (train_path and eval_path):
            default_train, default_eval = local_sentiment_paths(data.root or str(shared_data_dir()))
            train_path, eval_path = train_path or default_train, eval_path or default_eval
        return train_path, eval_path
    if data.source == "hub":
        return None
    for key in ("train_path", "eval_path"):
        if not getattr(data, key):
            raise ConfigError(f"data.{key} is empty: data.name={data.name} with data.source=local needs a local file")
    return data.train_path, data.eval_path


def hub_splits(data: DataConfig) -> dict[str, Any]:
    """What a hub data set is named by: its path, configuration and the splits a run reads."""
    task = task_spec(data)
    return {"hub": task.hub[0], "name": task.hub[1], "splits": [HUB_SPLITS["train"], HUB_SPLITS["eval"]]}


def load_examples(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) canonical examples of the configured text data set."""
    task = task_spec(data)
    files = text_files(data)
    if files is None:
        return (
            load_text_split(task, HUB_SPLITS["train"], "hub", None, data.columns or None),
            load_text_split(task, HUB_SPLITS["eval"], "hub", None, data.columns or None),
        )
    columns = data.columns or (SENTIMENT_COLUMNS if data.name == "sentiment_multiemo" else None)
    eval_split = "test" if data.name == "sentiment_multiemo" else "eval"
    return (
        load_text_split(task, "train", "local", files[0], columns),
        load_text_split(task, eval_split, "local", files[1], columns),
    )


def text_data_info(data: DataConfig, model: ModelConfig) -> dict[str, Any]:
    """What the model builders need to know of the text task (its kind, label words, with ``model``'s tokenizer),
    without loading examples."""
    spec = task_spec(data)
    info: dict[str, Any] = {
        "task": spec.name,
        "kind": spec.kind,
        "max_length": data.max_length,
        "padding_side": data.padding_side,
    }
    if spec.kind == "classification":
        info["label_word_ids"] = label_word_ids(spec, load_tokenizer(resolve(model.source, model.gguf_file)))
        info["num_classes"] = len(info["label_word_ids"])
    return info


def build_text_data(
    cfg: DataSections, clients: Sequence[int] | None = None, evaluation: bool = True
) -> TextFederatedData:
    """Load, subsample, partition and tokenise the text data set with ``cfg.model``'s tokenizer.

    The partition is computed over every training example (from the raw labels), then only the shards of
    ``clients`` (default: all) are tokenised, and the evaluation split only with ``evaluation``: a client worker holds
    its clients' data, the leader also the evaluation split. The batches are the same as with everything tokenised
    (each batch is trimmed to its own longest sequence).
    """
    d = cfg.data
    spec = task_spec(d)
    train_ex, eval_ex = load_examples(d)
    if d.train_max_samples and d.train_max_samples < len(train_ex):
        keep = torch.randperm(len(train_ex), generator=generator(cfg.seed, Stream.TRAIN_SUBSET))
        train_ex = [train_ex[i] for i in keep[: d.train_max_samples].sort().values.tolist()]
    if d.eval_max_samples:
        eval_ex = eval_ex[: d.eval_max_samples]
    info = {**text_data_info(d, cfg.model), "train_size": len(train_ex), "eval_size": len(eval_ex)}
    if spec.kind == "classification":
        labels = torch.tensor([int(ex["label"]) for ex in train_ex], dtype=torch.long)
        shards = partition(labels, d, cfg.clients.total, cfg.seed)
    else:
        if d.partition != "iid":
            raise ConfigError(f"data.partition={d.partition} needs class labels; {spec.name} supports only iid")
        shards = iid_partition(len(train_ex), cfg.clients.total, stream_seed(cfg.seed, Stream.PARTITION))
    row_of = None
    if clients is not None:  # tokenise the hosted shards only; global sample index -> row of the tokenised subset
        rows = np.unique(np.concatenate([shards[m] for m in clients] or [np.zeros(0, dtype=np.int64)]))
        row_of = torch.full((len(train_ex),), -1, dtype=torch.long)
        row_of[torch.as_tensor(rows, dtype=torch.long)] = torch.arange(len(rows))
        train_ex = [train_ex[i] for i in rows.tolist()]
    if not evaluation:
        eval_ex = []
    tokenizer = load_tokenizer(resolve(cfg.model.source, cfg.model.gguf_file))
    train = tokenize_split(spec, train_ex, tokenizer, d.max_length, d.padding_side, train=True)
    held_out = tokenize_split(spec, eval_ex, tokenizer, d.max_length, d.padding_side, train=False)
    info.update(train_truncated=train.n_truncated, eval_truncated=held_out.n_truncated)
    if spec.kind == "classification":
        eval_labels = held_out.labels
    else:
        eval_labels = encode_answers(held_out.meta["answers"])  # (N, A, L) gold answers as bytes
    return TextFederatedData(
        train, held_out, eval_labels, shards, cfg.clients.batch_size, cfg.seed, info, row_of=row_of
    )
