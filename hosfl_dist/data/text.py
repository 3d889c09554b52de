"""Language tasks of the paper (Section 5, Appendix B): SST-2, RTE, WSC (accuracy) and SQuAD (F1).

Every task is cast as next-token prediction with MeZO's prompts (Malladi et al., 2023, ``templates.py``).
Classification tasks score the label words at the last prompt token; SQuAD is trained with teacher forcing on the
answer and evaluated by greedy generation. One rendered example per task (``\\n`` is a newline)::

    sst2   prompt  "a gorgeous, witty, seductive movie. It was"
           target  " great"    (label 1; label 0 -> " terrible")
    rte    prompt  "Dana Reeve died of lung cancer.\\nDoes this mean that \\"Christopher Reeve had an accident.\\" is
                    true? Yes or No?\\n"                                           (one line in the real prompt)
           target  "No"        (GLUE label 1 = not_entailment; label 0 = entailment -> "Yes")
    wsc    prompt  "Mark told Pete many lies about himself. He should have been more skeptical.\\nIn the previous
                    sentence, does the pronoun \\"he\\" refer to Mark? Yes or No?\\n"   (one line in the real prompt)
           target  "No"        (label 0; label 1 -> "Yes")
    squad  prompt  "Title: Super_Bowl_50\\nContext: Super Bowl 50 was won by the Denver Broncos.\\nQuestion: Which
                    team won Super Bowl 50?\\nAnswer:"                            (one line in the real prompt)
           target  " Denver Broncos"   (the first gold answer; training appends EOS)

As in MeZO, the SST-2 sentence and the SQuAD question are stripped, the WSC pronoun (``span2_text``) is lowercased,
and the label words of RTE and WSC carry no leading space (they follow a newline). A SQuAD example without a title
drops the ``Title:`` line. ``spec.label_words[i]`` verbalises data set label ``i``, so a label is also the index of
its word.

Local sentiment data in SST-2's shape (``/work/shared/data/sentiment_multiemo``, see its README) is the
``sentiment_multiemo`` task: SST-2's fields, prompt and label words (``shape="sst2"``) under its own name, loaded from
local files: ``load_text_split("sentiment_multiemo", "test", "local", path, SENTIMENT_COLUMNS)``.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from hosfl_dist.errors import ConfigError, DataError, did_you_mean
from hosfl_dist.tasks.generation import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TASKS: tuple[str, ...] = ("sst2", "rte", "wsc", "squad")
SENTIMENT_COLUMNS: dict[str, str] = {"sentence": "text", "label": "label"}
"""Column mapping of the local sentiment files (``{"text": ..., "label": 0|1}``) onto SST-2's fields."""


@dataclass(frozen=True)
class TextTaskSpec:
    """One language task: how its examples look, how they are prompted and how predictions are scored."""

    name: str
    """Task name: one of :data:`TASKS`, ``sentiment_multiemo`` or ``custom``."""
    kind: Literal["classification", "generation"]
    """Classification scores ``label_words`` at the last prompt token; generation produces the answer text."""
    label_words: list[str] | None
    """``label_words[i]`` verbalises label ``i`` (leading space included where it follows a word); None for squad."""
    metric: str
    """``accuracy`` or ``squad_f1``."""
    fields: tuple[str, ...] = ()
    """Canonical fields of an example; ``title`` of squad is optional."""
    hub: tuple[str, str | None] = ("", None)
    """``datasets.load_dataset`` path and configuration name."""
    hub_columns: dict[str, str] = field(default_factory=dict)
    """Canonical field -> column of the hub data set, where the names differ."""
    template: str = ""
    """A user-defined task's prompt: ``str.format`` fields naming the file's columns (the presets have their own)."""
    shape: str = ""
    """The preset whose prompt it takes, for a data set in another's shape (``sentiment_multiemo``: ``sst2``); empty:
    its own."""

    @property
    def preset(self) -> str:
        """The preset whose prompt, reference example and label rules the task follows."""
        return self.shape or self.name


