"""A run's checkpoint back into one process: the split model with θs and θc of the checkpoint's round.

    restored = restore(Path("runs/x/latest"), "latest")     # verified, checked against the run, loaded
    restored.split.client, restored.split.server            # f_c with θc^T bound, f_s with θs^T

The checkpoint is verified first (every file against its manifest, and the manifest's signature against the user's
key: a mismatch is refused, an unsigned one unless ``allow_unsigned``), then checked against the run by the identity
that verified manifest records: the config that config.yaml resolves to must be the one recorded, and the base
model's files must still have the content they had (frozen weights are not in a checkpoint: they come from the
model's source). The model is then built as a run builds it, both parts materialised, and loaded with the runtime's
own :class:`CheckpointStore`: θs from ``model/`` (DCP reads the shards of every server rank into the unsharded module
in this process, one at a time), the algorithm server from ``state.pt``, and θc is what that server knows of round T
(``client_params_at``: HO-SFL replays its base replica; the baselines keep θc^T).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hosfl_dist.config import Config
from hosfl_dist.errors import HosflError
from hosfl_dist.models import SplitModel
from hosfl_dist.runtime.checks import load_run_config


class ExportError(HosflError):
    """Bad input to export or predict: reported in one line, exit code 2."""


CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
_ROUND = re.compile(r"^(?:round-)?0*(\d+)$")


@dataclass
class Restored:
    """A run's model at one checkpoint, in this process."""

    run_dir: Path
    cfg: Config
    split: SplitModel
    checkpoint: Path
    round: int
    processed: int
    summary: dict[str, Any]
    """The run's summary.json (empty when it has none)."""


def find_checkpoint(run_dir: Path, which: str = "latest") -> Path:
    """The checkpoint folder ``which`` (``latest``, ``round-N`` or ``N``) of a run, verified; ExportError naming what is
    wrong (no run, no checkpoint, none of that round, one that fails verification: with the rounds that verify)."""
    from hosfl_dist.runfolder.checkpoints import checkpoint_folders, verify_checkpoint

    if not (run_dir / CONFIG).is_file():
        raise ExportError(f"{run_dir} is not a run folder (no {CONFIG})")
    folders = checkpoint_folders(run_dir)
    if not folders:
        raise ExportError(f"{run_dir} has no checkpoint (checkpoints/round-*/): a run writes one after its last round "
                          "(checkpoint.final, on by default) and every checkpoint.interval_samples")  # fmt: skip
    if which == "latest":
        path = folders[0]
    else:
        wanted = _ROUND.match(which)
        if wanted is None:
            raise ExportError(f"--checkpoint {which!r}: expected latest, round-N or N")
        path = next((p for p in folders if _round_of(p) == int(wanted.group(1))), None)
        if path is None:
            have = ", ".join(f"round-{_round_of(p)}" for p in folders)
            raise ExportError(f"{run_dir} has no checkpoint of round {int(wanted.group(1))} (it has {have})")
    problem = verify_checkpoint(path)
    if problem is not None:
        good = [f"round-{_round_of(p)}" for p in folders if p != path and verify_checkpoint(p) is None]
        hint = f"; these verify: {', '.join(good)} (--checkpoint)" if good else "; no other checkpoint verifies"
        raise ExportError(f"checkpoint {path} failed verification ({problem}){hint}")
    return path


def _round_of(path: Path) -> int:
    return int(path.name.removeprefix("round-"))


def trusted(checkpoint: Path, allow_unsigned: bool = False) -> dict[str, Any]:
    """The manifest of a verified checkpoint if its signature is this user's key's (or it is unsigned and
    ``allow_unsigned``); ExportError in one line otherwise."""
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.runfolder.checkpoints import trusted_manifest
    from hosfl_dist.runfolder.signing import load_key

    try:
        manifest, _ = trusted_manifest(checkpoint, load_key(), allow_unsigned, "--allow-unsigned")
    except ConfigError as exc:
        raise ExportError(f"checkpoint {exc}") from None
    return manifest


