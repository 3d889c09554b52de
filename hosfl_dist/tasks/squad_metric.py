"""SQuAD v1.1 scoring: answer normalisation, exact match and token F1, as in the official evaluation script.

The official script (``evaluate-v1.1.py``) normalises both strings (lowercase, drop punctuation, drop the articles
*a*, *an*, *the*, collapse whitespace), scores a prediction against every gold answer and keeps the best score. Per
example the scores are in [0, 1]; :func:`squad_evaluate` averages them and reports percentages, like the script and
the paper's SQuAD table.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")

DEFAULT_STOP_STRINGS: tuple[str, ...] = (
    "\n",
    "</s>",
    "<eos>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
)
"""Where a generated answer ends: a newline, or an end-of-sequence marker of one of the supported model families
(OPT, Gemma-3, Llama-3.2, Qwen3, SmolLM2) that survived decoding."""


def squad_normalize(s: str) -> str:
    """Lowercase, remove punctuation, remove the articles a/an/the and collapse whitespace (SQuAD v1.1)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _f1(prediction: str, ground_truth: str) -> float:
    pred_tokens = squad_normalize(prediction).split()
    gold_tokens = squad_normalize(ground_truth).split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_f1(prediction: str, ground_truths: Sequence[str]) -> float:
    """Token-overlap F1 in [0, 1] of ``prediction`` against the best-matching gold answer (0.0 when there is none)."""
    return max((_f1(prediction, gt) for gt in ground_truths), default=0.0)


def squad_exact_match(prediction: str, ground_truths: Sequence[str]) -> float:
    """1.0 when ``prediction`` equals some gold answer after :func:`squad_normalize`, else 0.0."""
    pred = squad_normalize(prediction)
    return float(any(pred == squad_normalize(gt) for gt in ground_truths))


def squad_evaluate(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean exact match and F1 over a split, in percent: ``{"exact_match": ..., "f1": ...}``."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference answer lists")
    n = max(len(predictions), 1)
    em = sum(squad_exact_match(p, r) for p, r in zip(predictions, references, strict=True))
    f1 = sum(squad_f1(p, r) for p, r in zip(predictions, references, strict=True))
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n}


def extract_answer(generated_text: str, stop_strings: Sequence[str] = DEFAULT_STOP_STRINGS) -> str:
    """The answer in a greedy continuation of a SQuAD prompt: the text before the first stop string, stripped.

    ``generated_text`` is the continuation only (the prompt removed), e.g. ``" Denver Broncos\\nQuestion: ..."``
    gives ``"Denver Broncos"``.
    """
    end = len(generated_text)
    for stop in stop_strings:
        i = generated_text.find(stop)
        if i != -1:
            end = min(end, i)
    return generated_text[:end].strip()
