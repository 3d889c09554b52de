"""An export's own manifest: every file of an exported model with its size and hash, signed with the user's key.

``python -m hosfl_dist.export`` writes ``hosfl_manifest.json`` last into the folder it exports to
(:func:`sign_export`); ``python -m hosfl_dist.predict`` and ``hosfl_dist.export.load_vision`` verify it before they
read a file (:func:`verify_export`): every listed file intact, no file the manifest does not list, and the signature
this user's key's (:mod:`hosfl_dist.runfolder.signing`). An unsigned folder (exported by an earlier version or by
another tool, or with its manifest removed) is read only when the caller accepts it deliberately. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from hosfl_dist.errors import ConfigError
from hosfl_dist.runfolder.checkpoints import (
    accepted_signature,
    files_problem,
    list_files,
    manifest_digest,
    read_manifest,
    write_signed,
)
from hosfl_dist.runfolder.signing import UNSIGNED, Key

EXPORT_MANIFEST = "hosfl_manifest.json"
EXPORT_FORMAT = 1


def sign_export(folder: Path, key: Key, round_idx: int) -> None:
    """List every file of a complete export with its size and hash and sign the list (written last)."""
    body = {"export_format": EXPORT_FORMAT, "round": round_idx, "files": list_files(folder, (EXPORT_MANIFEST,))}
    write_signed(folder / EXPORT_MANIFEST, body, key)


def verify_export(folder: Path, key: Key, allow_unsigned: bool, accept: str = "--allow-unsigned") -> str:
    """The signature's state of an intact export (:data:`~.signing.SIGNED`, or :data:`~.signing.UNSIGNED` where
    ``allow_unsigned``); ConfigError in one line for a damaged or forged one, or an unsigned one not accepted."""
    if not (folder / EXPORT_MANIFEST).is_file():
        if allow_unsigned:
            return UNSIGNED
        raise ConfigError(f"{folder}: {UNSIGNED} (no {EXPORT_MANIFEST}: not exported by this version of hosfl_dist, "
                          f"or its manifest was removed); refused ({accept} reads it, if you trust whoever could "
                          "write that folder)")  # fmt: skip
    manifest = read_manifest(folder, EXPORT_MANIFEST)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        raise ConfigError(f"{folder}: {EXPORT_MANIFEST} unreadable")
    if manifest.get("digest") != manifest_digest(manifest):
        raise ConfigError(f"{folder}: {EXPORT_MANIFEST} altered")
    state = accepted_signature(folder, manifest, key, allow_unsigned, accept, EXPORT_MANIFEST, "its files")
    problem = files_problem(folder, manifest["files"])
    if problem is not None:
        raise ConfigError(f"{folder} failed verification ({problem})")
    extra = sorted(set(list_files_names(folder)) - set(manifest["files"]) - {EXPORT_MANIFEST})
    if extra:
        raise ConfigError(f"{folder} holds files its {EXPORT_MANIFEST} does not list ({', '.join(extra[:3])}): "
                          "added after the export; refused")  # fmt: skip
    return state


def list_files_names(folder: Path) -> list[str]:
    """Every file (or link) below ``folder``, by its path relative to it."""
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()]