_SPECS: dict[str, TextTaskSpec] = {
    "sst2": TextTaskSpec(
        "sst2", "classification", [" terrible", " great"], "accuracy", ("sentence", "label"), ("glue", "sst2")
    ),
    "rte": TextTaskSpec(
        "rte",
        "classification",
        ["Yes", "No"],
        "accuracy",
        ("premise", "hypothesis", "label"),
        ("glue", "rte"),
        {"premise": "sentence1", "hypothesis": "sentence2"},
    ),
    "wsc": TextTaskSpec(
        "wsc",
        "classification",
        ["No", "Yes"],
        "accuracy",
        ("text", "span1_text", "span2_text", "label"),
        ("super_glue", "wsc.fixed"),
    ),
    "squad": TextTaskSpec(
        "squad", "generation", None, "squad_f1", ("context", "question", "answers", "title"), ("squad", None)
    ),
}
_SPECS["sentiment_multiemo"] = dataclasses.replace(_SPECS["sst2"], name="sentiment_multiemo", hub=("", None),
                                                  shape="sst2")  # fmt: skip
"""The offline sentiment data (local files only), prompted and scored as SST-2 is."""
_OPTIONAL_FIELDS = frozenset({"title"})
_BOOLEAN_LABELS = frozenset({"wsc"})
"""Tasks whose files may write the label as a boolean: SuperGLUE's WSC JSONL has ``"label": true`` (label 1, "Yes")."""

# A neutral example per task, to see how the label words are tokenised after the end of a prompt.
_REFERENCE_EXAMPLES: dict[str, dict[str, Any]] = {
    "sst2": {"sentence": "A film.", "label": 0},
    "rte": {"premise": "A man sleeps.", "hypothesis": "A man rests.", "label": 0},
    "wsc": {"text": "Anna thanked Mia because she helped.", "span1_text": "Mia", "span2_text": "she", "label": 0},
}


CUSTOM = "custom"
"""``data.name`` of a user-defined task (``data.task``, ``data.template``, ``data.label_words``)."""


