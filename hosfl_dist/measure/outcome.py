"""What a finished run shows a newcomer, in three lines after ``done:``, and the same figures as a table of runs.

- accuracy: the final evaluation (and the best), on how many test samples, after how many training samples;
- client memory: the peak of one client step of the run's method against an inference-only forward of the same f_c,
  both measured by the memory profiler (:mod:`hosfl_dist.measure.modes`: the method's own worker code against a
  stand-in server, live tensor bytes counted at the aten level) on the run's model, cut, batch and data shape with the
  profiler's own seeded weights: the memory of the shapes, not of the process (whose RSS is in summary.json);
- uplink: the bytes the run counted client -> server (summary.json ``comm``), against what SFL would upload for the
  same samples, estimated from those counts and the model's sizes the way this package's SFL sends (``sfl.py``): the
  same activations and labels for every batch, plus θc_m (f_c's trainable tensors) from each client after each round
  of ``algorithm.local_epochs`` local epochs over its shard.

    python -m hosfl_dist.measure.outcome runs/compare_quick/runs/*/seed0     # a table: one row per run folder

The profiler builds the package's vision models in a fraction of a second; a language model's client is not rebuilt
at the end of a run (the line says how to measure it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.transport.wire import UPLINK_ACTIVATIONS, UPLINK_MODEL, UPLINK_SCALARS

if TYPE_CHECKING:
    from hosfl_dist.config import Config

UPLINK = (UPLINK_ACTIVATIONS, UPLINK_MODEL, UPLINK_SCALARS)
"""The client -> server categories of summary.json ``comm.bytes`` (``control`` and ``eval`` are neither training
traffic nor the paper's uplink)."""
FIRST_ORDER_EXCHANGE = ("sfl", "splitlora")
"""Methods that are SFL's protocol themselves: their uplink is not compared with SFL's."""


def client_memory(cfg: Config) -> dict[str, Any]:
    """``{"mode", "peak_bytes", "inference_bytes"}`` of the run's client (profiler, this process), or ``{"skipped":
    why}`` where the profiler does not rebuild it here."""
    from hosfl_dist.measure.modes import VISION_INPUTS, run_mode, run_spec
    from hosfl_dist.measure.tracker import measure

    if cfg.model.name not in VISION_INPUTS:
        return {"skipped": f"model.name={cfg.model.name} is not rebuilt at the end of a run"}
    mode = run_mode(cfg)
    if mode is None:
        return {"skipped": f"the memory profiler does not drive algorithm.name={cfg.algorithm.name}"}
    from hosfl_dist.measure.modes import make_step

    spec = run_spec(cfg, mode)
    with _quiet():
        peaks = {m: measure(make_step(m, spec), spec.device)["peak_bytes"] for m in dict.fromkeys([mode, "inference"])}
    return {"mode": mode, "peak_bytes": peaks[mode], "inference_bytes": peaks["inference"], "batch": spec.batch}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The profiled worker's start-up lines (threads, latency hiding) are the run's already: not said again."""
    root = logging.getLogger("hosfl_dist")
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.setLevel(level)


def client_sizes(cfg: Config) -> dict[str, Any]:
    """f_c's parameters and the bytes of its trainable tensors (what SFL's θc_m upload carries), from a meta-device
    build; the data's sizes and the steps of one local epoch of each client (its shard over the batch size)."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.data import build_data
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    # the shards' indices; no client's rows are kept
    data = build_data(data_sections(cfg), clients=[], evaluation=False)
    split = build_split_model(cfg, data.info, get_algorithm(cfg.algorithm.name).zeroth_order_client, parts=())
    params = list(split.client.parameters())
    batch = cfg.clients.batch_size
    return {
        "client_params": sum(p.numel() for p in params),
        "client_trainable_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "eval_size": int(data.info.get("eval_size") or 0),
        "epoch_steps": [max(1, math.ceil(len(shard) / batch)) for shard in data.shards],
    }


def sfl_uplink(summary: dict[str, Any], cfg: Config, sizes: dict[str, Any]) -> dict[str, Any]:
    """SFL's uplink for the run's samples, estimated: the activations the run counted (SFL sends z and y for every
    batch as every split method does) plus one θc_m per client per SFL round, a round being ``local_epochs`` epochs of
    a client's shard (of the mean shard's number of steps: which clients are sampled decides the exact count)."""
    comm = summary["comm"]["bytes"]
    steps = sizes["epoch_steps"]
    per_client = cfg.algorithm.local_epochs * sum(steps) / len(steps)
    client_steps = math.ceil(summary["processed_samples"] / cfg.clients.batch_size)
    rounds = math.ceil(client_steps / (cfg.clients.per_round * per_client))  # the last one shortened to the budget
    uploads = rounds * cfg.clients.per_round
    model = uploads * sizes["client_trainable_bytes"]
    return {"bytes": comm.get(UPLINK_ACTIVATIONS, 0) + model, "model_bytes": model, "rounds": rounds,
            "uploads": uploads}  # fmt: skip


def outcome(summary: dict[str, Any], cfg: Config, memory: bool = True) -> dict[str, Any]:
    """The figures of the three lines (and of a table row) for a completed run."""
    comm = summary["comm"]["bytes"]
    sizes = client_sizes(cfg)
    out: dict[str, Any] = {
        "algorithm": cfg.algorithm.name,
        "final": summary.get("final") or {},
        "processed_samples": summary["processed_samples"],
        "rounds": summary["rounds"],
        "wall_time_s": summary.get("wall_time_s"),
        "delivered": (summary.get("participation") or {}).get("delivered"),
        "uplink": {c: comm.get(c, 0) for c in UPLINK},
        "sizes": sizes,
        "sfl": None if cfg.algorithm.name in FIRST_ORDER_EXCHANGE else sfl_uplink(summary, cfg, sizes),
    }
    if memory:
        try:
            out["memory"] = client_memory(cfg)
        except Exception as exc:  # noqa: BLE001 - a measurement never fails a finished run
            out["memory"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return out


def _pct(value: Any) -> str:
    return f"{100 * value:.2f} %" if isinstance(value, float) else "n/a"


def _ratio(r: float) -> str:
    return f"{r:.2f}" if r >= 0.01 else f"{r:.2g}"  # a tiny ratio keeps its digits, not 0.00


def size(nbytes: float) -> str:
    """Bytes in binary units (KiB = 2^10, MiB = 2^20, GiB = 2^30), as every table of the package."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def lines(o: dict[str, Any], cfg: Config) -> list[str]:
    """The three lines: accuracy, client memory, uplink."""
    final, sizes = o["final"], o["sizes"]
    tested = f"the {sizes['eval_size']:,} test samples" if sizes["eval_size"] else "the test set"
    best = f"; best {_pct(final['best_eval_accuracy'])} (round {final.get('best_round')})" if final.get(
        "best_eval_accuracy") is not None else ""  # fmt: skip
    out = [f"accuracy: {_pct(final.get('eval_accuracy'))} on {tested} after {o['processed_samples']:,} training "
           f"samples{best}"]  # fmt: skip
    mem = o.get("memory") or {}
    if "peak_bytes" in mem:
        ratio = mem["peak_bytes"] / mem["inference_bytes"]
        out.append(
            f"client memory: {size(mem['peak_bytes'])} at the peak of one {o['algorithm']} client step, against "
            f"{size(mem['inference_bytes'])} for an inference-only forward of f_c ({ratio:.2f}x; memory profiler: "
            f"tensors of one step of this model's client at batch {mem['batch']}, d_c = {sizes['client_params']:,})"
        )
    else:
        how = ("python -m hosfl_dist.measure.memory --model " + (cfg.model.source if cfg.model.name == "hf" else
               cfg.model.name) + f" --cut {cfg.split.cut} --modes {o['algorithm']},inference")  # fmt: skip
        out.append(f"client memory: not measured ({mem.get('skipped', 'not asked')}): {how}")
    up = o["uplink"]
    sent = sum(up.values())
    parts = f"activations {size(up[UPLINK_ACTIVATIONS])}"
    if up[UPLINK_SCALARS]:
        uploads = o.get("delivered") or o["rounds"] * cfg.clients.per_round  # client-rounds that sent their scalars
        per = up[UPLINK_SCALARS] / max(1, uploads)
        parts += f", aggregation {size(up[UPLINK_SCALARS])}: {per:.0f} B per client per round"
    if up[UPLINK_MODEL]:
        parts += f", θc {size(up[UPLINK_MODEL])}"
    line = f"uplink: {size(sent)} counted ({parts})"
    sfl = o["sfl"]
    if sfl is not None:
        line += (f"; SFL, estimated for the same samples: {size(sfl['bytes'])} (the same activations + θc, "
                 f"{size(sizes['client_trainable_bytes'])}, from each of K = {cfg.clients.per_round} clients after "
                 f"each of {sfl['rounds']:,} round(s) of E = {cfg.algorithm.local_epochs} local epoch(s)) = "
                 f"{_ratio(sent / sfl['bytes'])}x")  # fmt: skip
    out.append(line)
    return out


def run_lines(summary: dict[str, Any], cfg: Config) -> str:
    """What the command line prints after ``done:`` (a line that cannot be made says why, never fails the run)."""
    try:
        return "\n".join(lines(outcome(summary, cfg), cfg))
    except Exception as exc:  # noqa: BLE001 - the run has ended and is recorded: a line says what was not made
        return f"(the summary lines were not made: {type(exc).__name__}: {exc})"
    except KeyboardInterrupt:  # Ctrl-C while the client's memory is measured: the run itself is complete
        return "(the summary lines were not made: Ctrl-C; the run is complete and recorded)"


# --------------------------------------------------------------------------------------------------------- table
def table(folders: Sequence[Path]) -> list[str]:
    """A markdown table of completed runs: method, accuracy, client peak memory (and over inference), uplink (and
    SFL's estimate), wall time."""
    from hosfl_dist.runfolder.folder import recorded_summary
    from hosfl_dist.runtime.checks import load_run_config

    rows = [
        "| method | final accuracy | client peak memory (× inference) | uplink (× SFL's, estimated) | wall time |",
        "|---|---|---|---|---|",
    ]
    for folder in folders:
        summary = recorded_summary(folder)
        if summary is None or summary.get("status") not in ("completed", "stopped"):
            raise ConfigError(f"invalid run folder: {folder} holds no completed run (summary.json)")
        cfg = load_run_config(str(folder / "config.yaml"), [])
        o = outcome(summary, cfg)
        mem = o["memory"]
        memory = (f"{size(mem['peak_bytes'])} ({mem['peak_bytes'] / mem['inference_bytes']:.2f}×)"
                  if "peak_bytes" in mem else "not measured")  # fmt: skip
        sent = sum(o["uplink"].values())
        vs = f" ({_ratio(sent / o['sfl']['bytes'])}×)" if o["sfl"] else ""
        wall = "n/a" if o["wall_time_s"] is None else f"{o['wall_time_s']:.0f} s"
        rows.append(f"| {o['algorithm']} | {_pct(o['final'].get('eval_accuracy'))} | {memory} | {size(sent)}{vs} | "
                    f"{wall} |")  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hosfl_dist.measure.outcome", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders of completed runs (one table row each)")
    args = p.parse_args(argv)
    from hosfl_dist.logs import init_logging

    init_logging()
    try:
        print("\n".join(table([Path(r) for r in args.runs])))
    except HosflError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
