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


def task_record(restored: Restored) -> dict[str, Any] | None:
    """The text task as predict needs it (None for vision): prompt, label words, columns, tokenisation, batching."""
    cfg = restored.cfg
    if cfg.model.name != "hf":
        return None
    from hosfl_dist.data.text import SENTIMENT_COLUMNS
    from hosfl_dist.data.text_fed import task_spec

    from hosfl_dist.data.text import prompt_template
    from hosfl_dist.tasks.squad_metric import DEFAULT_STOP_STRINGS

    spec = task_spec(cfg.data)
    columns = dict(cfg.data.columns) or (dict(SENTIMENT_COLUMNS) if cfg.data.name == "sentiment_multiemo" else {})
    template, note = prompt_template(spec)
    return {
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
    }


def exported_row(restored: Restored) -> dict[str, Any] | None:
    """The run's evaluation of the exported weights: the metrics row of the checkpoint's round, if one was taken."""
    rows = [r for r in metrics_rows(restored.run_dir) if r.get("round") == restored.round]
    return rows[-1] if rows else None


def write_record(restored: Restored, out: Path, written: dict[str, Any], command: str) -> dict[str, Any]:
    cfg = restored.cfg
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
        "task": task_record(restored),
        "metrics": exported_row(restored),
        "fingerprint": restored.summary.get("fingerprint"),
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
    ]


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