def custom_task(kind: str, template: str, label_words: list[str] | None) -> TextTaskSpec:
    """A task defined in the config: its fields are the template's, plus ``label`` (classification: label i is
    verbalised by ``label_words[i]``) or ``answers`` (generation, scored by SQuAD F1 / EM)."""
    try:
        names = [f for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ConfigError(f"invalid value for data.template: {template!r} ({exc})") from None
    if not names or any(not f.isidentifier() for f in names):
        raise ConfigError(f"invalid value for data.template: {template!r} (name the file's columns as {{column}} "
                          "fields, e.g. \"{premise}\\nQuestion: {hypothesis}? Answer:\")")  # fmt: skip
    fields = tuple(dict.fromkeys(names))
    if kind == "classification":
        return TextTaskSpec(CUSTOM, "classification", list(label_words or []), "accuracy", (*fields, "label"),
                            template=template)  # fmt: skip
    return TextTaskSpec(CUSTOM, "generation", None, "squad_f1", (*fields, "answers"), template=template)


def is_preset(name: Any) -> bool:
    """Whether ``name`` is a task of this module (:data:`TASKS`, ``sentiment_multiemo``), with a prompt of its own."""
    return isinstance(name, str) and name in _SPECS


def get_task(name: str) -> TextTaskSpec:
    """The spec of task ``name``; ConfigError listing the tasks (and the one closest to ``name``) for another."""
    if name not in _SPECS:
        hint = did_you_mean(name, _SPECS)
        raise ConfigError(f"unknown text task {name!r}; known tasks: {', '.join(_SPECS)}{hint}")
    spec = _SPECS[name]
    label_words = list(spec.label_words) if spec.label_words is not None else None
    return dataclasses.replace(spec, label_words=label_words, hub_columns=dict(spec.hub_columns))


# --------------------------------------------------------------------------------------------------------- loading


def load_text_split(
    task: str | TextTaskSpec,
    split: str,
    source: str,
    path: str | None,
    columns: dict[str, str] | None,
    max_examples: int | None = None,
) -> list[dict]:
    """Load one split of ``task`` as a list of examples with the canonical fields of the task.

    Args:
        task: one of :data:`TASKS`, or the spec of a user-defined task (:func:`custom_task`).
        split: ``train`` / ``validation`` / ``test`` for the hub; only named in messages for local files.
        source: ``hub`` (``datasets.load_dataset``, needs the Hugging Face hub or its cache) or ``local``.
        path: the local JSONL / JSON / CSV / TSV / parquet file (format from the extension); unused for the hub.
        columns: canonical field -> column of the file, e.g. ``{"sentence": "text"}``; fields left out keep their
            canonical name (for the hub: the hub's own column names).
        max_examples: keep the first ``max_examples`` examples (None or 0 = all).

    Canonical fields: sst2 sentence, label; rte premise, hypothesis, label; wsc text, span1_text, span2_text, label;
    squad context, question, answers (list of str; a ``{"text": [...]}`` dict or a JSON list string also read),
    title (optional). Labels are ints in ``range(len(label_words))``.
    """
    spec = task if isinstance(task, TextTaskSpec) else get_task(task)
    task = spec.name
    mapping = {f: f for f in spec.fields}
    if source == "hub":
        mapping.update(spec.hub_columns)
    unknown = sorted(set(columns or {}) - set(spec.fields))
    if unknown:
        raise ConfigError(f"columns for task {task!r} name unknown fields {unknown}; fields: {', '.join(spec.fields)}")
    mapping.update(columns or {})
    explicit = set(columns or {})

    if source == "hub":
        rows, where = _read_hub(spec, split, max_examples), f"hub data set {spec.hub[0]}/{spec.hub[1] or ''}:{split}"
    elif source == "local":
        if not path:
            raise ConfigError(f"source 'local' for task {task!r} needs a path to a JSONL, CSV or parquet file")
        rows, where = read_local_rows(path, max_examples or None), path
    else:
        raise ConfigError(f"unknown data source {source!r}; use 'hub' or 'local'")
    if max_examples:
        rows = rows[:max_examples]
    if not rows:
        raise DataError(f"{where} has no examples")

    present = list(rows[0])
    for f, col in mapping.items():
        if col not in present and (f not in _OPTIONAL_FIELDS or f in explicit):
            raise DataError(f"{where}: no column {_short(col)} (for field {f!r}); columns present: "
                            f"{_short(', '.join(map(str, present)), 300, quote=False)}")  # fmt: skip
    return [_canonical(spec, row, mapping, where, i) for i, row in enumerate(rows)]


def _read_hub(spec: TextTaskSpec, split: str, max_examples: int | None) -> list[dict]:
    hub_path, hub_name = spec.hub
    call = f"datasets.load_dataset({hub_path!r}" + (f", {hub_name!r}" if hub_name else "") + f", split={split!r})"
    hint = "offline? save the split as a JSONL, CSV or parquet file and load it with source='local' and a path"
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"{call} needs the 'datasets' package ({exc}); or {hint}") from exc
    try:
        args = (hub_path, hub_name) if hub_name else (hub_path,)
        ds = datasets.load_dataset(*args, split=split)
        if max_examples:
            ds = ds.select(range(min(max_examples, len(ds))))
        return list(ds.to_list())
    except Exception as exc:  # network, cache and split errors all end here
        raise DataError(f"cannot load {spec.name} from the Hugging Face hub with {call}: {exc}; {hint}") from exc


MAX_LINE_BYTES = 16 << 20
"""Longest line of a JSONL file (16 MiB): one example, never a whole data set; a longer one is refused in one line."""


def read_local_rows(path: str, limit: int | None = None) -> list[dict]:
    """The rows of a local JSONL, JSON, CSV, TSV or parquet file as dicts (DataError naming what is wrong), the first
    ``limit`` only when given. A JSONL file is read line by line, up to ``limit`` rows, each line at most
    :data:`MAX_LINE_BYTES`; a file that is not a regular file (a FIFO, /dev/zero) is refused before it is opened."""
    from hosfl_dist.safe_files import check_input_file, open_input

    p = Path(path)
    if check_input_file(p, "data file", DataError) is None:  # a FIFO or /dev/zero: refused before it is opened
        raise DataError(f"data file not found: {path}")
    ext = p.suffix.lower()
    try:
        if ext in (".jsonl", ".json"):
            with open_input(p, "data file", DataError) as fh:
                if ext == ".json" and _first_byte(fh) == b"[":
                    rows = list(json.loads(fh.read().decode("utf-8"), object_pairs_hook=_unique_keys))
                    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
                    if bad is not None:
                        raise ValueError(f"example {bad} is a {type(rows[bad]).__name__}, not an object of columns")
                    return rows[:limit] if limit else rows
                return _jsonl_rows(fh, limit)
        if ext in (".csv", ".tsv"):
            with p.open(newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh, delimiter="\t" if ext == ".tsv" else ",")
                names = reader.fieldnames or []
                twice = sorted({c for c in names if names.count(c) > 1})
                if twice:
                    raise ValueError(f"the header names the column {twice[0]!r} twice")
                return list(itertools.islice(reader, limit or None))
        if ext in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            rows = pq.read_table(p).to_pylist()
            return rows[:limit] if limit else rows
    except (OSError, ValueError, csv.Error, RecursionError) as exc:  # JSON and pyarrow errors are ValueErrors
        why = "nested too deeply" if isinstance(exc, RecursionError) else _short(str(exc), 300, quote=False)
        raise DataError(f"cannot read {path}: {why}") from None
    raise DataError(f"{path}: unsupported file type {ext!r}; use .jsonl, .json, .csv, .tsv or .parquet")


