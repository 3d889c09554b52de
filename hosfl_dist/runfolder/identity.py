"""A run's identity: what must be the same for a checkpoint to continue a run, or a finished run to stand for one.

    identity = run_identity(cfg)      # {"config": …, "inputs": …, "code": …, "environment": …}
    fingerprint(identity)             # one SHA-256 over what the run computes: its config and its inputs' content

- **config**: the resolved config without :data:`RUNTIME_ONLY` keys, the few that say how a run is started or watched
  (its folder, resume / overwrite, progress bar, trackers, network interface, what resume may let through) or only in
  which order it computes (``zo.overlap``) or what it keeps (``zo.noise_cache_mb``, ``server.reshard_after_forward``).
  Everything else is identity, including what changes bits without changing the method (``job.threads``,
  ``job.device``);
- **inputs**: every file the run reads that its config names only by path (the data set's files, a local model's
  files, ``model.pretrained``), with its size and SHA-256 (:func:`file_sha256_cached`: a file up to
  :data:`FULL_HASH_BYTES` is hashed at every start; a larger one once per version, a version being what a rewrite
  cannot keep, and checked against a sample of its blocks at every start); hub data and models by their name;
- **code**: the package's version, the git commit of its checkout where there is one, and a SHA-256 over its source
  files (a change not committed yet counts);
- **environment**: the threads in effect, the torch (and transformers, peft) versions, what selects the CPU kernels,
  the GPU (:mod:`hosfl_dist.runfolder.environment`).

A checkpoint stores the identity of the run that wrote it (in its manifest, :mod:`hosfl_dist.runfolder.checkpoints`)
and summary.json its fingerprint, inputs, code and environment; resume and reuse compare with those, never with
config.yaml, and :func:`identity_differences` names what differs. Resuming continues a run bit for bit, so the code
and the environment must be the same too (``job.allow_code_change=true``, ``job.allow_environment_change=true``
resume anyway and summary.json says so); reusing a finished run (compare, sweep, scaling) asks for the same
fingerprint: what it computes, from the same inputs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config, config_to_dict

RUNTIME_ONLY = {
    "job": (
        "out_dir",
        "resume",
        "overwrite",
        "progress",
        "plots",
        "interface",
        "loggers",
        "allow_code_change",
        "allow_environment_change",
        "allow_unsigned",
        "callbacks",
    ),
    "zo": ("overlap", "overlap_memory_mb", "noise_cache_mb"),
    "server": ("reshard_after_forward",),
}
"""Keys that may differ between a run and its continuation: how it is started or watched, or when the same values are
computed (latency hiding changes the order of the client's forwards, never a bit; the noise cache keeps draws instead
of drawing them again; a server group may keep gathered weights instead of gathering them again), not what it
computes."""
ADDED_KEYS = {
    ("zo", "perturb_batch"): 1,
    ("zo", "batch_clients"): False,
    ("zo", "compile"): "off",
    ("zo", "estimator"): "gaussian",
    ("clients", "dropout"): 0.0,
    ("clients", "dropout_stage"): "before_upload",
    ("clients", "over_select"): 0.0,
    ("clients", "participation"): "",
    ("server", "min_clients"): 0,
    ("job", "plugins"): [],
}
"""Identity keys added after runs were recorded, with the value every earlier run had: at that value a key is left
out of the identity, so a run recorded before it existed keeps its fingerprint (and compares equal); at any other
value it counts like every key."""
# train.early_stopping (added later too) is left out while it is off (no metric), whatever its other keys say; on, it
# is identity: it decides where the run ends, so a study never takes a run stopped early for one that was not
PACKAGE = Path(__file__).resolve().parents[2]
"""The hosfl_dist package folder (its source files are the code's digest)."""
HASH_CACHE = "file-sha256.json"
FULL_HASH_BYTES = 64 << 20
"""Files up to this size are hashed whole at every start (SHA-256 runs at 0.7-1.5 GB/s on the 2-core machine: 64 MiB
in 45-90 ms), so nothing about them is trusted; a larger one is hashed once per version (:func:`file_sha256_cached`;
the costs: docs/checkpoints.md, ``python -m hosfl_dist.measure.hash_cost``)."""
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 16, 64 << 10
"""A large file's sample: 16 blocks of 64 KiB (the first, the last and 14 evenly between), 1 MiB read at a start."""


def comparable_config(cfg: Config) -> dict[str, Any]:
    """The config as identity: without :data:`RUNTIME_ONLY` keys, devices by their kind (``cuda:1`` is ``cuda``)."""
    return comparable(config_to_dict(cfg))


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """:func:`comparable_config` of a config as a dict (e.g. read from a run's config.yaml)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for section, keys in RUNTIME_ONLY.items():
        for key in keys:
            out.get(section, {}).pop(key, None)
    for (section, key), before in ADDED_KEYS.items():
        if out.get(section, {}).get(key, before) == before:
            out.get(section, {}).pop(key, None)
    stopping = out.get("train", {}).get("early_stopping")
    if isinstance(stopping, dict) and not stopping.get("metric"):  # off, whatever its other keys: every earlier run
        out["train"].pop("early_stopping")
    for section, key in (("job", "device"), ("zo", "rng_device")):
        if isinstance(out.get(section, {}).get(key), str):
            out[section][key] = out[section][key].split(":")[0]
    return out


def input_sources(cfg: Config) -> dict[str, Any]:
    """Every input a run reads, by role: a path, or a hub reference (a dict)."""
    from hosfl_dist.data import input_sources as data_sources  # torch: imported where a run's inputs are needed
    from hosfl_dist.errors import HosflError

    out: dict[str, Any] = {}
    try:  # rank 0 of a multi-node job may not see the workers' data: say so rather than fail
        out.update(data_sources(cfg.data))
    except HosflError as exc:
        out["data"] = {"unreadable": str(exc).splitlines()[0][:300]}
    if cfg.model.name == "hf":
        from hosfl_dist.models.sources import model_inputs

        try:
            out.update(model_inputs(cfg.model.source, cfg.model.gguf_file))
        except HosflError as exc:
            out["model"] = {"unreadable": str(exc).splitlines()[0][:300]}
    if cfg.model.pretrained:
        out["model.pretrained"] = cfg.model.pretrained
    if cfg.clients.participation:  # a replayed record decides who takes part: its content is the run's
        out["clients.participation"] = cfg.clients.participation
    return out


def input_files(cfg: Config) -> dict[str, dict[str, Any]]:
    """:func:`input_sources` with each file's path, size and SHA-256 (a missing file: ``"missing": true``)."""
    out: dict[str, dict[str, Any]] = {}
    for role, source in input_sources(cfg).items():
        if isinstance(source, dict):
            out[role] = dict(source)
            continue
        path = Path(source)
        try:
            st = path.stat()
        except OSError:
            out[role] = {"path": str(path), "missing": True}
            continue
        out[role] = {"path": str(path), "size": st.st_size, "sha256": file_sha256_cached(path)}
    return out


def code_identity() -> dict[str, Any]:
    """The package's version, its git commit (where it runs from a checkout) and a digest of its source files."""
    from hosfl_dist import __version__

    return {"version": __version__, "commit": _git_commit(), "source_sha256": _source_digest()}


def plugin_identity(plugins: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The code of the run's plug-ins (``job.plugins``): a digest of each one's source, under ``plugins`` (nothing
    without plug-ins, so a run without them records its code as before)."""
    return {"plugins": {module: _module_digest(module) for module in plugins}} if plugins else {}


def _module_digest(module: str) -> str | None:
    """SHA-256 over a plug-in's source: its file, or every .py file of its package's folder (None: not found)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    origin = Path(spec.origin)
    files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(origin.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def run_identity(cfg: Config) -> dict[str, Any]:
    """This run's identity (the module docstring); read after the runtime set this process's threads."""
    from hosfl_dist.runfolder.environment import environment_identity

    return {
        "config": comparable_config(cfg),
        "inputs": input_files(cfg),
        "code": {**code_identity(), **plugin_identity(cfg.job.plugins)},
        "environment": environment_identity(cfg),
    }


def fingerprint(identity: dict[str, Any]) -> str:
    """One SHA-256 over what a run computes: its config and its inputs' content (not their paths; not the code, not
    the environment: they decide the last bits of the floats, not what is computed)."""
    inputs = {role: _file_key(entry) for role, entry in (identity.get("inputs") or {}).items()}
    what = {"config": identity.get("config"), "inputs": inputs}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def config_key_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The dotted config keys whose values differ between two comparable configs."""
    return _differences(theirs, ours)


def identity_differences(recorded: dict[str, Any], now: dict[str, Any], code: bool = True) -> list[str]:
    """What differs between a recorded identity and this run's, one phrase each (empty: the same run). ``code``:
    whether a change of the package's source counts. The recorded config is read as :func:`comparable` reads it now
    (a key made :data:`RUNTIME_ONLY` since it was written does not count)."""
    theirs_config = recorded.get("config")
    if isinstance(theirs_config, dict):
        theirs_config = comparable(theirs_config)
    out = [f"config key {k}" for k in _differences(theirs_config, now.get("config"))]
    theirs, ours = recorded.get("inputs") or {}, now.get("inputs") or {}
    for role in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(role), ours.get(role)
        if a is None or b is None:
            out.append(f"input {role} ({'not read by' if b is None else 'new in'} this run)")
        elif _file_key(a) != _file_key(b):
            what = b.get("path") or b.get("hub") or role
            out.append(f"input {role} ({what}: " + ("its content differs" if "sha256" in a else "differs") + ")")
    code_a, code_b = recorded.get("code") or {}, now.get("code") or {}
    if code and code_a.get("source_sha256") != code_b.get("source_sha256"):
        out.append(f"the code ({_describe_code(code_a)} -> {_describe_code(code_b)})")
    if code and code_a.get("plugins") != code_b.get("plugins"):
        changed = sorted(m for m in {**(code_a.get("plugins") or {}), **(code_b.get("plugins") or {})}
                         if (code_a.get("plugins") or {}).get(m) != (code_b.get("plugins") or {}).get(m))  # fmt: skip
        out.append(f"the code (plug-in {', '.join(changed)})")
    return out


def _file_key(entry: dict[str, Any]) -> tuple:
    """What makes two input entries the same input: the content for a file (not its path or mtime), the name for
    a hub reference."""
    if "sha256" in entry or entry.get("missing"):
        return (entry.get("sha256"), bool(entry.get("missing")))
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in entry.items()))


def _describe_code(code: dict[str, Any]) -> str:
    if not code:
        return "unrecorded"
    commit = (code.get("commit") or "no commit")[:12]
    return f"{code.get('version', '?')} {commit} source {str(code.get('source_sha256', ''))[:12]}"


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


# -- hashing -----------------------------------------------------------------------------------------------------------
def file_sha256_cached(path: Path) -> str:
    """A file's SHA-256, which a rewrite cannot hide.

    A file of at most :data:`FULL_HASH_BYTES` is hashed at every call. A larger one (a model of many GB) is hashed once
    per version and remembered in ``$HOSFL_CACHE/file-sha256.json``: the version is its size, mtime, ctime, inode and
    device. A rewrite that keeps the size and sets the mtime back (``os.utime``) still moves the ctime, which only
    the kernel sets (faking it takes changing the system clock, or writing the disk beneath the file system); a cache
    hit also re-reads :func:`sampled_sha256` of the file and rehashes it whole where the sample differs."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if st.st_size <= FULL_HASH_BYTES:
        return file_sha256(real)
    version = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"
    cache_file = _cache_dir() / HASH_CACHE
    hit = _read_cache(cache_file).get(real)
    sample = sampled_sha256(real)
    if isinstance(hit, dict) and (hit.get("version"), hit.get("sample")) == (version, sample) and \
            isinstance(hit.get("sha256"), str):  # fmt: skip
        return hit["sha256"]
    digest = file_sha256(real)
    cache = _read_cache(cache_file)  # another process may have added entries meanwhile
    cache[real] = {"version": version, "sample": sample, "sha256": digest}
    try:  # the cache saves time only: a read-only or full disk costs the next start a hash, nothing more
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return digest


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a whole file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sampled_sha256(path: str | Path) -> str:
    """A SHA-256 over a file's size and :data:`SAMPLE_BLOCKS` blocks of it (the first, the last, the others evenly
    between): a cheap check that a cached hash still describes the file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode() + b"\0")
        last = max(0, size - SAMPLE_BLOCK_BYTES)
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cache_dir() -> Path:
    return Path(os.environ.get("HOSFL_CACHE") or Path.home() / ".cache" / "hosfl_dist")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    if not (PACKAGE.parent / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE.parent), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
