"""User-defined text tasks from the config (data.name=custom): a prompt template over the file's columns and any
number of label words, or a generation task scored by F1 / EM; no code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny import lm_overrides, run_in_process

from hosfl_dist.config import load_config
from hosfl_dist.data import build_data
from hosfl_dist.data.text import custom_task, format_example, get_task, load_text_split
from hosfl_dist.errors import ConfigError, DataError
from hosfl_dist.runtime.build import data_sections

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
    data = build_data(data_sections(cfg))
    assert data.info["num_classes"] == 3 and len(set(data.info["label_word_ids"])) == 3
    assert sorted(set(data.train_labels.tolist())) == [0, 1, 2]


def test_labels_may_be_the_label_words_or_their_indices(tmp_path):
    by_word = build_data(data_sections(load_config(None, custom(tmp_path, nli_file(tmp_path, "index")))))
    words_file = tmp_path / "w" / "nli.jsonl"
    words_file.parent.mkdir()
    rows = [{"premise": p, "hypothesis": h, "gold": {"entailment": "True", "neutral": "Neither",
                                                     "contradiction": "False"}[g]} for p, h, g in NLI]  # fmt: skip
    words_file.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    by_index = build_data(data_sections(load_config(None, custom(tmp_path, words_file))))
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
        build_data(data_sections(load_config(None, [*custom(tmp_path, path), "data.template=no fields"])))
    with pytest.raises(DataError, match=r"no column 'hypo'"):
        build_data(data_sections(load_config(None, [*custom(tmp_path, path), "data.template={premise} {hypo}"])))
    with pytest.raises(DataError, match=r"label 3; custom labels are 0\.\.2 or one of the label words"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"premise": "a", "hypothesis": "b", "gold": 3}) + "\n")
        build_data(data_sections(load_config(None, [*custom(tmp_path, path), f"data.train_path={bad}"])))
    with pytest.raises(DataError, match=r"has no examples"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        build_data(data_sections(load_config(None, [*custom(tmp_path, path), f"data.train_path={empty}"])))


def test_a_label_is_an_integer_or_a_label_word_never_a_boolean(tmp_path):
    """JSON true is not label 1 (here " Neither"); a float column's 1.0 is label 1 (parquet, pandas), 1.5 is none."""
    spec = custom_task("classification", TEMPLATE, [" True", " Neither", " False"])
    path = tmp_path / "gold.jsonl"

    def labels(*values: object) -> list[int]:
        path.write_text("".join(json.dumps({"premise": "P.", "hypothesis": "H.", "label": v}) + "\n" for v in values))
        return [ex["label"] for ex in load_text_split(spec, "train", "local", str(path), None)]

    assert labels(0, 2, "1", " 2 ", "False", "Neither", 1.0) == [0, 2, 1, 2, 2, 1, 1]
    bad_labels = [(True, "true"), (False, "false"), (1.5, "1.5"), ("1_0", "'1_0'"), ("1.0", "'1.0'"), (None, "None")]
    for bad, shown in bad_labels:
        with pytest.raises(DataError) as exc:
            labels(0, bad)
        assert str(exc.value) == (f"{path}: example 1 has label {shown}; custom labels are 0..2 or one of the label "
                                  "words ['True', 'Neither', 'False']")  # fmt: skip
    sst2 = tmp_path / "sst2.jsonl"  # a preset too; only WSC's files write booleans (true = 1, "Yes")
    sst2.write_text(json.dumps({"sentence": "A film.", "label": True}) + "\n")
    with pytest.raises(DataError, match=r"example 0 has label true; sst2 labels are 0\.\.1$"):
        load_text_split("sst2", "train", "local", str(sst2), None)


def test_predict_refuses_a_boolean_gold_label_in_one_line(tmp_path, capsys):
    from hosfl_dist.predict import main as predict_main

    data = tmp_path / "gold.jsonl"
    data.write_text(json.dumps({"text": "A film.", "label": 1}) + "\n" + json.dumps({"text": "Dull.", "label": True}))
    (tmp_path / "model").mkdir()  # --out never inside --model
    argv = ["--model", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "p.jsonl"),
            "--kind", "classification", "--template", "{text} It was", "--label-words", "bad,good",
            "--allow-unsigned"]  # fmt: skip  (no export there: accepted, so that the examples are read)
    assert predict_main(argv) == 2  # refused while reading the examples, before any model is looked for
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {data}: example 1 has label true; custom labels are 0..1 or one of the label words "
                   "['bad', 'good']"]  # fmt: skip
    assert not (tmp_path / "p.jsonl").exists()
