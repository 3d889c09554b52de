"""Checkpoints for exact resume: written by the server side (:class:`CheckpointStore`), taken and resumed from by
the client workers (:class:`CheckpointManager`, the trainer's component that owns the cadence).

What a checkpoint folder holds, its manifest and how it is verified are the run folder's format
(:mod:`hosfl_dist.runfolder.checkpoints`). Client replicas are not saved: a worker rebuilds each one from the base
replica by replaying the history rows up to the client's round (Algorithm 3), exactly. The server keeps the base
replica current by replaying each history row it trims (so the history stays bounded).

A checkpoint proves itself before a byte of it is loaded (:func:`~hosfl_dist.runfolder.checkpoints.verify_checkpoint`;
under a server group each rank the files it reads, and the decision is the group's): resume takes the newest one that
verifies and names the ones that did not. Older checkpoints are removed only after a newer one verified. Rank 0
signs the manifest with the user's key (:mod:`hosfl_dist.runfolder.signing`); whoever loads checks the signature
first (:func:`~hosfl_dist.runfolder.checkpoints.trusted_manifest`).

``state.pt`` holds plain data only (:func:`check_plain` at every save) and is read with ``torch.load(weights_only=
True)``: a state.pt that holds anything else, whoever wrote it, is refused in one line and never runs code.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import logging
import pathlib
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError
from hosfl_dist.runfolder.checkpoints import (
    PARTIAL,
    checkpoint_folders,
    checkpoint_path,
    commit,
    prune,
    verify_checkpoint,
    write_manifest,
)
from hosfl_dist.runfolder.signing import Key, check_outside, load_key
from hosfl_dist.runtime.control import CheckpointPart, ResumeRequest, SaveCheckpoint

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoopState:
    """Where the training loop stands between rounds."""

    round: int = 0
    """The next round to run."""
    processed: int = 0
    wall_s: float = 0.0


def rng_state() -> dict[str, Any]:
    """This process's global torch RNG (dropout draws from it), to restore on resume."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


PLAIN = (str, int, float, bool, type(None), bytes)
"""The scalars state.pt may hold beside tensors (exactly these types: a subclass would be pickled by its name)."""


