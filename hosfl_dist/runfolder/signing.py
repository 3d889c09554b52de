"""The user's signing key, and the signature of what a run writes (checkpoint manifests, export manifests).

A manifest's BLAKE2b digest catches damage, but anyone who can write a run's folder can recompute it. The signature
is an HMAC-SHA256 of the manifest's canonical body under a key that does not live in the run's folder:
``$HOSFL_KEY_FILE``, by default ``$XDG_CONFIG_HOME/hosfl_dist/key`` (``~/.config/hosfl_dist/key``), 32 random bytes
written as 64 hex digits, made on first use with mode 0600 (created under a temporary name and linked into place, so
two processes starting at once end up with the same key). A key file that group or others may read or write is
refused, as ssh refuses such a private key. The manifest names the key by its id (a short hash of the key, which
tells nothing of it), so a reader can say "signed by another key".

Verification says one of three things (:func:`signature_state`): :data:`SIGNED` (signed by this key),
:data:`UNSIGNED` (no signature: written by hand, by an earlier version, or stripped), :data:`MISMATCH` (a signature
that this key did not make: a forgery, or another key). Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hosfl_dist.config.environment import key_file_path
from hosfl_dist.errors import ConfigError

SIGNED = "signed by this key"
UNSIGNED = "unsigned"
MISMATCH = "signature mismatch"
SIGNATURE = "signature"
"""The manifest field that holds ``{"key_id": …, "hmac_sha256": …}``."""
KEY_BYTES = 32


@dataclass(frozen=True)
class Key:
    """The user's signing key: its bytes, its id (recorded in what it signs) and where it lives."""

    secret: bytes
    id: str
    path: Path

    def __repr__(self) -> str:  # never print the secret
        return f"Key(id={self.id!r}, path={str(self.path)!r})"


def key_id(secret: bytes) -> str:
    """A short public name of a key (16 hex digits of a hash of it)."""
    return hashlib.sha256(b"hosfl_dist key id\0" + secret).hexdigest()[:16]


def load_key(create: bool = True) -> Key:
    """The user's key (:func:`~hosfl_dist.config.environment.key_file_path`), made on first use when ``create``;
    ConfigError in one line for a key file that cannot be made or read, is not a key, or is open to others."""
    path = key_file_path()
    if create and not path.exists():
        _create(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))  # a FIFO: no wait
    except FileNotFoundError:
        raise ConfigError(f"no signing key at {path} (HOSFL_KEY_FILE)") from None
    except OSError as exc:
        raise ConfigError(f"signing key {path} (HOSFL_KEY_FILE) cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"signing key {path} (HOSFL_KEY_FILE) is not a file")
        if st.st_mode & 0o077:
            raise ConfigError(f"signing key {path} (HOSFL_KEY_FILE) is open to others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")  # fmt: skip
        text = os.read(fd, 4 * KEY_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise ConfigError(f"signing key {path} (HOSFL_KEY_FILE) is not a key: expected {2 * KEY_BYTES} hex digits")
    return Key(secret, key_id(secret), path)


def _create(path: Path) -> None:
    """Write a new key at ``path`` atomically, mode 0600 from the start; a key another process made first wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (secrets.token_bytes(KEY_BYTES).hex() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if a key appeared meanwhile: that one is kept
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot make the signing key {path}: {exc.strerror or exc}; set HOSFL_KEY_FILE to a file "
                          "you can write (never inside a run's folder)") from None  # fmt: skip


def check_outside(key: Key, folder: Path) -> None:
    """Refuse a key that lies inside ``folder`` (a run's folder or an export): whoever writes the folder would hold
    the key too."""
    try:
        inside = key.path.resolve().is_relative_to(folder.resolve())
    except OSError:
        inside = False
    if inside:
        raise ConfigError(f"signing key {key.path} (HOSFL_KEY_FILE) lies inside {folder}: keep it outside every run's "
                          "and export's folder")  # fmt: skip


def canonical(body: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the body without its digest and signature, as sorted compact JSON."""
    kept = {k: v for k, v in body.items() if k not in ("digest", SIGNATURE)}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(body: dict[str, Any], key: Key) -> dict[str, str]:
    """The signature field of ``body``."""
    return {"key_id": key.id, "hmac_sha256": hmac.new(key.secret, canonical(body), hashlib.sha256).hexdigest()}


def signature_state(body: dict[str, Any], key: Key) -> tuple[str, str]:
    """(:data:`SIGNED` | :data:`UNSIGNED` | :data:`MISMATCH`, a few words more: which key signed a mismatch)."""
    signature = body.get(SIGNATURE)
    if signature is None:
        return UNSIGNED, "no signature"
    if not isinstance(signature, dict) or not isinstance(signature.get("hmac_sha256"), str):
        return MISMATCH, "a signature field that is no signature"
    want = hmac.new(key.secret, canonical(body), hashlib.sha256).hexdigest()
    if hmac.compare_digest(want, signature["hmac_sha256"]):
        return SIGNED, f"key {key.id}"
    other = signature.get("key_id")
    if other != key.id:
        return MISMATCH, f"signed by another key ({str(other)[:16]}, this one is {key.id} at {key.path})"
    return MISMATCH, f"this key's id ({key.id}) on content it did not sign"
