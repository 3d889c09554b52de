"""A run's checkpoints on disk: where each one lives, what it holds, and how it proves itself.

``job.out_dir/checkpoints/round-<t>/`` holds, after round t (and its evaluation, if one was due):

- ``model/`` — θs (the server part's trainable tensors and buffers) and the server's torch optimizer, written with
  ``torch.distributed.checkpoint`` by every server rank, so an FSDP-sharded θs is saved shard by shard
  (``model/__<rank>_<n>.distcp``);
- ``state.pt`` — everything else, from rank 0: the algorithm server's state (HO-SFL: the (seeds, v̄) history, every
  client's round t'_m and the base replica θc^r the history starts from; the baselines: θc^t, FSL-SAGE's auxiliary
  models), the loop's position (round, processed samples, wall time), and each client worker's part (its clients'
  data-stream positions and generators, its RNG state, its traffic counters, what its algorithm keeps);
- ``meta.json`` — round, processed samples, world layout;
- ``manifest.json`` — written last: every other file with its size and BLAKE2b hash, the identity of the run that
  wrote it (config, inputs, code: :mod:`hosfl_dist.runfolder.identity`) and a digest of its own content.

A checkpoint is written into ``round-<t>.partial/`` and renamed when complete (:func:`commit`): a kill during the save
leaves the previous checkpoint the latest complete one. A checkpoint proves itself before a byte of it is loaded
(:func:`verify_checkpoint`); older checkpoints are removed (:func:`prune`) only after a newer one verified. Who writes
and reads them is the runtime's (:mod:`hosfl_dist.runtime.checkpoint`). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
"""The folder of a run's checkpoints, ``round-<t>`` each."""
PARTIAL = ".partial"
"""The suffix of a checkpoint folder being written (renamed away once it is complete)."""
MANIFEST = "manifest.json"
"""A checkpoint's list of files with their sizes and hashes and the run's identity, written last."""
MANIFEST_FORMAT = 1
_SHARD = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$")
"""A DCP shard file, written by the server rank in its name (``model/__<rank>_<n>.distcp``)."""


# -- where they are ------------------------------------------------------------------------------------------------
def checkpoint_path(out_dir: str | Path, t: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"round-{t:08d}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``out_dir`` that verifies (None if there is none)."""
    return next((p for p in checkpoint_folders(out_dir) if verify_checkpoint(p) is None), None)


def prune(out_dir: str | Path, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints; remove older ones and any partial ones left by a kill. Called only once
    the newest one verified, so the last intact checkpoint is never removed before a newer one proved itself."""
    folder = Path(out_dir) / CHECKPOINTS
    for p in checkpoint_folders(out_dir)[keep:] + list(folder.glob(f"round-*{PARTIAL}")):
        shutil.rmtree(p, ignore_errors=True)


def checkpoint_folders(out_dir: str | Path) -> list[Path]:
    """The checkpoint folders of a run, newest round first (folders still being written left out); whether each is
    intact is :func:`verify_checkpoint`'s to say."""
    folder = Path(out_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("round-*") if p.is_dir() and not p.name.endswith(PARTIAL)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def read_manifest(checkpoint: Path) -> dict[str, Any] | None:
    """A checkpoint's manifest as written (None: missing or unreadable), not verified."""
    try:
        data = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- manifests -------------------------------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    """BLAKE2b (256 bits) of a file's bytes: the checkpoint manifest's hash, fast enough to take at every save."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest_digest(body: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in body.items() if k != "digest"}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def write_manifest(folder: Path, round_idx: int, identity: dict[str, Any] | None) -> None:
    """List every file of a fully written checkpoint with its size and hash, beside the identity of the run that
    wrote it; written last, atomically, with a digest of its own content."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"size": path.stat().st_size, "blake2b": file_digest(path)}
    body: dict[str, Any] = {"format": MANIFEST_FORMAT, "round": round_idx, "files": files, "identity": identity}
    body["digest"] = _manifest_digest(body)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, folder / MANIFEST)


def verify_checkpoint(folder: Path, rank: int | None = None) -> str | None:
    """What is wrong with a checkpoint, in a few words (None: every file is there with its size and hash).

    ``rank``: verify what that server rank reads (rank 0 everything but the other ranks' shards; rank r its own shard
    and the shards' index); None: every file.
    """
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return "no manifest.json: written only in part, or before checkpoints had manifests"
    manifest = read_manifest(folder)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return "manifest.json unreadable"
    if manifest.get("digest") != _manifest_digest(manifest):
        return "manifest.json altered"
    for rel, entry in sorted(manifest["files"].items()):
        if rank is not None and not _read_by(rel, rank):
            continue
        path = folder / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel}: missing"
        if size != entry.get("size"):
            return f"{rel}: {size} bytes, the manifest says {entry.get('size')}"
        try:
            if file_digest(path) != entry.get("blake2b"):
                return f"{rel}: hash mismatch"
        except OSError as exc:
            return f"{rel}: unreadable ({exc.strerror or exc})"
    return None


def _read_by(rel: str, rank: int) -> bool:
    shard = _SHARD.search(rel)
    if shard is not None:
        return int(shard.group(1)) == rank
    return rank == 0 or rel.endswith("/.metadata")


def commit(partial: Path, final: Path) -> None:
    """Make a fully written checkpoint the latest: one rename, atomic on one filesystem (a kill before it leaves
    only the partial folder, which is ignored and cleaned up later)."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