def _first_byte(fh: Any) -> bytes:
    """The first byte of ``fh`` that is not white space (b"" for an empty file), ``fh`` left at the start."""
    head = fh.read(4096)
    while head and not head.strip() and len(head) < MAX_LINE_BYTES:
        more = fh.read(4096)
        if not more:
            break
        head += more
    fh.seek(0)
    stripped = head.lstrip()
    return stripped[:1]


def _jsonl_rows(fh: Any, limit: int | None) -> list[dict]:
    """The objects of a JSONL file, one a line, read line by line: the first ``limit`` when given (the rest is
    never read), each line at most :data:`MAX_LINE_BYTES`."""
    rows: list[dict] = []
    n = 0
    while not limit or len(rows) < limit:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            break
        n += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise ValueError(f"line {n} is longer than {MAX_LINE_BYTES >> 20} MiB (one example a line)")
        line = raw.decode("utf-8")
        if line.strip():
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except ValueError as exc:
                raise ValueError(f"line {n}: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"line {n} holds a {type(row).__name__}, not an object of columns")
            rows.append(row)
    return rows


def _short(value: Any, limit: int = 80, quote: bool = True) -> str:
    """``repr(value)`` (or the text itself) on one line and cut to ``limit`` characters: a message names a value of the
    file, it does not echo the file."""
    text = repr(value) if quote else str(value)
    if not quote and not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text):,} characters)"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps the last of two silently)."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError(f"the key {_short(next(k for k in keys if keys.count(k) > 1))} twice in one object")
    return dict(pairs)


def _canonical(spec: TextTaskSpec, row: dict, mapping: dict[str, str], where: str, i: int) -> dict:
    out: dict[str, Any] = {}
    for f, col in mapping.items():
        if col not in row:
            if f in _OPTIONAL_FIELDS:
                out[f] = ""
                continue
            raise DataError(f"{where}: example {i} has no column {_short(col)} (for field {f!r})")
        value = row[col]
        if f == "label":
            out[f] = _label(spec, value, where, i)
        elif f == "answers":
            out[f] = _answers(value, where, i)
        elif value is None:
            if f in _OPTIONAL_FIELDS:
                out[f] = ""
                continue
            raise DataError(f"{where}: example {i} has no value in column {_short(col)} (for field {f!r})")
        else:
            out[f] = str(value)
    return out


def _label(spec: TextTaskSpec, value: Any, where: str, i: int) -> int:
    """The index a row's label names: an integer (``1``; ``"1"`` in a CSV; ``1.0`` in a parquet file's float column)
    or one of the label words; a boolean only for :data:`_BOOLEAN_LABELS` (JSON ``true`` is not label 1 of a custom
    task's label words)."""
    words = [w.strip() for w in spec.label_words or ()]
    if isinstance(value, str) and value.strip() in words and not value.strip().lstrip("-").isdigit():
        return words.index(value.strip())  # a label given as its label word
    label, boolean = None, isinstance(value, bool) and spec.preset not in _BOOLEAN_LABELS
    if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+", value.strip()):  # ASCII digits: not "1_0" nor "1.0"
        label = int(value.strip())
    elif isinstance(value, float) and value.is_integer() or isinstance(value, int) and not boolean:
        label = int(value)
    n = len(spec.label_words or ())
    if label == -1:
        raise DataError(
            f"{where}: example {i} is unlabelled (label -1; GLUE/SuperGLUE hide test labels, use the validation split)"
        )
    if label is None or not 0 <= label < n:
        named = f" or one of the label words {_short(words, 300)}" if spec.template else ""
        written = json.dumps(value) if isinstance(value, bool) else _short(value)  # true, as the JSON file has it
        raise DataError(f"{where}: example {i} has label {written}; {spec.name} labels are 0..{n - 1}{named}")
    return label


