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
  wrote it (config, inputs, code: :mod:`hosfl_dist.runfolder.identity`), its signature under the user's key (an
  HMAC that whoever can write the folder cannot recompute without the key: :mod:`hosfl_dist.runfolder.signing`) and a
  digest of its own content (which catches damage).

Format 2 (this one): ``state.pt`` holds plain data only (tensors, dicts, lists, tuples, strings, numbers, booleans,
None), read with ``torch.load(weights_only=True)``; a checkpoint of format 1 (whose ``state.pt`` was a full pickle)
is refused, naming the version that wrote it.

A checkpoint is written into ``round-<t>.partial/`` and renamed when complete (:func:`commit`): a kill during the save
leaves the previous checkpoint the latest complete one. A checkpoint proves itself before a byte of it is loaded:
intact (:func:`verify_checkpoint`: damage of any file, the manifest's included) and signed (:func:`trusted_manifest`:
a signature mismatch is refused whatever else is there, an unsigned manifest unless accepted deliberately); older
checkpoints are removed (:func:`prune`) only after a newer one verified. Who writes and reads them is the runtime's
(:mod:`hosfl_dist.runtime.checkpoint`). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hosfl_dist.errors import ConfigError
from hosfl_dist.runfolder.signing import MISMATCH, SIGNATURE, SIGNED, UNSIGNED, Key, sign, signature_state
from hosfl_dist.safe_files import replace_file

CHECKPOINTS = "checkpoints"
"""The folder of a run's checkpoints, ``round-<t>`` each."""
PARTIAL = ".partial"
"""The suffix of a checkpoint folder being written (renamed away once it is complete)."""
MANIFEST = "manifest.json"
"""A checkpoint's list of files with their sizes and hashes and the run's identity, written last."""
MANIFEST_FORMAT = 2
"""2: state.pt plain data read with ``weights_only=True``, the manifest signed; 1: state.pt a full pickle, unsigned."""
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


def read_manifest(checkpoint: Path, name: str = MANIFEST) -> dict[str, Any] | None:
    """A checkpoint's manifest (or the manifest ``name`` of another folder) as written (None: missing or unreadable),
    not verified."""
    try:
        data = json.loads((checkpoint / name).read_text())
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


