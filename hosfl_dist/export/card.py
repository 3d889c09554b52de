"""What an export says about itself: the model card (README.md) and hosfl_export.json (the same facts for programs:
``python -m hosfl_dist.predict`` takes the task's prompt, label words and batching from it).

Everything comes from the run's own record: config.yaml (resolved), summary.json (inputs with their SHA-256, the
fingerprint, the code, final and best metrics, traffic) and the metrics row of the exported round.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hosfl_dist.export.restore import CONFIG, Restored, metrics_rows

RECORD = "hosfl_export.json"
METHODS = {
    "hosfl": "HO-SFL (zeroth-order client, first-order server, P-scalar aggregation)",
    "sfl": "SFL (SplitFed, first order on both sides)",
    "splitlora": "SplitLoRA (SplitFed with LoRA on both sides)",
    "fsl_sage": "FSL-SAGE",
    "zo_sfl": "ZO-SFL (zeroth order on both sides)",
    "mu_splitfed": "MU-SplitFed",
    "frozen_client": "HO-SFL with the client frozen (the server-only reference: f_c at its initial weights)",
}


def task_record(restored: Restored, tokenizer: Any = None) -> dict[str, Any] | None:
    """The text task as predict and a reader without hosfl_dist need it (None for vision): prompt, label words (and,
    given the export's ``tokenizer``, their token ids), columns, tokenisation (truncation side, special prefix, pad
    id), batching and how the run scored each example."""
    cfg = restored.cfg
    if cfg.model.name != "hf":
        return None
    from hosfl_dist.data.text import SENTIMENT_COLUMNS, prompt_code, prompt_template
    from hosfl_dist.data.text_fed import task_spec
    from hosfl_dist.tasks.generation import MAX_NEW_TOKENS
    from hosfl_dist.tasks.squad_metric import DEFAULT_STOP_STRINGS

    spec = task_spec(cfg.data)
    columns = dict(cfg.data.columns) or (dict(SENTIMENT_COLUMNS) if cfg.data.name == "sentiment_multiemo" else {})
    template, note = prompt_template(spec)
    record = {
        "data": cfg.data.name,
        "name": spec.name,
        "kind": spec.kind,
        "template": template,
        "template_note": note,
        "label_words": spec.label_words,
        "stop_strings": list(DEFAULT_STOP_STRINGS) if spec.kind == "generation" else [],
        "columns": columns,
        "max_length": cfg.data.max_length,
        "padding_side": cfg.data.padding_side,
        "batch_size": cfg.train.eval_batch_size,
        "eval_max_samples": cfg.data.eval_max_samples,
        # what follows: enough to score as the run did with plain transformers (the card's snippet does it)
        "prompt_code": prompt_code(spec),
        "truncation_side": "left",
        "truncation": TRUNCATION,
        "add_special_tokens": False,
        "eval_path": _eval_path(cfg.data),
        "scoring": SCORING[spec.kind],
    }
    if spec.kind == "generation":
        record["max_new_tokens"] = MAX_NEW_TOKENS
    if tokenizer is not None:
        from hosfl_dist.data.text import label_word_ids, padding_id, special_prefix

        record["special_prefix_ids"] = special_prefix(tokenizer)
        record["pad_token_id"] = padding_id(tokenizer)
        record["eos_token_id"] = tokenizer.eos_token_id
        if spec.kind == "classification":
            record["label_word_ids"] = label_word_ids(spec, tokenizer)
    return record


def _eval_path(data: Any) -> str | None:
    """The run's evaluation file (absolute; None for a hub data set or one that cannot be found from here)."""
    from hosfl_dist.data.text_fed import text_files
    from hosfl_dist.errors import HosflError

    try:
        files = text_files(data)
    except HosflError:
        return None
    return str(Path(files[1]).resolve()) if files else None


TRUNCATION = ("the prompt is tokenised without special tokens; a sequence is the tokenizer's special prefix tokens "
              "(special_prefix_ids: BOS) then the prompt's LAST max_length - len(special_prefix_ids) tokens: a long "
              "prompt loses tokens from its left (the start of the text), so the template's end survives")  # fmt: skip
"""How a run cuts a prompt to ``data.max_length`` (:func:`hosfl_dist.data.text.tokenize_split`)."""
SCORING = {
    "classification": "consecutive examples in batches of batch_size, each padded (pad_token_id, on padding_side) "
    "to its longest sequence, no position_ids given; one forward pass; the next-token logits at each row's last real "
    "token (the last position where attention_mask is 1), at label_word_ids (each label word's first token as it "
    "follows the prompt); the prediction is the label of the highest; accuracy is the fraction equal to the gold label",
    "generation": "greedy decoding (no sampling) of at most max_new_tokens tokens after each prompt, prompts "
    "left-padded; the answer is the continuation before the first of stop_strings, stripped; scored against the gold "
    "answers by SQuAD's F1 and exact match (the best over the gold answers)",
}
"""How a run scores an evaluation example, by task kind (hosfl_dist/tasks, hosfl_dist/cli/predict.py does the same)."""


def exported_row(restored: Restored) -> dict[str, Any] | None:
    """The run's evaluation of the exported weights: the metrics row of the checkpoint's round, if one was taken."""
    rows = [r for r in metrics_rows(restored.run_dir) if r.get("round") == restored.round]
    return rows[-1] if rows else None


def write_record(restored: Restored, out: Path, written: dict[str, Any], command: str) -> dict[str, Any]:
    """hosfl_export.json in ``out`` (the label words' ids from the tokenizer written there, as a reader loads it)."""
    from hosfl_dist.config.dump import config_to_dict

    cfg = restored.cfg
    tokenizer = None
    if cfg.model.name == "hf":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out))
    record = {
        **written,
        "command": command,
        "run_dir": str(restored.run_dir.resolve()),
        "checkpoint": restored.checkpoint.name,
        "round": restored.round,
        "processed_samples": restored.processed,
        "algorithm": cfg.algorithm.name,
        "model": {
            "name": cfg.model.name,
            "source": cfg.model.source,
            "gguf_file": cfg.model.gguf_file,
            "dtype": cfg.model.dtype,
            "cut": cfg.split.cut,
        },  # fmt: skip
        "task": task_record(restored, tokenizer),
        "metrics": exported_row(restored),
        "fingerprint": restored.summary.get("fingerprint"),
        "config": config_to_dict(cfg),  # the run's resolved config: predict rebuilds a vision run's evaluation set
    }
    (out / RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def write_card(restored: Restored, out: Path, record: dict[str, Any]) -> None:
    (out / "README.md").write_text(model_card(restored, record))


def model_card(restored: Restored, record: dict[str, Any]) -> str:
    cfg, summary = restored.cfg, restored.summary
    fmt = record["format"]
    hub = cfg.model.name == "hf" and record.get("base_hub")
    library = "peft" if fmt == "peft" else "transformers" if cfg.model.name == "hf" else "pytorch"
    front = ["---", f"library_name: {library}"]
    if hub:
        front.append(f"base_model: {hub}")
    front += ["tags: [split-federated-learning, hosfl_dist, " + cfg.algorithm.name + "]", "---", ""]
    title = cfg.model.source if cfg.model.name == "hf" else cfg.model.name
    lines = [
        *front,
        f"# {title} fine-tuned with {METHODS.get(cfg.algorithm.name, cfg.algorithm.name)}",
        "",
        f"Exported by `{record['command']}` from checkpoint `{restored.checkpoint.name}` (round {restored.round}, "
        f"{restored.processed:,} processed samples) of the run in `{restored.run_dir.resolve()}`, whose summary says "
        f"`{summary.get('status', 'unknown')}`.",
        "",
        "## Load",
        "",
        "```python",
        *_load_snippet(fmt, record),
        "```",
        "",
        *_score_section(record),
        "## Base model",
        "",
        *_table([("model.source", cfg.model.source), *_base_rows(cfg, summary)]),
        "",
        "## Method",
        "",
        *_table(_method_rows(cfg)),
        "",
        "## Data",
        "",
        *_table(_data_rows(cfg, summary, record)),
        "",
        "## Results",
        "",
        *_results(restored, record),
        "",
        "## Traffic (bytes, whole run)",
        "",
        *_traffic(summary),
        "",
        "## Provenance",
        "",
        *_table(_provenance_rows(restored, summary)),
        "",
        "## Resolved config (config.yaml)",
        "",
        "```yaml",
        (restored.run_dir / CONFIG).read_text().rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _load_snippet(fmt: str, record: dict[str, Any]) -> list[str]:
    if fmt == "merged":
        return [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'model = AutoModelForCausalLM.from_pretrained("DIR")',
            'tokenizer = AutoTokenizer.from_pretrained("DIR")',
        ]
    if fmt == "peft":
        base = record["base"]
        inside = base.endswith("/")
        where = '"DIR/base"' if inside else repr(base)
        auto = ("# or, in DIR (the base is named by the relative path base):" if inside else
                "# or, the base named in adapter_config.json:")  # fmt: skip
        return [
            "from peft import AutoPeftModelForCausalLM, PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"base = AutoModelForCausalLM.from_pretrained({where})",
            'model = PeftModel.from_pretrained(base, "DIR")',
            auto,
            'model = AutoPeftModelForCausalLM.from_pretrained("DIR")' if not inside else
            'model = AutoPeftModelForCausalLM.from_pretrained(".")',
            'tokenizer = AutoTokenizer.from_pretrained("DIR")',
        ]  # fmt: skip
    return [
        "from hosfl_dist.export import load_vision",
        'model = load_vision("DIR")   # eval mode; inputs normalised as vision.json says',
        "# the run's evaluation set, scored: python -m hosfl_dist.predict --model DIR --out preds.jsonl",
    ]


def _score_section(record: dict[str, Any]) -> list[str]:
    """The card's "Score as the run did" section: a snippet that needs only torch and transformers."""
    task = record.get("task")
    if not task or "special_prefix_ids" not in task:
        return []
    return [
        "## Score as the run did",
        "",
        "Plain `transformers`, no hosfl_dist: the run's prompt, label words, truncation (from the LEFT: a long prompt "
        "keeps its end), padding, batching and scoring, so that on the run's evaluation examples the predictions are "
        f"the run's own. `hosfl_export.json` holds the same facts (`task`). {task['scoring'][0].upper()}"
        f"{task['scoring'][1:]}.",
        "",
        "```python",
        *score_snippet(record),
        "```",
        "",
    ]


def score_snippet(record: dict[str, Any]) -> list[str]:
    """The lines of a script that scores examples exactly as the run's evaluation did (``DIR``: the export)."""
    task = record["task"]
    fields = [f for f in _fields(task) if f not in ("label", "answers")]
    gold = "label" if task["kind"] == "classification" else "answers"
    if record["format"] == "merged":
        load = ['model = AutoModelForCausalLM.from_pretrained(DIR, dtype="auto").eval()']
    else:
        where = 'DIR + "/base"' if record["base"].endswith("/") else repr(record["base"])
        load = [f'base = AutoModelForCausalLM.from_pretrained({where}, dtype="auto")',
                "model = PeftModel.from_pretrained(base, DIR).eval()"]  # fmt: skip
    lines = [
        "import json",
        "",
        "import torch",
        *(["from peft import PeftModel"] if record["format"] == "peft" else []),
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'DIR = "DIR"  # this folder',
        *load,
        "tokenizer = AutoTokenizer.from_pretrained(DIR)",
        "",
        f"TEMPLATE = {task['template']!r}  # the prompt, str.format of the fields {fields}",
        f"COLUMNS = {task['columns']!r}  # field: the column of the run's files that holds it",
    ]
    if task["kind"] == "classification":
        lines += [
            f"LABEL_WORDS = {task['label_words']!r}  # label i is LABEL_WORDS[i]",
            f"LABEL_IDS = {task['label_word_ids']!r}  # each word's first token as it follows the prompt",
        ]
    else:
        lines += [
            f"STOP_STRINGS = {task['stop_strings']!r}  # the answer ends at the first",
            f"MAX_NEW_TOKENS = {task['max_new_tokens']}",
            f"EOS_ID = {task['eos_token_id']!r}",
        ]
    lines += [
        f"PREFIX = {task['special_prefix_ids']!r}  # the tokenizer's special tokens before a text (BOS)",
        f"MAX_LENGTH = {task['max_length']}  # PREFIX + the prompt's LAST MAX_LENGTH - len(PREFIX) tokens",
        f"TRUNCATION_SIDE = {task['truncation_side']!r}  # a long prompt loses its start, keeps the template's end",
        f"PADDING_SIDE = {task['padding_side']!r}"
        if task["kind"] == "classification"
        else 'PADDING_SIDE = "left"  # generation: prompts left-padded, every row\'s newest token in the last column',
        f"PAD_ID = {task['pad_token_id']}",
        f"BATCH_SIZE = {task['batch_size']}  # the run's train.eval_batch_size: consecutive examples, padded per batch",
        f"EVAL_PATH = {task.get('eval_path')!r}  # the run's evaluation file (data.eval_path)",
        f"EVAL_MAX_SAMPLES = {task['eval_max_samples']}  # its first rows the run scored (0: all)",
        "",
        "",
        "def prompt(ex):  # ex: a dict of the task's fields",
        f"    return {task['prompt_code']}",
        "",
        "",
        "def encode(ex):",
        '    ids = tokenizer(prompt(ex), add_special_tokens=False)["input_ids"]',
        "    return PREFIX + ids[-(MAX_LENGTH - len(PREFIX)):]  # truncation from the left",
        "",
        "",
        "def batch(examples):",
        "    seqs = [encode(ex) for ex in examples]",
        "    width = max(len(s) for s in seqs)",
        "    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)",
        "    mask = torch.zeros((len(seqs), width), dtype=torch.long)",
        "    for i, s in enumerate(seqs):",
        '        cols = slice(0, len(s)) if PADDING_SIDE == "right" else slice(width - len(s), width)',
        "        ids[i, cols], mask[i, cols] = torch.tensor(s), 1",
        "    return ids, mask",
        "",
        "",
    ]
    if task["kind"] == "classification":
        lines += [
            "def classify(examples):",
            '    """-> (predicted labels, the label words\' logits) of each example."""',
            "    labels, scores = [], []",
            "    for start in range(0, len(examples), BATCH_SIZE):",
            "        ids, mask = batch(examples[start : start + BATCH_SIZE])",
            "        with torch.no_grad():",
            "            logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V), no position_ids",
            "        last = (mask * torch.arange(mask.shape[1])).argmax(1)  # each row's last real token",
            "        s = logits[torch.arange(len(ids)), last][:, LABEL_IDS].float()  # (B, len(LABEL_WORDS))",
            "        labels += s.argmax(-1).tolist()",
            "        scores += s.tolist()",
            "    return labels, scores",
            "",
            "",
        ]
    else:
        lines += [
            "def answer(examples):",
            '    """-> the greedy answer of each example, cut at the first stop string."""',
            "    out = []",
            "    limit = getattr(model.config.get_text_config(), 'max_position_embeddings', None)",
            "    for start in range(0, len(examples), BATCH_SIZE):",
            "        ids, mask = batch(examples[start : start + BATCH_SIZE])",
            "        new = MAX_NEW_TOKENS if limit is None else max(0, min(MAX_NEW_TOKENS, limit - ids.shape[1]))",
            "        with torch.no_grad():",
            "            tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,",
            "                                    do_sample=False, pad_token_id=PAD_ID, eos_token_id=EOS_ID)",
            "        tokens = tokens[:, ids.shape[1]:]  # the continuation",
            "        for row in tokens:",
            "            text = tokenizer.decode(row.tolist(), skip_special_tokens=True)",
            "            end = min([text.find(s) for s in STOP_STRINGS if s in text], default=len(text))",
            "            out.append(text[:end].strip())",
            "    return out",
            "",
            "",
        ]
    lines += [
        "def examples_of(path, limit=EVAL_MAX_SAMPLES):",
        '    """A JSONL file with the run\'s columns -> its first `limit` rows as dicts of the task\'s fields."""',
        "    rows = [json.loads(line) for line in open(path) if line.strip()][: limit or None]",
        f"    fields = {[*fields, gold]!r}",
        "    return [{f: r[COLUMNS.get(f, f)] for f in fields if COLUMNS.get(f, f) in r} for r in rows]",
        "",
        "",
        "if EVAL_PATH:  # the run's evaluation examples (a .jsonl; read another format into the same dicts)",
        "    examples = examples_of(EVAL_PATH)",
    ]
    if task["kind"] == "classification":
        lines += [
            "    labels, scores = classify(examples)",
            '    print("accuracy", sum(p == int(ex["label"]) for p, ex in zip(labels, examples)) / len(examples))',
        ]
    else:
        lines += [
            "    answers = answer(examples)  # scored by SQuAD's F1 / exact match against ex['answers']",
            "    print(answers[:3])",
        ]
    return lines


def _fields(task: dict[str, Any]) -> list[str]:
    """The task's fields, in the template's order, then the gold one."""
    import string

    from hosfl_dist.data.text import custom_task, get_task, is_preset

    if is_preset(task["name"]):
        return list(get_task(task["name"]).fields)
    template = task["template"]
    names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    return [*dict.fromkeys(names), *custom_task(task["kind"], template, task["label_words"]).fields[-1:]]


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    out = ["| | |", "|---|---|"]
    out += [f"| {k} | {_cell(v)} |" for k, v in rows]
    return out


def _cell(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text.replace("|", "\\|").replace("\n", "\\n")


def _base_rows(cfg: Any, summary: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    if cfg.model.name == "hf":
        rows += [("model.gguf_file", cfg.model.gguf_file or "-"), ("model.dtype", cfg.model.dtype)]
    for role, entry in (summary.get("inputs") or {}).items():
        if role.startswith("model"):
            rows.append((role, _input(entry)))
    return rows


def _input(entry: Any) -> str:
    if not isinstance(entry, dict):
        return str(entry)
    if "sha256" in entry:
        return f"`{entry.get('path')}`, {entry.get('size', 0):,} bytes, SHA-256 `{entry['sha256']}`"
    return ", ".join(f"{k}: {v}" for k, v in entry.items())


def _method_rows(cfg: Any) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [
        ("algorithm.name", cfg.algorithm.name),
        ("split.cut", cfg.split.cut),
        ("clients (M, K per round, batch)", f"{cfg.clients.total}, {cfg.clients.per_round}, {cfg.clients.batch_size}"),
        ("client optimizer", f"{cfg.clients.optim.name}, lr {cfg.clients.optim.lr}"),
        ("server optimizer", f"{cfg.server.optim.name}, lr {cfg.server.optim.lr}"),
        ("train.budget_samples", cfg.train.budget_samples),
        ("job.seed", cfg.job.seed),
    ]
    if cfg.algorithm.name in ("hosfl", "zo_sfl", "mu_splitfed"):
        rows.insert(2, ("zo (P, μ)", f"{cfg.zo.num_perturbations}, {cfg.zo.mu}"))
    if cfg.model.name == "hf":
        lora = cfg.lora
        rows.append(("LoRA (r, alpha, dropout)", f"{lora.r}, {lora.alpha}, {lora.dropout}"))
        rows.append(("LoRA targets (client / server)", f"{list(lora.client_targets)} / {list(lora.server_targets)}"))
    return rows


def _data_rows(cfg: Any, summary: dict[str, Any], record: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [("data.name", cfg.data.name)]
    task = record.get("task")
    if task:
        rows += [("task", f"{task['name']} ({task['kind']})"), ("label words", task["label_words"] or "-"),
                 ("template (str.format of the fields)", json.dumps(task["template"])),
                 ("columns (field: the file's column)", task["columns"] or "the fields' own names"),
                 ("max_length, padding side", f"{task['max_length']}, {task['padding_side']}")]  # fmt: skip
        if task.get("template_note"):
            rows.insert(-2, ("template note", task["template_note"]))
        if task.get("stop_strings"):
            rows.insert(-1, ("stop strings (the answer ends at the first)", json.dumps(task["stop_strings"])))
    rows.append(("data.eval_max_samples", cfg.data.eval_max_samples or "all"))
    for role, entry in (summary.get("inputs") or {}).items():
        if role.startswith("data"):
            rows.append((role, _input(entry)))
    return rows


def _results(restored: Restored, record: dict[str, Any]) -> list[str]:
    summary = restored.summary
    final = summary.get("final") or {}
    rows: list[tuple[str, Any]] = [(f"final {k}", v) for k, v in final.items()]
    rows += [("rounds", summary.get("rounds")), ("processed samples", summary.get("processed_samples"))]
    row = record.get("metrics")
    lines = _table(rows)
    if row is not None:
        shown = {k: v for k, v in row.items() if k.startswith("eval_")}
        lines += ["", f"The run's evaluation of the exported weights (round {restored.round}): `{json.dumps(shown)}`."]
    else:
        lines += ["", f"The run did not evaluate round {restored.round} (the exported checkpoint's)."]
    return lines


def _traffic(summary: dict[str, Any]) -> list[str]:
    comm = summary.get("comm") or {}
    rows = list((comm.get("bytes") or {}).items())
    rows.append(("training total", comm.get("training_total_bytes")))
    return _table([(k, f"{v:,}" if isinstance(v, int) else v) for k, v in rows])


def _provenance_rows(restored: Restored, summary: dict[str, Any]) -> list[tuple[str, Any]]:
    code = summary.get("code") or {}
    return [
        ("fingerprint (config + inputs)", summary.get("fingerprint")),
        ("code", f"{code.get('version')} commit {code.get('commit')} source SHA-256 {code.get('source_sha256')}"),
        ("checkpoint", str(restored.checkpoint.resolve())),
        ("engine", summary.get("engine")),
    ]
