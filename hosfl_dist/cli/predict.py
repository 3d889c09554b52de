"""``python -m hosfl_dist.predict --model DIR --data FILE.jsonl --out preds.jsonl``: an exported LM on a file;
``python -m hosfl_dist.predict --model DIR --out preds.jsonl``: an exported vision model on its run's evaluation set.

The model is loaded with plain ``transformers`` (``AutoModelForCausalLM.from_pretrained(DIR)``; a ``peft`` export:
its base, then ``PeftModel.from_pretrained(base, DIR)``), the tokenizer from DIR. The task — prompt template, label
words, columns, tokenisation, batch size — comes from the export's ``hosfl_export.json`` (what the run used), each
overridable by a flag, or from the flags alone for a model exported elsewhere. The folder is verified first against
its signed ``hosfl_manifest.json`` (:mod:`hosfl_dist.runfolder.exported`): a damaged or forged one is refused, an
unsigned one (exported elsewhere) read only with ``--allow-unsigned``.

The examples are prompted and tokenised as a run's evaluation does them (:func:`~hosfl_dist.data.text.
tokenize_split`) and batched the same way (consecutive rows, ``--batch-size``, each batch trimmed to its longest
row), so on the run's evaluation file and with the run's batch size the prediction is the run's own:

- classification: the label words' logits at each row's last real token; the prediction is the highest;
- generation: greedy decoding (``generate``, left-padded prompts, at most ``--max-new-tokens``), the answer cut at
  the first stop string as the run's SQuAD scoring does.

Each row of ``--out`` holds the example's index, the prediction, and where the file has the gold column, the gold
and its score; the last line on stdout is a JSON object of the metrics (accuracy, or F1 and exact match).
A vision export (vision.json, :mod:`hosfl_dist.export.vision`) is loaded with :func:`~hosfl_dist.export.vision.
load_vision` and scores the run's evaluation set, rebuilt from the run's config in its ``hosfl_export.json`` with the
run's data code (the same images, order and normalisation; ``--max-examples``: the first N), in batches of the run's
``train.eval_batch_size``: the accuracy is the run's ``eval_accuracy`` of the exported round.

Bad input (no model in DIR, a data file without the template's columns, a label word that is not one token) is one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from hosfl_dist.errors import ConfigError, DataError, HosflError, write_failure

logger = logging.getLogger(__name__)
RECORD = "hosfl_export.json"
"""What an export says about its task (hosfl_dist/export/card.py)."""
VISION = "vision.json"
"""What a vision export holds beside its weights (hosfl_dist/export/vision.py)."""
DEFAULT_BATCH = 8
GOLD = {"classification": "label", "generation": "answers"}


class PredictError(HosflError):
    """Bad input to predict: one line, exit code 2."""


def _record(model_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((model_dir / RECORD).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise PredictError(f"{model_dir / RECORD} is not readable JSON ({exc})") from None
    return record if isinstance(record, dict) else {}


def _label_words(text: str | None) -> list[str] | None:
    """``--label-words``: a JSON list (``'[" terrible", " great"]'``: leading spaces kept) or comma-separated words."""
    if text is None:
        return None
    if text.lstrip().startswith("["):
        try:
            words = json.loads(text)
        except ValueError as exc:
            raise PredictError(f"--label-words {text!r} is not a JSON list ({exc})") from None
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise PredictError(f"--label-words {text!r}: expected a JSON list of strings")
        return words
    return [w for w in text.split(",")]


def _columns(text: str | None) -> dict[str, str] | None:
    """``--columns field=column,…``."""
    if text is None:
        return None
    out = {}
    for pair in text.split(","):
        field, sep, column = pair.partition("=")
        if not sep or not field.strip() or not column.strip():
            raise PredictError(f"--columns {text!r}: expected field=column pairs separated by commas")
        out[field.strip()] = column.strip()
    return out


def task_of(record: dict[str, Any], args: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    """The task spec and column map: the export's, with the flags over it."""
    from hosfl_dist.data.text import custom_task, get_task, is_preset

    task = dict(record.get("task") or {})
    kind = args.kind or task.get("kind")
    template = args.template if args.template is not None else task.get("template") or ""
    words = _label_words(args.label_words)
    words = words if words is not None else task.get("label_words")
    name = task.get("name")
    if kind is None:
        why = f"its {RECORD} names no text task" if record else f"the model folder has no {RECORD}"
        raise PredictError(f"the task is unknown: {why}; give --kind classification|generation, --template (and "
                           "--label-words to classify)")  # fmt: skip
    if is_preset(name) and not args.template and args.kind in (None, task.get("kind")):
        spec = get_task(name)
        if words is not None and words != spec.label_words:
            spec = dataclasses.replace(spec, label_words=list(words))
    else:
        if not template:
            raise PredictError('--template is needed (e.g. "{sentence} It was"): name the file\'s columns as {column}')
        spec = custom_task(kind, template, words)
    if spec.kind == "classification" and not spec.label_words:
        raise PredictError('a classification task needs --label-words (a JSON list, e.g. \'[" bad", " good"]\')')
    columns = _columns(args.columns)
    if columns is None:  # the run's, for the fields this task still has (a --template names its own)
        columns = {k: v for k, v in (task.get("columns") or {}).items() if k in spec.fields}
    return spec, columns