def _answers(value: Any, where: str, i: int) -> list[str]:
    if isinstance(value, dict):  # the hub's {"text": [...], "answer_start": [...]}
        value = value.get("text")
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            try:
                value = json.loads(stripped)
            except (json.JSONDecodeError, RecursionError):
                value = [value]
        else:
            value = [value]
    if isinstance(value, int | float) and not isinstance(value, bool):  # a number as the answer
        value = [value]
    answers = [str(a) for a in value] if isinstance(value, list | tuple) else []
    if not answers:
        raise DataError(f"{where}: example {i} has no gold answer (unanswerable questions are not supported)")
    return answers


def local_sentiment_paths(root: str) -> tuple[str, str]:
    """``(train, test)`` JSONL paths of the shipped sentiment data.

    ``root`` is either the ``sentiment_multiemo`` folder or the folder that holds it (e.g. ``/work/shared/data``).
    Load them with ``load_text_split("sentiment_multiemo", split, "local", path, SENTIMENT_COLUMNS)``.
    """
    candidates = [Path(root), Path(root) / "sentiment_multiemo"]
    for folder in candidates:
        train, test = folder / "train.jsonl", folder / "test.jsonl"
        if train.is_file() and test.is_file():
            return str(train), str(test)
    tried = " or ".join(str(c / "{train,test}.jsonl") for c in candidates)
    raise DataError(f"local sentiment data not found: looked for {tried}")


# ------------------------------------------------------------------------------------------------------- prompting


def _prompt_sst2(ex: dict) -> str:
    return f"{ex['sentence'].strip()} It was"


def _prompt_rte(ex: dict) -> str:
    return f'{ex["premise"]}\nDoes this mean that "{ex["hypothesis"]}" is true? Yes or No?\n'


def _prompt_wsc(ex: dict) -> str:
    return (
        f'{ex["text"]}\nIn the previous sentence, does the pronoun "{ex["span2_text"].lower()}" refer to '
        f"{ex['span1_text']}? Yes or No?\n"
    )


def _prompt_squad(ex: dict) -> str:
    title = ex.get("title") or ""
    head = f"Title: {title}\n" if title else ""
    return f"{head}Context: {ex['context']}\nQuestion: {ex['question'].strip()}\nAnswer:"


_PROMPTS: dict[str, Callable[[dict], str]] = {
    "sst2": _prompt_sst2,
    "rte": _prompt_rte,
    "wsc": _prompt_wsc,
    "squad": _prompt_squad,
}


PROMPT_TEMPLATES: dict[str, tuple[str, str]] = {
    "sst2": ("{sentence} It was", "sentence stripped of surrounding spaces"),
    "rte": ('{premise}\nDoes this mean that "{hypothesis}" is true? Yes or No?\n', ""),
    "wsc": (
        '{text}\nIn the previous sentence, does the pronoun "{span2_text}" refer to {span1_text}? Yes or No?\n',
        "span2_text lower-cased",
    ),
    "squad": (
        "Title: {title}\nContext: {context}\nQuestion: {question}\nAnswer:",
        "the Title line only where the example has a title; question stripped of surrounding spaces",
    ),
}
"""Each preset's prompt as a ``str.format`` template of its fields, and what the prompt function does beyond it: what
an export's card and hosfl_export.json show a reader who prompts the model without hosfl_dist (tested to agree with
:data:`_PROMPTS`)."""


