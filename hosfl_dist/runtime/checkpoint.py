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

``state.pt`` holds plain data only (checked at every save) and nothing of a checkpoint is read with an unrestricted
unpickler (:mod:`hosfl_dist.runtime.plain`): a file that holds anything else, whoever wrote it, is refused in one
line and never runs code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
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
from hosfl_dist.runfolder.environment import environment_identity
from hosfl_dist.runfolder.signing import Key, check_outside, load_key
from hosfl_dist.runtime.control import CheckpointPart, ResumeRequest, SaveCheckpoint
from hosfl_dist.runtime.plain import MetadataUnpickler, check_plain, read_state, safe_dcp

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
                MetadataUnpickler(f).load()
            with _no_dist_quiet():
                dcp.load(state, **safe_dcp(path / "model"), **self._dcp())
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

    def __init__(
        self, cfg: Config, trainer_rank: int, worker: Any, meter: Any, peers: Any, control: Any, extra: Any = None
    ) -> None:
        self.cfg = cfg
        self.extra = extra
        """What the runtime adds to this worker's part (``state_dict`` / ``load_state_dict``: an elastic membership)."""
        self.rank = trainer_rank
        self.worker = worker
        self.meter = meter
        self.peers = peers
        self.control = control
        self.every = cfg.checkpoint.interval_samples
        self.last = 0
        """Processed samples at the last checkpoint (or at the start)."""

    def resume(self) -> LoopState | None:
        """Restore this worker from the checkpoint the front resumes from (None: the run starts afresh). The worker's
        environment goes with the request: the front records it and refuses a resume in another one."""
        hosted = tuple(sorted(self.worker.hosted))
        environment = environment_identity(self.cfg)
        got = self.control.send(ResumeRequest(self.rank, hosted, self.peers.is_leader, environment))
        if got is None:
            return None
        part = got["part"]
        self.worker.load_state_dict(part["worker"], got["from_server"])
        self.meter.load_state_dict(part["meter"])
        if self.extra is not None:
            self.extra.load_state_dict(part["runtime"])
        if "rng" in part:
            set_rng_state(part["rng"])
        self.last = got["loop"].processed
        return got["loop"]

    def due(self, processed: int) -> bool:
        """Whether the cadence asks for a checkpoint at ``processed`` samples."""
        return bool(self.every) and processed // self.every > self.last // self.every

    def save(self, t: int, processed: int) -> Any:
        """Take the checkpoint after round t (every worker calls this at the same round boundary); the front's answer
        to the leader (its folder, and a request to stop where one was made: None elsewhere)."""
        self.worker.transport.flush()  # the round's posted calls reached the server
        part = {"worker": self.worker.state_dict(), "meter": self.meter.state_dict(), "rng": rng_state()}
        if self.extra is not None:
            part["runtime"] = self.extra.state_dict()
        self.control.send(CheckpointPart(self.rank, part))
        self.peers.barrier()  # every part is in before the leader asks for the save
        # nobody goes on (or exits) before the checkpoint is written: the save is one request of the leader's, waited
        # for with that request's timeout (a barrier would wait with a collective's)
        key = f"checkpointed/{t}"
        answer = None
        if self.peers.is_leader:
            answer = self.control.send(SaveCheckpoint(t, processed))
            self.peers.post(key)
        else:
            self.peers.wait_for(key, self.cfg.server.rpc_timeout_s)
        self.last = processed
        return answer