def load_examples(spec: Any, path: Path, columns: dict[str, str], limit: int) -> tuple[list[dict], bool]:
    """The file's examples with the task's fields, and whether it has the gold column (a placeholder gold when not)."""
    from hosfl_dist.data.text import load_text_split, read_local_rows

    rows = read_local_rows(str(path), 1)  # the columns of its first example; the examples are read below, limit first
    if not rows:
        raise DataError(f"{path} has no examples")
    gold = GOLD[spec.kind]
    has_gold = columns.get(gold, gold) in rows[0]
    use = spec if has_gold else dataclasses.replace(spec, fields=tuple(f for f in spec.fields if f != gold))
    if not has_gold:
        columns = {k: v for k, v in columns.items() if k != gold}
    examples = load_text_split(use, "predict", "local", str(path), columns, max_examples=limit or None)
    if not has_gold:
        for ex in examples:
            ex[gold] = 0 if gold == "label" else [""]
    return examples, has_gold


def load_model(model_dir: Path, device: str) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) with plain transformers / peft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hosfl_dist.models.hf_load import transformers_bars

    adapter = model_dir / "adapter_config.json"
    try:
        with transformers_bars(False):
            if adapter.is_file():
                from peft import PeftModel

                base_name = json.loads(adapter.read_text()).get("base_model_name_or_path")
                if not base_name:
                    raise PredictError(f"{adapter} names no base model (base_model_name_or_path)")
                inside = model_dir / base_name  # --copy-base: named by the relative path base, beside the adapter
                if not Path(base_name).is_absolute() and (inside / "config.json").is_file():
                    base_name = str(inside)
                base = AutoModelForCausalLM.from_pretrained(base_name, dtype="auto")
                with warnings.catch_warnings():  # peft asks transformers a question transformers 5 deprecates
                    warnings.simplefilter("ignore", FutureWarning)
                    model = PeftModel.from_pretrained(base, str(model_dir))
            elif (model_dir / "config.json").is_file():
                model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
            else:
                raise PredictError(
                    f"{model_dir} holds no Hugging Face model (config.json), PEFT adapter (adapter_config.json) or "
                    "vision model (vision.json)"
                )
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise PredictError(f"cannot load the model in {model_dir}: {str(exc).splitlines()[0]}") from None
    return model.to(device).eval(), tokenizer


def predict(
    model: Any, tokenizer: Any, spec: Any, examples: list[dict], has_gold: bool, batch_size: int, max_length: int,
    padding_side: str, max_new_tokens: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """(a row per example, the metrics) — see the module docstring. The batches are counted on stderr (a bar on a
    terminal, lines in a file)."""
    import torch

    from hosfl_dist.data.text import label_word_ids, tokenize_split
    from hosfl_dist.runtime.record.progress import Counter
    from hosfl_dist.tasks.classification import classification_logits

    data = tokenize_split(spec, examples, tokenizer, max_length, padding_side, train=False)
    device = next(model.parameters()).device
    out: list[dict[str, Any]] = []
    if spec.kind == "classification":
        ids = label_word_ids(spec, tokenizer)
    batches = -(-len(data) // batch_size)
    logger.info(f"predicting {len(data):,} examples ({spec.name}, {spec.kind}) in {batches:,} batches of {batch_size}")
    counter = Counter(batches, "predict", "batches")
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            idx = list(range(start, min(len(data), start + batch_size)))
            b = data.select(idx, trim=True)
            ids_, mask = b.input_ids.to(device), b.attention_mask.to(device)
            if spec.kind == "classification":
                logits = model(input_ids=ids_, attention_mask=mask).logits
                scores = classification_logits(logits, mask, ids).float().cpu()
                for i, row in zip(idx, scores):
                    k = int(row.argmax())
                    item = {"index": i, "prediction": spec.label_words[k], "label": k, "scores": row.tolist()}
                    if has_gold:
                        gold = int(examples[i]["label"])
                        item.update(gold=gold, correct=k == gold)
                    out.append(item)
            else:
                out += _generate(model, tokenizer, b, idx, examples, has_gold, max_new_tokens)
            counter.update()
    counter.close()
    n = len(out)
    metrics: dict[str, Any] = {"examples": n}
    if has_gold and spec.kind == "classification":
        metrics["accuracy"] = sum(r["correct"] for r in out) / max(n, 1)
    elif has_gold:
        metrics["f1"] = sum(r["f1"] for r in out) / max(n, 1)
        metrics["exact_match"] = sum(r["exact_match"] for r in out) / max(n, 1)
    return out, metrics


def _generate(model, tokenizer, b, idx, examples, has_gold, max_new_tokens):  # noqa: ANN001, ANN202
    """Greedy continuations of one batch, prompts left-padded (every row's newest token in the last column)."""
    from hosfl_dist.tasks.generation import pad_sequences
    from hosfl_dist.tasks.squad_metric import extract_answer, squad_exact_match, squad_f1

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [r[m.bool()].tolist() for r, m in zip(b.input_ids, b.attention_mask)]
    batch = pad_sequences(rows, int(pad if pad is not None else 0), "left")
    ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
    device = next(model.parameters()).device
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    new = max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - width))
    generated = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, do_sample=False,
        pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
    )[:, width:].cpu()  # fmt: skip
    out = []
    for i, tokens in zip(idx, generated):
        text = tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
        item: dict[str, Any] = {"index": i, "prediction": extract_answer(text), "generated": text}
        if has_gold:
            gold = list(examples[i]["answers"])
            pred = item["prediction"]
            item.update(gold=gold, f1=squad_f1(pred, gold), exact_match=squad_exact_match(pred, gold))
        out.append(item)
    return out