PROMPT_CODE: dict[str, str] = {
    "sst2": 'TEMPLATE.format(sentence=ex["sentence"].strip())',
    "rte": 'TEMPLATE.format(premise=ex["premise"], hypothesis=ex["hypothesis"])',
    "wsc": 'TEMPLATE.format(text=ex["text"], span1_text=ex["span1_text"], span2_text=ex["span2_text"].lower())',
    "squad": '(TEMPLATE if ex.get("title") else TEMPLATE.split("\\n", 1)[1]).format(title=ex.get("title") or "", '
    'context=ex["context"], question=ex["question"].strip())',
}
"""Each preset's prompt as one Python expression of an example ``ex`` (a dict of the task's fields) and ``TEMPLATE``
(its :data:`PROMPT_TEMPLATES` entry): what an export's card writes into its scoring snippet, for a reader without
hosfl_dist (tested to agree with :data:`_PROMPTS`). A user's template is ``TEMPLATE.format(**ex)``."""


def prompt_code(spec: TextTaskSpec) -> str:
    """The Python expression of ``ex`` and ``TEMPLATE`` that builds the task's prompt (:data:`PROMPT_CODE`)."""
    if spec.template:
        return "TEMPLATE.format(**ex)"
    return PROMPT_CODE[spec.preset]


def prompt_template(spec: TextTaskSpec) -> tuple[str, str]:
    """(the exact template, a note on what it does beyond ``str.format``) of a task: the user's, or the preset's."""
    if spec.template:
        return spec.template, ""
    return PROMPT_TEMPLATES[spec.preset]


def format_example(spec: TextTaskSpec, example: dict) -> tuple[str, str]:
    """``(prompt, target)`` of one canonical example; the target is the label word or `` <first gold answer>``."""
    prompt = spec.template.format(**example) if spec.template else _PROMPTS[spec.preset](example)
    if spec.kind == "classification":
        assert spec.label_words is not None
        return prompt, spec.label_words[int(example["label"])]
    return prompt, " " + example["answers"][0]


# ---------------------------------------------------------------------------------------------------- tokenisation


@dataclass
class TokenizedTextData:
    """A whole tokenised split, padded to its longest sequence.

    Classification: ``labels`` is (N,) with the index of the gold label word. Generation, training: ``labels`` is
    (N, T), equal to ``input_ids`` on the answer and EOS positions and ``IGNORE_INDEX`` elsewhere (unshifted; the
    shift is in :func:`lm_loss`). Generation, evaluation: ``labels`` is an empty (N, 0) tensor and
    ``meta["answers"]`` holds the gold answer lists.
    """

    input_ids: Tensor
    """(N, T) long token ids, padded with the pad (or EOS) token."""
    attention_mask: Tensor
    """(N, T) long, 1 on real tokens."""
    labels: Tensor
    """(N,) or (N, T) long, see the class docstring."""
    meta: dict[str, list] = field(default_factory=dict)
    """Per-example extras, e.g. ``answers`` (SQuAD gold answer lists)."""
    padding_side: Literal["left", "right"] = "right"
    """Which side the padding is on."""
    n_truncated: int = 0
    """How many examples lost prompt tokens to ``max_length``."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, indices: Sequence[int] | Tensor, trim: bool = True) -> TokenizedTextData:
        """The examples at ``indices`` (a client shard or a batch); ``trim`` drops columns that are padding in all."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        ids, mask, labels = self.input_ids[idx], self.attention_mask[idx], self.labels[idx]
        if trim and ids.shape[0] > 0:
            keep = mask.bool().any(dim=0)  # contiguous: padding sits on one side
            ids, mask = ids[:, keep], mask[:, keep]
            if labels.dim() == 2 and labels.shape[1] == keep.shape[0]:
                labels = labels[:, keep]
        meta = {k: [v[i] for i in idx.tolist()] for k, v in self.meta.items()}
        return TokenizedTextData(ids, mask, labels, meta, self.padding_side)


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS), found by encoding a probe with and without them."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def _continuation_ids(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], continuations: list[str]
) -> list[list[int]]:
    """Token ids of each continuation as it follows its prompt.

    Taken from the encoding of ``prompt + continuation`` when the prompt's own encoding is a prefix of it (the
    usual case with a boundary at a space or newline); otherwise the continuation encoded alone.
    """
    alone_cache: dict[str, list[int]] = {}
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    joint_ids = tokenizer([p + c for p, c in zip(prompts, continuations, strict=True)], add_special_tokens=False)[
        "input_ids"
    ]
    out = []
    for p_ids, j_ids, cont in zip(prompt_ids, joint_ids, continuations, strict=True):
        if j_ids[: len(p_ids)] == p_ids:
            out.append(list(j_ids[len(p_ids) :]))
        else:
            if cont not in alone_cache:
                alone_cache[cont] = tokenizer(cont, add_special_tokens=False)["input_ids"]
            out.append(list(alone_cache[cont]))
    return out


