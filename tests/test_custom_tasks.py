"""User-defined text tasks from the config (data.name=custom): a prompt template over the file's columns and any
number of label words, or a generation task scored by F1 / EM; no code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny import lm_overrides, run_in_process

from hosfl_dist.config import load_config
from hosfl_dist.data import build_data
from hosfl_dist.data.text import custom_task, format_example, get_task
from hosfl_dist.errors import ConfigError, DataError

NLI = [
    ("A man is sleeping.", "A man rests.", "entailment"),
    ("A dog runs in a park.", "An animal is outside.", "entailment"),
    ("Two kids play chess.", "The kids are asleep.", "contradiction"),
    ("A woman cooks dinner.", "She is a chef.", "neutral"),
    ("The street is empty.", "Cars fill the street.", "contradiction"),
    ("A boy reads a book.", "The book is about dogs.", "neutral"),
]
TEMPLATE = "{premise}\nQuestion: {hypothesis} True, False or Neither? Answer:"
WORDS = ["[ True, Neither, False]"]


def nli_file(folder: Path, labels: str = "words") -> Path:
    names = ["entailment", "neutral", "contradiction"]
    rows = [{"premise": p, "hypothesis": h, "gold": g if labels == "words" else names.index(g)} for p, h, g in NLI]
    path = folder / "nli.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    return path


def custom(tmp_path: Path, path: Path, *extra: str) -> list[str]:
    return [
        *lm_overrides(tmp_path / "run", tmp_path, arch="qwen3"),
        "data.name=custom",
        "data.task=classification",
        f"data.template={json.dumps(TEMPLATE)}",
        'data.label_words=[" True", " Neither", " False"]',
        "data.columns={label: gold}",
        f"data.train_path={path}",
        f"data.eval_path={path}",
        *extra,
    ]


def test_a_three_way_task_from_a_jsonl_file_trains_end_to_end(tmp_path):
    path = nli_file(tmp_path, labels="index")
    cfg, _, summary, rows = run_in_process(custom(tmp_path, path))
    assert summary["status"] == "completed" and len(rows) == 3
    assert 0.0 <= rows[-1]["eval_accuracy"] <= 1.0 and rows[-1]["train_loss"] is not None
    data = build_data(cfg)
    assert data.info["num_classes"] == 3 and len(set(data.info["label_word_ids"])) == 3
    assert sorted(set(data.train_labels.tolist())) == [0, 1, 2]


def test_labels_may_be_the_label_words_or_their_indices(tmp_path):
    by_word = build_data(load_config(None, custom(tmp_path, nli_file(tmp_path, "index"))))
    words_file = tmp_path / "w" / "nli.jsonl"
    words_file.parent.mkdir()
    rows = [{"premise": p, "hypothesis": h, "gold": {"entailment": "True", "neutral": "Neither",
                                                     "contradiction": "False"}[g]} for p, h, g in NLI]  # fmt: skip
    words_file.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    by_index = build_data(load_config(None, custom(tmp_path, words_file)))
    assert by_word.train_labels.tolist() == by_index.train_labels.tolist()


def test_the_template_renders_the_file_columns():
    spec = custom_task("classification", TEMPLATE, [" True", " Neither", " False"])
    prompt, target = format_example(spec, {"premise": "P.", "hypothesis": "H.", "label": 2})
    assert prompt == "P.\nQuestion: H. True, False or Neither? Answer:" and target == " False"
    gen = custom_task("generation", "Q: {question}\nA:", None)
    assert format_example(gen, {"question": "Why?", "answers": ["Because"]}) == ("Q: Why?\nA:", " Because")
    assert get_task("sst2").template == ""  # the presets keep their own prompts


def test_bad_custom_tasks_fail_with_one_line_naming_what_is_wrong(tmp_path):
    path = nli_file(tmp_path, "index")
    with pytest.raises(ConfigError, match=r"data\.task"):
        load_config(None, [o for o in custom(tmp_path, path) if not o.startswith("data.task")])
    with pytest.raises(ConfigError, match=r"data\.label_words.*two or more"):
        load_config(None, [*custom(tmp_path, path), 'data.label_words=[" yes"]'])
    with pytest.raises(ConfigError, match=r"data\.template.*applies to data.name=custom"):
        load_config(None, [*lm_overrides(tmp_path, tmp_path), 'data.template="{x}"'])
    with pytest.raises(ConfigError, match=r"expected a string; quote text that starts with"):
        load_config(None, [*custom(tmp_path, path), "data.template={premise}"])  # YAML reads a mapping
    with pytest.raises(ConfigError, match=r"data\.template"):
        build_data(load_config(None, [*custom(tmp_path, path), "data.template=no fields"]))
    with pytest.raises(DataError, match=r"no column 'hypo'"):
        build_data(load_config(None, [*custom(tmp_path, path), "data.template={premise} {hypo}"]))
    with pytest.raises(DataError, match=r"label 3; custom labels are 0\.\.2 or one of the label words"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"premise": "a", "hypothesis": "b", "gold": 3}) + "\n")
        build_data(load_config(None, [*custom(tmp_path, path), f"data.train_path={bad}"]))
    with pytest.raises(DataError, match=r"has no examples"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        build_data(load_config(None, [*custom(tmp_path, path), f"data.train_path={empty}"]))