EXAMPLES = """\
examples:
  python -m hosfl_dist.predict --model runs/exports/quick_lm --data ../shared/data/sentiment_multiemo/test.jsonl \\
      --out runs/preds.jsonl --max-examples 64      # the run's evaluation (data.eval_max_samples=64): its accuracy
  python -m hosfl_dist.predict --model runs/exports/quick_lm --data reviews.csv --columns sentence=review \\
      --out runs/preds.jsonl                        # a file whose column has another name
  python -m hosfl_dist.predict --model runs/exports/quick_lm --data reviews.jsonl --out runs/preds.jsonl \\
      --template "Review: {text} Sentiment:" --label-words '[" negative", " positive"]'   # another prompt
  python -m hosfl_dist.predict --model runs/exports/quickstart --out runs/preds.jsonl   # vision: the run's eval set
"""
"""What ``--help`` ends with (tests/test_cli.py parses each command)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hosfl_dist.predict",
        description="Predict with an exported language model (python -m hosfl_dist.export) on a JSONL, JSON, CSV, "
        "TSV or parquet file: label-word classification or greedy generation, with plain transformers.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="an export folder (merged, peft or a "
                   "vision state_dict)")  # fmt: skip
    p.add_argument("--data", type=Path, metavar="FILE", help="a language model's examples (.jsonl, .json, .csv, ...); "
                   "a vision export predicts its run's evaluation set (no --data)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, metavar="PREDS.jsonl", help="where the predictions go")
    p.add_argument("--kind", choices=("classification", "generation"), help="default: the export's task")
    p.add_argument("--template", help="the prompt, with {column} fields (default: the export's task's)")
    p.add_argument("--label-words", help="classification: a JSON list or comma-separated words (default: the "
                   "export's); label i is the i-th word")  # fmt: skip
    p.add_argument("--columns", help="field=column,... where the file's column names differ from the task's fields")
    p.add_argument("--batch-size", type=int, help="default: the run's train.eval_batch_size, else 8")
    p.add_argument("--max-length", type=int, help="prompt tokens kept, from the right (default: the run's)")
    p.add_argument("--padding-side", choices=("left", "right"), help="default: the run's data.padding_side")
    p.add_argument("--max-new-tokens", type=int, default=32, help="generation: at most this many tokens (32)")
    p.add_argument("--max-examples", type=int, default=0, help="the first N examples only (0: all)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--allow-unsigned", action="store_true", help="read a model folder without a signed "
                   "hosfl_manifest.json (exported elsewhere or by an earlier version), if you trust whoever could "
                   "write it; a signature mismatch is refused whatever this says")  # fmt: skip
    return p.parse_args(argv)


def predict_text(args: argparse.Namespace, record: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An exported LM on ``--data``, the task from the export's record with the flags over it."""
    if args.data is None:
        raise PredictError(f"--data FILE is needed: the examples for the language model in {args.model}")
    task = record.get("task") or {}
    spec, columns = task_of(record, args)
    examples, has_gold = load_examples(spec, args.data, columns, args.max_examples)
    from hosfl_dist.runtime.record.progress import Steps

    with Steps()(f"loading the model in {args.model}"):
        model, tokenizer = load_model(args.model, args.device)
    return predict(
        model, tokenizer, spec, examples, has_gold,
        batch_size=args.batch_size or task.get("batch_size") or DEFAULT_BATCH,
        max_length=args.max_length or task.get("max_length") or 512,
        padding_side=args.padding_side or task.get("padding_side") or "right",
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip


TEXT_ONLY = ("kind", "template", "label_words", "columns", "max_length", "padding_side")
"""The flags of a language model's task, refused for a vision export."""


def predict_vision(args: argparse.Namespace, record: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An exported vision model on its run's evaluation set (see the module docstring)."""
    given = [f"--{f.replace('_', '-')}" for f in TEXT_ONLY if getattr(args, f) is not None]
    if given:
        raise PredictError(f"{', '.join(given)}: for a language model; {args.model} holds a vision model")
    if args.data is not None:
        raise PredictError(f"--data {args.data}: a vision export predicts its run's evaluation set (give no --data); "
                           "files of images are not read")  # fmt: skip
    from hosfl_dist.export.vision import evaluation_set, load_verified, predict_images
    from hosfl_dist.runtime.record.progress import Counter, Steps

    with Steps()(f"loading the model in {args.model} and its run's evaluation set"):
        model = load_verified(args.model, args.device)
        inputs, labels, transform = evaluation_set(record, args.max_examples)
    batch = args.batch_size or ((record.get("config") or {}).get("train") or {}).get("eval_batch_size") or DEFAULT_BATCH
    batches = -(-len(labels) // batch)
    logger.info(f"predicting {len(labels):,} images in {batches:,} batches of {batch}")
    counter = Counter(batches, "predict", "batches")
    try:
        return predict_images(model, inputs, labels, transform, batch, counter.update)
    finally:
        counter.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hosfl_dist.logs import init_logging

    init_logging("predict")  # its steps and batches on stderr; the metrics' JSON alone on stdout
    start = time.perf_counter()
    try:
        for flag in ("batch_size", "max_length", "max_new_tokens", "max_examples"):
            value = getattr(args, flag)
            if value is not None and (value < 0 or (value == 0 and flag in ("batch_size", "max_length"))):
                raise PredictError(f"--{flag.replace('_', '-')} {value}: expected a positive number")
        import torch

        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise PredictError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise PredictError(f"--device {args.device}: expected cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise PredictError(f"--device {args.device}: this machine has no CUDA device")
        from hosfl_dist.safe_files import check_input_file, check_output_file

        check_output_file(args.out, "--out", in_export=False)  # never a device, a FIFO, a link out, an export's file
        if args.data is not None:
            check_input_file(args.data, "--data", DataError)  # a FIFO or /dev/zero: refused before it is opened
        if args.data is not None and args.out.resolve() == args.data.resolve():
            raise PredictError(f"--out {args.out} is the --data file: the predictions would replace the examples")
        from hosfl_dist.runfolder.folder import run_in_the_way

        run = run_in_the_way(args.out)
        if run is not None:  # a run's metrics.jsonl or checkpoint replaced by predictions
            raise PredictError(f"--out {args.out} is inside the run folder {run}: write the predictions elsewhere")
        from hosfl_dist.runfolder.exported import verify_export
        from hosfl_dist.runfolder.signing import load_key

        if not args.model.is_dir():
            raise PredictError(f"--model {args.model} is not a folder")
        target = args.out.resolve()
        if target.is_relative_to(args.model.resolve()):  # a file added to an export breaks its manifest
            raise PredictError(f"--out {args.out} lies inside the --model folder: write the predictions elsewhere")
        verify_export(args.model, load_key(), args.allow_unsigned)  # before a file of it is read
        record = _record(args.model)
        if (args.model / VISION).is_file():
            rows, metrics = predict_vision(args, record)
        else:
            rows, metrics = predict_text(args, record)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(f".{args.out.name}.partial")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(args.out)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves --out as it was and nothing beside it
            raise
    except KeyboardInterrupt:
        what = args.data if args.data is not None else "the run's evaluation set"
        print(f"interrupted: predicting {what} with {args.model} stopped by Ctrl-C; --out {args.out} is as it "
              "was: run the same command again", file=sys.stderr)  # fmt: skip
        return 130
    except (HosflError, ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        failure = write_failure(exc, args.out)
        where = f" ({exc.filename})" if exc.filename else ""
        said = str(failure) if failure is not None else f"{exc.strerror or exc}{where}"
        print(f"error: {said}", file=sys.stderr)
        return 2
    metrics.update(out=str(args.out), seconds=round(time.perf_counter() - start, 2))
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
