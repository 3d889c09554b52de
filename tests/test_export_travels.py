"""An export travels whole (issue 44, item 3): its card's snippet scores as the run did with plain transformers in an
interpreter that cannot import hosfl_dist, and predict takes a vision export to the run's accuracy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_export import last_line, split_scores
from tiny import TINY_OVERRIDES, lm_overrides, run_in_process, write_text_files

from hosfl_dist.cli.predict import main as predict_main
from hosfl_dist.export.cli import main as export_main

EVAL = 12  # three batches of 4
MAX_LENGTH = 12  # shorter than every prompt of the tiny reviews: each loses its start

NO_HOSFL = """\
import sys


class _NoHosfl:  # this interpreter cannot import hosfl_dist, whatever its site-packages hold (an editable install)
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "hosfl_dist" or name.startswith("hosfl_dist."):
            raise ModuleNotFoundError(f"No module named {name!r}")


sys.meta_path.insert(0, _NoHosfl)
try:
    import hosfl_dist  # noqa: F401
except ModuleNotFoundError:
    print("hosfl_dist: not importable")
"""


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """$HOSFL_CACHE of this module (the base a tiny peft export writes once), not the user's."""
    import os

    old = os.environ.get("HOSFL_CACHE")
    os.environ["HOSFL_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("HOSFL_CACHE", None)
    else:
        os.environ["HOSFL_CACHE"] = old


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A tiny Llama run whose evaluation prompts are all longer than data.max_length."""
    files = write_text_files(tmp_path_factory.mktemp("text"))
    out = tmp_path_factory.mktemp("lm") / "run"
    overrides = [*lm_overrides(out, files), f"data.eval_max_samples={EVAL}", f"data.max_length={MAX_LENGTH}"]
    _, _, summary, rows = run_in_process(overrides)
    assert summary["status"] == "completed"
    return out, files, rows


def snippet(card: str) -> str:
    """The ```python block of the card's "Score as the run did" section."""
    section = card.split("## Score as the run did", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def run_card_snippet(out: Path, cwd: Path, last: str) -> list[str]:
    """The export ``out``'s card snippet, then ``last``, in a fresh ``python -I`` where hosfl_dist cannot be imported
    (asserted): its output lines."""
    code = snippet((out / "README.md").read_text()).replace('"DIR"', repr(str(out)), 1)
    code = NO_HOSFL + code + "\n" + last + "\n"
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "hosfl_dist: not importable"
    return lines


@pytest.mark.parametrize("fmt", ["merged", pytest.param("peft", marks=pytest.mark.slow)])  # peft: 9-18 s (its base)
def test_the_cards_snippet_scores_long_prompts_as_the_run_did_without_hosfl_dist(tmp_path, capsys, long_run, fmt):
    run_dir, files, rows = long_run
    out = tmp_path / fmt
    assert export_main([str(run_dir), "--out", str(out), "--format", fmt]) == 0
    err = capsys.readouterr().err
    assert "reading the frozen base weights" in err and "GGUF" not in err, err  # a tiny base: nothing de-quantised
    assert predict_main(["--model", str(out), "--out", str(tmp_path / "p.jsonl")]) == 2
    assert "--data FILE is needed" in capsys.readouterr().err
    task = json.loads((out / "hosfl_export.json").read_text())["task"]
    assert task["truncation_side"] == "left" and task["max_length"] == MAX_LENGTH and task["padding_side"] == "right"
    assert task["template"] == "{sentence} It was" and task["label_words"] == [" terrible", " great"]
    assert task["columns"] == {"sentence": "review", "label": "y"} and task["eval_max_samples"] == EVAL

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert task["label_word_ids"] == [tok(" terrible" if i == 0 else " great", add_special_tokens=False)["input_ids"][0]
                                      for i in range(2)]  # fmt: skip
    reviews = [json.loads(line)["review"] for line in (files / "sst2.jsonl").read_text().splitlines()[:EVAL]]
    lengths = [len(task["special_prefix_ids"]) + len(tok(f"{r} It was", add_special_tokens=False)["input_ids"])
               for r in reviews]  # fmt: skip
    assert min(lengths) > MAX_LENGTH, lengths  # every evaluation prompt is cut: the truncation side decides

    lines = run_card_snippet(out, tmp_path, 'print(json.dumps({"labels": labels, "scores": scores}))')
    assert lines[-2] == f"accuracy {rows[-1]['eval_accuracy']}"  # the run's last evaluation, exactly
    got = json.loads(lines[-1])
    reference = split_scores(run_dir)  # the run's own split model on its evaluation batches
    assert got["labels"] == reference.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(got["scores"]), reference, rtol=0, atol=1e-6 if fmt == "peft" else 1e-5)


def test_predict_takes_a_vision_export_to_the_runs_accuracy(tmp_path, capsys, caplog):
    """predict on a vision export scores its run's evaluation set (rebuilt from the config its record holds) to the
    run's final accuracy; the export never speaks of GGUF; the flags of a text task are refused in one line."""
    _, _, summary, rows = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'run'}"])
    out = tmp_path / "vision"
    assert export_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "restoring checkpoint" in err and "GGUF" not in err and "quantis" not in err, err  # no GGUF base here
    capsys.readouterr()
    assert predict_main(["--model", str(out), "--out", str(tmp_path / "preds.jsonl")]) == 0
    got = json.loads(last_line(capsys.readouterr().out))
    preds = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert got["examples"] == len(preds) > 0 and got["accuracy"] == summary["final"]["eval_accuracy"]
    assert got["accuracy"] == rows[-1]["eval_accuracy"]
    assert [p["index"] for p in preds] == list(range(len(preds))) and all(p["correct"] == (p["prediction"] == p["gold"])
                                                                          for p in preds)  # fmt: skip
    assert "predict: 2/2 batches (100%)" in caplog.text  # 500 images, train.eval_batch_size 250

    # the first 10 images only, in batches of 3: the same predictions for those
    assert predict_main(["--model", str(out), "--out", str(tmp_path / "p10.jsonl"), "--max-examples", "10",
                         "--batch-size", "3"]) == 0  # fmt: skip
    first = [json.loads(line) for line in (tmp_path / "p10.jsonl").read_text().splitlines()]
    assert [p["prediction"] for p in first] == [p["prediction"] for p in preds[:10]]

    capsys.readouterr()
    for extra, said in ((["--template", "{x}"], "--template: for a language model"),
                        (["--data", str(tmp_path / "x.jsonl")], "predicts its run's evaluation set")):  # fmt: skip
        assert predict_main(["--model", str(out), "--out", str(tmp_path / "q.jsonl"), *extra]) == 2
        message = capsys.readouterr().err.strip()
        assert said in message and len(message.splitlines()) == 1, message
    # the record is there but names no text task (vision.json gone): said as it is, not "has no hosfl_export.json"
    (out / "vision.json").unlink()
    (out / "hosfl_manifest.json").unlink()
    text = tmp_path / "x.jsonl"
    text.write_text('{"sentence": "a film."}\n')
    assert predict_main(["--model", str(out), "--data", str(text), "--out", str(tmp_path / "q.jsonl"),
                         "--allow-unsigned"]) == 2  # fmt: skip
    message = capsys.readouterr().err.strip()
    assert "its hosfl_export.json names no text task" in message and "has no hosfl_export.json" not in message


@pytest.mark.slow  # ~25 s: a tiny-Qwen3 SQuAD run, and greedy decoding twice
def test_the_cards_snippet_answers_as_predict_does(tmp_path, capsys):
    """Generation: the card's snippet (no hosfl_dist) gives the answers predict gives, whose F1 is the run's."""
    files = write_text_files(tmp_path)
    overrides = lm_overrides(tmp_path / "run", files, task="squad", arch="qwen3")
    _, _, summary, rows = run_in_process([*overrides, "data.eval_max_samples=4", "train.eval_batch_size=2",
                                          "data.max_length=24"])  # fmt: skip
    out = tmp_path / "export"
    assert export_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert predict_main(["--model", str(out), "--data", str(files / "squad.jsonl"), "--out", str(tmp_path / "p.jsonl"),
                         "--max-examples", "4"]) == 0  # fmt: skip
    got = json.loads(last_line(capsys.readouterr().out))
    assert got["f1"] == pytest.approx(rows[-1]["eval_f1"], abs=1e-12)
    predicted = [json.loads(line)["prediction"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert any(predicted)  # answers to compare, not empty strings

    lines = run_card_snippet(out, tmp_path, "print(json.dumps(answers))")
    assert json.loads(lines[-1]) == predicted