def check_plain(obj: Any, where: str = "state") -> None:
    """Refuse (TypeError naming where) anything in ``obj`` but tensors, dicts, lists, tuples and :data:`PLAIN`
    scalars: what ``torch.load(weights_only=True)`` reads back without naming any type."""
    if type(obj) in PLAIN:
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            raise TypeError(f"{where}: a {type(obj).__name__}, not a plain tensor")
        return
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: a key of type {type(k).__name__}")
            check_plain(v, f"{where}.{k}")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__}, which state.pt does not hold "
                    "(tensors, dicts, lists, tuples, str, int, float, bool, None only)")  # fmt: skip


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.pt``, read without running code (``weights_only=True``); ConfigError in one line for
    one that holds anything but plain data (never written by this version)."""
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only refusals, a torn zip, anything torch cannot read
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"checkpoint {path}: state.pt is not plain data this version wrote, refused unread "
                          f"({first})") from None  # fmt: skip
    if not isinstance(state, dict) or not {"server", "loop", "workers", "rng"} <= set(state):
        raise ConfigError(f"checkpoint {path}: state.pt does not hold a checkpoint's state")
    return state


def _dcp_globals() -> dict[tuple[str, str], Any]:
    """The only names a DCP ``.metadata`` pickle may ask for: DCP's own metadata records, torch.Size, a path, a
    layout by its name (dtypes are admitted by :class:`_MetadataUnpickler` as they are looked up)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
             "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")  # fmt: skip
    return {
        **{(metadata.__name__, n): getattr(metadata, n) for n in names},
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` (a pickle, which torch's reader would load unrestricted) admitting only
    :func:`_dcp_globals` and torch's dtypes: a crafted one is refused, never run."""

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_globals().get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"model/.metadata asks for {module}.{name}")
        return found


def _safe_dcp(path: Path) -> dict[str, Any]:
    """A DCP reader and planner that run no code from the checkpoint: the metadata through
    :class:`_MetadataUnpickler`, the non-tensor items (the optimizer's hyperparameters) with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                found = _MetadataUnpickler(f).load()
            if getattr(found, "storage_meta", None) is None:
                found.storage_meta = StorageMeta()
            found.storage_meta.load_id = self.load_id
            return found

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return {"storage_reader": Reader(str(path)), "planner": Planner()}


def _disk_full(path: Path, out_dir: Path) -> bool:
    """Whether the file system holding ``path`` has no room left for a checkpoint (as large as the newest one there,
    or 1 MiB)."""
    newest = checkpoint_folders(out_dir)
    need = max(1 << 20, sum(p.stat().st_size for p in newest[0].rglob("*") if p.is_file()) if newest else 0)
    try:
        return shutil.disk_usage(path if path.exists() else path.parent).free < need
    except OSError:
        return False


def _model_state(server: Any) -> tuple[dict[str, Any], Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(ignore_frozen_params=True)
    state = {"model": get_model_state_dict(server.model, options=opts)}
    opt = server.optimizer
    if opt is not None and opt.state:  # a torch optimizer that has stepped (a fresh one has no state to save)
        state["optim"] = get_optimizer_state_dict(server.model, opt, options=opts)
    return state, opts


@contextlib.contextmanager
def _no_dist_quiet() -> Iterator[None]:
    """DCP in one process without a group warns that torch.distributed is disabled: that is what no_dist asks for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class CheckpointStore:
    """Saves and loads a run's checkpoints. On the server side only: rank 0, and under FSDP every server rank
    (``group``), which must call :meth:`save` / :meth:`load` together (rank 0's step executor announces them)."""

    def __init__(self, out_dir: str | Path, keep: int, group: dist.ProcessGroup | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.keep = keep
        self.group = group
        self.rank0 = group is None or dist.get_rank(group) == 0
        self._key: Key | None = None
        self.last_sign_s = 0.0
        """Seconds the last save spent hashing the files and signing the manifest."""

    def key(self) -> Key:
        """The user's signing key (made on first use), kept outside the run's folder; loaded once."""
        if self._key is None:
            key = load_key()
            check_outside(key, self.out_dir)
            self._key = key
        return self._key

    def _dcp(self) -> dict[str, Any]:
        return {"process_group": self.group} if self.group is not None else {"no_dist": True}

    def save(
        self,
        server: Any,
        loop: LoopState,
        workers: dict[str, Any],
        meta: dict[str, Any],
        identity: dict[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint after ``loop.round``: every rank its shard of θs, rank 0 the rest, then the manifest
        (``identity``: the run's, :mod:`hosfl_dist.runfolder.identity`), then one rename makes it complete.
        Older checkpoints are pruned only once the new one verifies."""
        import torch.distributed.checkpoint as dcp

        final = checkpoint_path(self.out_dir, loop.round)
        partial = final.with_name(final.name + PARTIAL)
        if self.rank0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        if self.group is not None:
            dist.barrier(group=self.group)
        state, _ = _model_state(server)
        try:
            with _no_dist_quiet():
                dcp.save(state, checkpoint_id=str(partial / "model"), **self._dcp())
            if self.rank0:
                extra = {
                    "server": server.state_dict(),
                    "loop": dataclasses.asdict(loop),
                    "workers": workers,
                    "rng": rng_state(),  # the server process's (dropout on the server side)
                }
                check_plain(extra)  # what weights_only=True reads back
                torch.save(extra, partial / "state.pt")
                info = {**meta, "round": loop.round, "processed": loop.processed, "has_optim": "optim" in state}
                (partial / "meta.json").write_text(json.dumps(info, indent=2) + "\n")
                began = time.perf_counter()
                write_manifest(partial, loop.round, identity, self.key())  # last: a folder with a manifest is complete
                self.last_sign_s = time.perf_counter() - began
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            full = not isinstance(exc, (KeyboardInterrupt, SystemExit)) and _disk_full(partial, self.out_dir)
            if self.rank0:
                shutil.rmtree(partial, ignore_errors=True)  # the space it took, back for the failure's record
            if full:  # torch reports a full disk as a zip writer's "unexpected pos": say what it is
                raise OSError(errno.ENOSPC, f"No space left on device (writing the checkpoint of round {loop.round} "
                              f"into {self.out_dir})") from exc  # fmt: skip
            raise
        if self.rank0:
            commit(partial, final)
            problem = verify_checkpoint(final)
            if problem is None:
                prune(self.out_dir, self.keep)
            else:  # the disk did not keep what was written: keep every older checkpoint
                logger.warning(f"checkpoint of round {loop.round} failed verification right after it was written "
                               f"({problem}); no older checkpoint was removed")  # fmt: skip
        if self.group is not None:
            dist.barrier(group=self.group)
        return final

    def verify(self, path: str | Path, digest: str | None = None) -> str | None:
        """:func:`verify_checkpoint` of what this server rank reads from ``path`` (``digest``: of the manifest rank 0
        verified)."""
        return verify_checkpoint(Path(path), dist.get_rank(self.group) if self.group is not None else None, digest)

    def load(self, server: Any, path: str | Path) -> tuple[LoopState, dict[str, Any], dict[str, Any]]:
        """Restore the server from ``path`` (verified and its signature checked before: :meth:`verify`,
        :func:`~hosfl_dist.runfolder.checkpoints.trusted_manifest`); returns the loop state, the workers' parts and
        the meta data."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        extra = read_state(path)  # first: a state.pt this version did not write is refused before anything changes
        state, opts = _model_state(server)
        if not meta["has_optim"]:
            state.pop("optim", None)
        elif "optim" not in state:  # a fresh optimizer: make its state tensors to load into
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            state["optim"] = get_optimizer_state_dict(server.model, server.optimizer, options=opts)
        refused = f"checkpoint {path}: model/ is not plain data this version wrote, refused unread"
        try:
            with open(path / "model" / ".metadata", "rb") as f:  # first, where its refusal is one line
                _MetadataUnpickler(f).load()
            with _no_dist_quiet():
                dcp.load(state, **_safe_dcp(path / "model"), **self._dcp())
        except pickle.UnpicklingError as exc:  # a crafted .metadata
            raise ConfigError(f"{refused} ({str(exc).splitlines()[0][:200]})") from None
        except dcp.api.CheckpointException as exc:  # DCP wraps what failed on each rank
            if "Weights only load failed" not in str(exc) and "UnpicklingError" not in str(exc):
                raise
            raise ConfigError(f"{refused} (a non-tensor item holds more than plain data)") from None
        # frozen parameters were left out of the checkpoint (they never change; they come from the model's source),
        # so they are the one kind of key allowed to be missing here
        loaded = set_model_state_dict(server.model, state["model"], options=dataclasses.replace(opts, strict=False))
        frozen = {name for name, p in server.model.named_parameters() if not p.requires_grad}
        missing = [k for k in loaded.missing_keys if k not in frozen]
        if missing or loaded.unexpected_keys:
            raise ConfigError(f"checkpoint {path} does not fit the server model (missing {missing[:3]}, "
                                  f"unexpected {list(loaded.unexpected_keys)[:3]})")  # fmt: skip
        if "optim" in state:
            set_optimizer_state_dict(server.model, server.optimizer, state["optim"], options=opts)
        server.load_state_dict(extra["server"])
        set_rng_state(extra["rng"])
        return LoopState(**extra["loop"]), extra["workers"], meta


class CheckpointManager:
    """The client workers' side of checkpoints: when to take one, the worker's part of it, and resuming from one.

    Every ``checkpoint.interval_samples`` processed samples (and when the run stops on a signal), after the round's
    evaluation: each worker waits for its posted calls, sends its part (its clients' data-stream positions, what its
    algorithm keeps, its traffic counters and RNG) to the front, and the leader asks the front to write the
    checkpoint once every part is in; nobody goes on before it is written. Resuming, each worker gets its part back
    with what the server adds to it (HO-SFL: the base replica and the history its replicas are rebuilt from).
    """

    def __init__(self, cfg: Config, trainer_rank: int, worker: Any, meter: Any, peers: Any, control: Any) -> None:
        self.cfg = cfg
        self.rank = trainer_rank
        self.worker = worker
        self.meter = meter
        self.peers = peers
        self.control = control
        self.every = cfg.checkpoint.interval_samples
        self.last = 0
        """Processed samples at the last checkpoint (or at the start)."""

    def resume(self) -> LoopState | None:
        """Restore this worker from the checkpoint the front resumes from (None: the run starts afresh)."""
        hosted = tuple(sorted(self.worker.hosted))
        got = self.control.send(ResumeRequest(self.rank, hosted, self.peers.is_leader))
        if got is None:
            return None
        part = got["part"]
        self.worker.load_state_dict(part["worker"], got["from_server"])
        self.meter.load_state_dict(part["meter"])
        if "rng" in part:
            set_rng_state(part["rng"])
        self.last = got["loop"].processed
        return got["loop"]

    def due(self, processed: int) -> bool:
        """Whether the cadence asks for a checkpoint at ``processed`` samples."""
        return bool(self.every) and processed // self.every > self.last // self.every

    def save(self, t: int, processed: int) -> None:
        """Take the checkpoint after round t (every worker calls this at the same round boundary)."""
        self.worker.transport.flush()  # the round's posted calls reached the server
        part = {"worker": self.worker.state_dict(), "meter": self.meter.state_dict(), "rng": rng_state()}
        self.control.send(CheckpointPart(self.rank, part))
        self.peers.barrier()  # every part is in before the leader asks for the save
        # nobody goes on (or exits) before the checkpoint is written: the save is one request of the leader's, waited
        # for with that request's timeout (a barrier would wait with a collective's)
        key = f"checkpointed/{t}"
        if self.peers.is_leader:
            self.control.send(SaveCheckpoint(t, processed))
            self.peers.post(key)
        else:
            self.peers.wait_for(key, self.cfg.server.rpc_timeout_s)
        self.last = processed