def label_word_ids(spec: TextTaskSpec, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """First token id of each label word as it follows the task's prompt (DataError when two ids coincide)."""
    if spec.kind != "classification" or not spec.label_words:
        raise ConfigError(f"task {spec.name!r} has no label words")
    reference = _REFERENCE_EXAMPLES.get(spec.preset) or {**dict.fromkeys(spec.fields, "A film."), "label": 0}
    prompt, _ = format_example(spec, reference)
    words = list(spec.label_words)
    conts = _continuation_ids(tokenizer, [prompt] * len(words), words)
    for word, ids in zip(words, conts, strict=True):
        if not ids:
            raise DataError(f"label word {word!r} of task {spec.name!r} encodes to no token")
    ids = [c[0] for c in conts]
    if len(set(ids)) != len(ids):
        pieces = ", ".join(f"{w!r} -> {i}" for w, i in zip(words, ids, strict=True))
        raise DataError(f"label words of task {spec.name!r} share a first token under this tokenizer: {pieces}")
    return ids


def padding_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id a run pads with: the tokenizer's pad token, else its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError("the tokenizer has neither a pad token nor an EOS token to pad with")
    return int(pad)


def tokenize_split(
    spec: TextTaskSpec,
    examples: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    padding_side: Literal["left", "right"],
    train: bool,
) -> TokenizedTextData:
    """Tokenise a split into padded tensors; see :class:`TokenizedTextData` for the layout.

    Sequences keep the tokenizer's leading special tokens (BOS) but not trailing ones: a prompt must end where its
    answer begins. A prompt that does not fit in ``max_length`` loses tokens from its left (the start of the main
    text; for SQuAD the title and the start of the context), so the end of the template and, in training, the whole
    answer + EOS survive.
    """
    if padding_side not in ("left", "right"):
        raise ConfigError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
    prefix = special_prefix(tokenizer)
    if max_length < len(prefix) + 2:
        raise ConfigError(f"max_length={max_length} leaves no room for a prompt (needs at least {len(prefix) + 2})")
    pad_id = padding_id(tokenizer)
    pairs = [format_example(spec, ex) for ex in examples]
    prompts = [p for p, _ in pairs]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    room = max_length - len(prefix)

    seqs: list[list[int]] = []
    targets: list[list[int]] = []  # per sequence: the labelled positions' token ids, placed at its end
    n_truncated = 0
    if spec.kind == "generation" and train:
        eos = tokenizer.eos_token_id
        answer_ids = _continuation_ids(tokenizer, prompts, [t for _, t in pairs])
        for p_ids, a_ids in zip(prompt_ids, answer_ids, strict=True):
            tail = list(a_ids) + ([int(eos)] if eos is not None else [])
            tail = tail[: room - 1]  # an answer longer than the window keeps its start and one prompt token
            keep = room - len(tail)
            n_truncated += len(p_ids) > keep
            seqs.append(prefix + list(p_ids[-keep:]) + tail)
            targets.append(tail)
    else:
        for p_ids in prompt_ids:
            n_truncated += len(p_ids) > room
            seqs.append(prefix + list(p_ids[-room:]))

    n = len(seqs)
    width = max((len(s) for s in seqs), default=0)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if padding_side == "right" else slice(width - len(s), width)
        input_ids[i, cols] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, cols] = 1

    meta: dict[str, list] = {}
    if spec.kind == "classification":
        labels = torch.tensor([int(ex["label"]) for ex in examples], dtype=torch.long)
    elif train:
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        for i, (s, tail) in enumerate(zip(seqs, targets, strict=True)):
            end = len(s) if padding_side == "right" else width
            labels[i, end - len(tail) : end] = torch.tensor(tail, dtype=torch.long)
        meta["answers"] = [list(ex["answers"]) for ex in examples]
    else:
        labels = torch.empty((n, 0), dtype=torch.long)
        meta["answers"] = [list(ex["answers"]) for ex in examples]
    return TokenizedTextData(input_ids, attention_mask, labels, meta, padding_side, int(n_truncated))