def manifest_digest(body: dict[str, Any]) -> str:
    """A manifest's digest of its own content (every field but the digest): catches damage, not forgery."""
    text = json.dumps({k: v for k, v in body.items() if k != "digest"}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def list_files(folder: Path, leave_out: tuple[str, ...] = (MANIFEST,)) -> dict[str, dict[str, Any]]:
    """Every file below ``folder`` (by its path relative to it) with its size and BLAKE2b hash."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel not in leave_out:
            files[rel] = {"size": path.stat().st_size, "blake2b": file_digest(path)}
    return files


def write_signed(path: Path, body: dict[str, Any], key: Key) -> None:
    """Write ``body`` as a manifest at ``path``, atomically: signed with ``key``, then digested."""
    body = {k: v for k, v in body.items() if k not in ("digest", SIGNATURE)}
    body[SIGNATURE] = sign(body, key)
    body["digest"] = manifest_digest(body)
    replace_file(path, json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")


def write_manifest(folder: Path, round_idx: int, identity: dict[str, Any] | None, key: Key) -> None:
    """List every file of a fully written checkpoint with its size and hash, beside the identity of the run that
    wrote it; written last, atomically, signed with ``key`` and with a digest of its own content."""
    body = {"format": MANIFEST_FORMAT, "round": round_idx, "files": list_files(folder), "identity": identity}
    write_signed(folder / MANIFEST, body, key)


def verify_checkpoint(folder: Path, rank: int | None = None, digest: str | None = None) -> str | None:
    """What is wrong with a checkpoint, in a few words (None: every file is there with its size and hash). Damage
    only: whether the manifest is signed is :func:`trusted_manifest`'s to say.

    ``rank``: verify what that server rank reads (every file but the other ranks' shards); None: every file.
    ``digest``: the manifest's digest as rank 0 verified it (a server rank > 0 checks its files against that
    manifest, whose signature rank 0 checked).
    """
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return "no manifest.json: written only in part, or before checkpoints had manifests"
    manifest = read_manifest(folder)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return "manifest.json unreadable"
    if manifest.get("digest") != manifest_digest(manifest):
        return "manifest.json altered"
    if digest is not None and manifest["digest"] != digest:
        return "manifest.json is not the one server rank 0 verified"
    problem = format_problem(manifest)
    if problem is not None:
        return problem
    return files_problem(folder, manifest["files"], rank)


def format_problem(manifest: dict[str, Any]) -> str | None:
    """Why this version does not read a checkpoint of the manifest's format (None: it does)."""
    fmt = manifest.get("format")
    if fmt == MANIFEST_FORMAT:
        return None
    code = (manifest.get("identity") or {}).get("code") if isinstance(manifest.get("identity"), dict) else None
    by = f" ({code.get('version')}, commit {code.get('commit')})" if isinstance(code, dict) else ""
    if isinstance(fmt, int) and fmt < MANIFEST_FORMAT:
        return (f"written by an earlier version{by} in checkpoint format {fmt}, whose state.pt is a pickle this "
                "version does not run")  # fmt: skip
    return f"checkpoint format {fmt!r}, not {MANIFEST_FORMAT}: written by another version{by}"


def files_problem(folder: Path, files: dict[str, Any], rank: int | None = None) -> str | None:
    """The first of ``files`` (a manifest's list) that is missing or has another size or hash (None: none)."""
    for rel, entry in sorted(files.items()):
        if rank is not None and not _read_by(rel, rank):
            continue
        if not isinstance(entry, dict) or ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"{rel}: not a file of the folder"
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
    """Whether server rank ``rank`` reads ``rel``: its own shards and every file that is not a shard (every rank
    loads state.pt and meta.json)."""
    shard = _SHARD.search(rel)
    return shard is None or int(shard.group(1)) == rank


def signed_manifest(folder: Path, key: Key) -> dict[str, Any] | None:
    """A checkpoint's manifest if it is intact (its own digest) and signed by ``key``, else None; its files are not
    hashed (what it records, the run's identity, is what a reader wants from it)."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("digest") != manifest_digest(manifest):
        return None
    return manifest if signature_state(manifest, key)[0] == SIGNED else None


def trusted_manifest(folder: Path, key: Key, allow_unsigned: bool, accept: str) -> tuple[dict[str, Any], str]:
    """The manifest of a checkpoint (or an export) that :func:`verify_checkpoint` found intact, with its signature's
    state, if that is :data:`~.signing.SIGNED`, or :data:`~.signing.UNSIGNED` and ``allow_unsigned``; ConfigError in
    one line otherwise (``accept``: how to accept an unsigned one deliberately, e.g. ``--allow-unsigned``). What a
    manifest records (the run's identity) is read from what this returns, never from the file again."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("digest") != manifest_digest(manifest):
        raise ConfigError(f"{folder}: {MANIFEST} changed while it was read")
    return manifest, accepted_signature(folder, manifest, key, allow_unsigned, accept)


def accepted_signature(
    folder: Path,
    manifest: dict[str, Any],
    key: Key,
    allow_unsigned: bool,
    accept: str,
    what: str = "its manifest",
    forged: str = "its files or identity",
) -> str:
    """The signature's state of an intact manifest (a checkpoint's, or an export's: ``what`` names it, ``forged``
    what a forgery could change) if the reader takes it: :data:`~.signing.SIGNED`, or :data:`~.signing.UNSIGNED`
    where ``allow_unsigned``; ConfigError in one line otherwise."""
    state, detail = signature_state(manifest, key)
    if state == MISMATCH:
        raise ConfigError(f"{folder}: {MISMATCH} ({detail}): {what} was not signed by this key, so {forged} may be "
                          "forged; refused (if you trust it and hold the key that signed it, point HOSFL_KEY_FILE at "
                          "that key)")  # fmt: skip
    if state == UNSIGNED and not allow_unsigned:
        raise ConfigError(
            f"{folder}: {UNSIGNED} ({what} carries no signature: written by hand, by another tool, or "
            f"stripped); refused ({accept} accepts it, if you trust whoever could write that folder)"
        )
    return state


def commit(partial: Path, final: Path) -> None:
    """Make a fully written checkpoint the latest: one rename, atomic on one filesystem (a kill before it leaves
    only the partial folder, which is ignored and cleaned up later)."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