def check_same_run(cfg: Config, checkpoint: Path, manifest: dict[str, Any]) -> None:
    """The checkpoint (its verified ``manifest``) was written by the run config.yaml describes, from the base model
    that is there now."""
    from hosfl_dist.runfolder.identity import comparable_config, config_key_differences, file_sha256_cached

    identity = manifest.get("identity")
    if not isinstance(identity, dict):  # a checkpoint of before identities: nothing to compare with
        return
    keys = config_key_differences(identity.get("config") or {}, comparable_config(cfg))
    if keys:
        theirs = _dotted(identity.get("config") or {}, keys[0])
        ours = _dotted(comparable_config(cfg), keys[0])
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        raise ExportError(f"checkpoint {checkpoint} is of another run or model: {keys[0]} is {theirs!r} there, "
                          f"{ours!r} in {CONFIG}{more}")  # fmt: skip
    for role, source in base_model_files(cfg).items():
        recorded = (identity.get("inputs") or {}).get(role) or {}
        if "sha256" not in recorded:
            continue
        path = Path(source)
        if not path.is_file():
            raise ExportError(f"the base model file {path} ({role}) the run read is gone")
        if file_sha256_cached(path) != recorded["sha256"]:
            raise ExportError(f"the base model file {path} ({role}) changed since the run (SHA-256 "
                              f"{recorded['sha256'][:12]}… then): frozen weights are not in a checkpoint")  # fmt: skip


def base_model_files(cfg: Config) -> dict[str, str]:
    """The files the frozen weights come from, by the role a run's identity names them with."""
    out: dict[str, str] = {}
    if cfg.model.name == "hf":
        from hosfl_dist.models.sources import model_inputs

        out.update({r: s for r, s in model_inputs(cfg.model.source, cfg.model.gguf_file).items() if isinstance(s, str)})
    if cfg.model.pretrained:
        out["model.pretrained"] = cfg.model.pretrained
    return out


def _dotted(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def restore(run_dir: Path, which: str = "latest", device: str = "cpu", allow_unsigned: bool = False) -> Restored:
    """Verify, check and load checkpoint ``which`` of the run in ``run_dir`` (see the module docstring)."""
    checkpoint = find_checkpoint(run_dir, which)
    manifest = trusted(checkpoint, allow_unsigned)
    cfg = load_run_config(run_dir / CONFIG)
    check_same_run(cfg, checkpoint, manifest)
    cfg = load_run_config(run_dir / CONFIG, [f"job.device={device}"])

    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.core.params import bind_slots, trainable_slots
    from hosfl_dist.data import data_info
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections, server_side
    from hosfl_dist.runtime.checkpoint import CheckpointStore

    spec = get_algorithm(cfg.algorithm.name)
    split = build_split_model(cfg, data_info(data_sections(cfg)), spec.zeroth_order_client, parts=("client", "server"))
    server, _ = server_side(cfg, spec, split)
    loop, _, meta = CheckpointStore(run_dir, keep=1).load(server, checkpoint)
    theta_c = server.client_params_at(meta["round"])
    if theta_c is None:
        raise ExportError(f"the {cfg.algorithm.name} server cannot tell θc at round {meta['round']}")
    bind_slots(trainable_slots(split.client), [nn.Parameter(p.detach().clone(), requires_grad=False) for p in theta_c])
    from hosfl_dist.models.vision import running_stat_slots

    stats = server.client_stats_at(meta["round"])  # where the client trained them (first-order, model.freeze_bn=code)
    with torch.no_grad():
        for (mod, name), s in zip(running_stat_slots(split.client) if stats else [], stats, strict=True):
            mod._buffers[name].copy_(s)
    split.client.eval()
    split.server.eval()
    from hosfl_dist.runfolder.folder import recorded_summary

    summary = recorded_summary(run_dir) or {}
    return Restored(run_dir, cfg, split, checkpoint, int(meta["round"]), int(loop.processed), summary)


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows (a line cut short by a crash ends them)."""
    rows = []
    try:
        lines = (run_dir / METRICS).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows
