"""First-order reference for a language config: centralized LoRA fine-tuning of the same model, no split, no ZO.

    python -m hosfl_dist.experiments.centralized_lora --config configs/smollm2_sentiment.yaml [section.key=value ...]

Same model, LoRA targets and initial adapters, tokenised data, training subset, evaluation set and metric as the
HO-SFL run of that config (it builds them with the same code). The difference is the training: one process
back-propagates through client and server parts together (their composition is the unsplit model exactly) with
``clients.optim`` on the client LoRA tensors and ``server.optim`` on the server ones. One step takes
K·B = ``clients.per_round * clients.batch_size`` samples, the samples one HO-SFL round processes, so both methods take
the same number of server steps for the same ``train.budget_samples``. Writes ``metrics.jsonl`` (the run's row format,
without traffic) and ``summary.json`` to ``job.out_dir``; prints the accuracies, not a verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.config import dump_config
from hosfl_dist.data import build_data
from hosfl_dist.runtime.checks import load_run_config
from hosfl_dist.runtime.trainer import eval_points
from hosfl_dist.errors import HosflError
from hosfl_dist.models import SplitModel, build_split_model, server_forward
from hosfl_dist.core.optim import build_torch_optimizer
from hosfl_dist.core.seeding import Stream, generator
from hosfl_dist.runtime.build import data_sections


def evaluate(split: SplitModel, data: Any, batch_size: int) -> dict[str, Any]:
    split.client.eval()
    split.server.eval()
    stats: dict[str, float] = {}
    with torch.no_grad():
        for x, y in data.eval_batches(batch_size):
            out = server_forward(split.server, split.client_forward(x))
            for k, v in split.task.eval_stats(out, y).items():
                stats[k] = stats.get(k, 0.0) + v
    split.client.train()
    split.server.train()
    return split.task.finalize(stats)


METHOD = "centralized first-order LoRA"


def own_result_or_none(out: Path) -> None:
    """Refuse a ``job.out_dir`` that is, lies inside or holds a federated run's folder: its config.yaml, metrics.jsonl
    and summary.json would be replaced (an earlier result of this command is replaced, as before)."""
    from hosfl_dist.runfolder.folder import recorded_summary, run_in_the_way
    from hosfl_dist.safe_files import check_folder_entries, check_output_folder

    check_output_folder(out, "job.out_dir", error=HosflError)  # not a file, a device, a FIFO
    check_folder_entries(out, "job.out_dir", error=HosflError)  # metrics.jsonl a FIFO would block its open
    run = run_in_the_way(out)
    if run is not None and not (run == out.resolve() and (recorded_summary(run) or {}).get("method") == METHOD):
        where = "holds" if run != out.resolve() and run.is_relative_to(out.resolve()) else "is inside"
        raise HosflError(f"job.out_dir {out} {where} the run folder {run}: write the reference elsewhere (a run's "
                         "files are never replaced)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hosfl_dist.experiments.centralized_lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        # A first-order method: the client part keeps its train-mode behaviour (no ZO eval-mode wrapper).
        cfg = load_run_config(args.config, ["algorithm.name=splitlora", *args.overrides])
        data = build_data(data_sections(cfg))
        if data.info.get("kind") != "classification":
            raise HosflError("the centralized LoRA reference evaluates classification tasks only")
        out = Path(cfg.job.out_dir)
        own_result_or_none(out)
        split = build_split_model(cfg, data.info, get_algorithm(cfg.algorithm.name).zeroth_order_client)
    except HosflError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    opts = [
        build_torch_optimizer(cfg.clients.optim, split.client.parameters()),
        build_torch_optimizer(cfg.server.optim, split.server.parameters()),
    ]
    step_size = cfg.clients.per_round * cfg.clients.batch_size
    n_train = len(data.train_labels)
    gen = generator(cfg.job.seed, Stream.CENTRALIZED_ORDER)
    order, cursor = torch.randperm(n_train, generator=gen), 0
    budget, points = cfg.train.budget_samples, eval_points(cfg.train.budget_samples, cfg.train.eval_every_samples)
    start = time.perf_counter()
    rows, processed, step, losses = [], 0, 0, []
    metrics_file = open(out / "metrics.jsonl", "w")  # noqa: SIM115 - one file for the whole run

    def log() -> None:
        row = {
            "round": step,
            "processed_samples": processed,
            **evaluate(split, data, cfg.train.eval_batch_size),
            "train_loss": sum(losses) / len(losses) if losses else None,
            "wall_time_s": round(time.perf_counter() - start, 3),
        }
        losses.clear()
        rows.append(row)
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
        print(json.dumps(row), flush=True)

    log()
    nxt = 1
    split.client.train()
    split.server.train()
    while processed < budget:
        if cursor + step_size > n_train:  # a new epoch, reshuffled
            order, cursor = torch.randperm(n_train, generator=gen), 0
        idx = order[cursor : cursor + step_size]
        cursor += step_size
        b = data.train_text.select(idx, trim=True)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        act = split.client_forward({"input_ids": b.input_ids, "attention_mask": b.attention_mask})
        loss = split.task.loss(server_forward(split.server, act), b.labels)
        loss.backward()
        for opt in opts:
            opt.step()
        losses.append(loss.item() if math.isfinite(loss.item()) else float("nan"))
        processed += len(idx)
        step += 1
        if nxt < len(points) and processed >= points[nxt]:
            while nxt < len(points) and processed >= points[nxt]:
                nxt += 1
            log()
    metrics_file.close()
    summary = {
        "method": METHOD,
        "steps": step,
        "processed_samples": processed,
        "samples_per_step": step_size,
        "initial_eval_accuracy": rows[0]["eval_accuracy"],
        "final": {k: rows[-1].get(k) for k in ("eval_accuracy", "eval_loss", "train_loss")},
        "wall_time_s": round(time.perf_counter() - start, 3),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"centralized LoRA: eval_accuracy {rows[0]['eval_accuracy']:.4f} -> {rows[-1]['eval_accuracy']:.4f} "
        f"after {processed} samples ({step} steps), {summary['wall_time_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
