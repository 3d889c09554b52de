"""What every algorithm is made of: a server and a worker, both state and math only.

- The **server** (rank 0, or in-process) holds θs, its optimizer and whatever history the method needs; its
  methods declared with :func:`~hosfl_dist.transport.wire.wire` are the only client -> server calls. Ordering,
  gathering a round's calls and running one call at a time are the endpoint's job
  (:class:`~hosfl_dist.transport.endpoint.ServerEndpoint`), not the server's.
- The **worker** (a client worker hosting some logical clients) runs a round for its hosted clients through an
  injected :class:`~hosfl_dist.transport.Transport` (to the server) and :class:`~hosfl_dist.transport.Collective`
  (to the other client workers). The same worker code runs in every runtime.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.config import Config
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.params import bind_slots, slot_tensors, trainable_slots
from hosfl_dist.core.seeding import sample_clients
from hosfl_dist.data import FederatedData
from hosfl_dist.errors import NonFiniteError, ProtocolError
from hosfl_dist.models import Activation, SplitModel, server_forward
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.wire import EVAL, wire

EVAL_CLIENT = -1
"""Id of the evaluation replica kept by the leader client worker."""


def round_plan(cfg: Config, t: int) -> list[int]:
    """S_t: the K clients the server samples for round t. A seeded draw, so the server and every worker compute the
    same set without a message; the server's instructions to the sampled clients (seeds, catch-up) are the traffic."""
    return sample_clients(cfg.job.seed, t, cfg.clients.total, cfg.clients.per_round)


class ServerBase:
    """Parts every server shares: the round's size, the checks on what arrives, evaluation, train-loss bookkeeping.

    The server fails closed: a call about a client that is not part of the round, or a malformed upload, is refused
    (:class:`ProtocolError`); a non-finite activation, loss, gradient or scalar stops the run or, with
    ``train.on_nonfinite=skip``, drops that client's contribution (counted in the metrics rows).
    """

    def __init__(self, cfg: Config, split: SplitModel) -> None:
        self.cfg = cfg
        self.model = split.server
        self.task = split.task
        self.spec = split.spec
        self.device = next(self.model.parameters()).device
        self._loss_sum = 0.0
        self._loss_count = 0
        self._skipped = 0
        self._eval_stats: dict[str, float] = {}

    def expected_in_round(self, t: int) -> int:
        """Clients whose gathered calls make up round t."""
        return self.cfg.clients.per_round

    # -- what arrives --------------------------------------------------------------------------------------------
    def check_sampled(self, t: int, client: int, what: str) -> None:
        """Refuse a call about a client that the server did not sample for round t."""
        if client not in round_plan(self.cfg, t):
            raise ProtocolError(f"round {t}: {what} from client {client}, which is not sampled (S_t = "
                                f"{round_plan(self.cfg, t)})")  # fmt: skip

    def admit(self, t: int, client: int, act: Activation, labels: Tensor) -> bool:
        """Whether an upload takes part in round t: a malformed one is refused; a non-finite one stops the run or,
        with ``train.on_nonfinite=skip``, is left out (False)."""
        if self.spec is not None:
            problem = self.spec.problem(act, labels, self.cfg.clients.batch_size)
            if problem is not None:
                raise ProtocolError(f"round {t}: client {client} sent {problem}")
        for k, v in act.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                return self.nonfinite(t, client, f"activation {k}")
        return True

    def nonfinite(self, t: int, client: int | str, what: str) -> bool:
        """A non-finite quantity: stop (NonFiniteError) or count a skip and return False."""
        if self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(f"round {t}: non-finite {what} of client {client} (train.on_nonfinite=stop)")
        self._skipped += 1
        return False

    def pop_skipped(self) -> int:
        """Client contributions left out since the last call (non-finite, ``train.on_nonfinite=skip``)."""
        out, self._skipped = self._skipped, 0
        return out

    # -- checkpoints and the end-of-run audit --------------------------------------------------------------------
    optimizer: Any = None
    """The server's persistent torch optimizer, if it keeps one (checkpointed beside θs)."""
    rounds_done = 0

    def state_dict(self) -> dict[str, Any]:
        """What the server keeps besides θs and its optimizer, between rounds."""
        return {"loss": (self._loss_sum, self._loss_count), "skipped": self._skipped, "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (self._loss_sum, self._loss_count), self._skipped = state["loss"], state["skipped"]
        self.rounds_done = state["rounds_done"]

    def resume_payload(self, clients: Sequence[int], leader: bool) -> dict[str, Any]:
        """What a worker hosting ``clients`` needs from the server to rebuild its state after a restart."""
        return {}

    def expected_client_digest(self, t: int) -> str | None:
        """The digest every client replica must report at the end of round t (None: the server cannot tell)."""
        return None

    def audit(self, rounds: int, client_digests: dict[str, str]) -> str | None:
        """What is wrong with an end-of-run report (None: it matches the server's own state)."""
        if rounds != self.rounds_done:
            return f"the report says {rounds} rounds, the server ran {self.rounds_done}"
        want = self.expected_client_digest(rounds)
        wrong = {w: d for w, d in client_digests.items() if want is not None and d != want}
        if wrong:
            return f"client digests {wrong} differ from the server's replay of the history ({want})"
        return None

    def record_loss(self, losses: Sequence[float]) -> None:
        self._loss_sum += float(sum(losses))
        self._loss_count += len(losses)

    def pop_train_loss(self) -> float | None:
        """Mean client-batch loss since the last call (None if no batch was trained)."""
        if not self._loss_count:
            return None
        out = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = 0.0, 0
        return out

    # -- evaluation ----------------------------------------------------------------------------------------------
    def _eval_forward(self, act: Activation, past_key_values: Any = None) -> Tensor:
        act = {k: v.to(self.device) for k, v in act.items()}
        with torch.no_grad():
            was = self.model.training
            if was:  # a decoding step is short: walking every module to switch modes is worth skipping
                self.model.eval()
            if past_key_values is None:
                out = server_forward(self.model, act)
            else:  # through the module's own forward, where an FSDP-sharded root gathers its parameters
                out = self.model(act, past_key_values=past_key_values)
            if was:
                self.model.train()
        return out

    def _add_eval_stats(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self._eval_stats[k] = self._eval_stats.get(k, 0.0) + v

    @wire(args={"act": EVAL, "labels": EVAL})
    def eval_batch(self, act: Activation, labels: Tensor) -> None:
        self._add_eval_stats(self.task.eval_stats(self._eval_forward(act), labels.to(self.device)))

    # Generation tasks (SQuAD): the worker drives greedy decoding through the split with eval_next_token, then
    # sends the generated tokens and the gold labels to be scored with eval_generated.
    _eval_cache: _EvalCache | None = None
    """The KV cache of f_s's blocks for the evaluation batch being decoded (at most one lives)."""

    @wire(args={"act": EVAL, "keep": EVAL}, result={"token": EVAL})
    def eval_next_token(
        self, act: Activation, cache: Hashable | None = None, keep: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The greedy next token (B,) of each row of an evaluation activation; the head runs at one position a row.

        Without ``cache`` the activation holds whole sequences. With ``cache`` (the worker's id of an evaluation
        batch) f_s reuses past keys and values: a call whose z covers the whole mask (the prompts, (B, T, D)) starts
        that batch's cache, replacing any other; each later call sends only the newest token's z (B, 1, D) and the
        mask extended by one column, after the rows of the previous call not in ``keep`` were dropped (the worker
        drops the same rows from its own cache).
        """
        mask, length = act["attention_mask"].to(self.device), act["z"].shape[1]
        kv = None if cache is None else self._eval_kv(cache, act["z"].shape[0], length, mask.shape[1], keep)
        out = self._eval_forward({**act, **self.task.next_token_inputs(mask, length)}, kv)  # (B, V)
        return {"token": self.task.next_token(out, mask).cpu()}

    def _eval_kv(self, key: Hashable, rows: int, length: int, columns: int, keep: Tensor | None) -> Any:
        """The cache an eval_next_token call continues (or starts, for prompts), checked against what it holds."""
        if length == columns:  # prompts: a new batch
            self._eval_cache = _EvalCache(key, self.model.new_cache(), rows)
        held = self._eval_cache
        if held is None or held.key != key:
            raise ProtocolError(f"evaluation batch {key!r}: a decoding step without its prompts (the server holds "
                                f"the cache of {None if held is None else held.key!r})")  # fmt: skip
        if keep is not None:
            if keep.dim() != 1 or not bool(((keep >= 0) & (keep < held.rows)).all()):
                raise ProtocolError(f"evaluation batch {key!r}: keep {keep.tolist()} is not a list of its rows")
            held.kv.batch_select_indices(keep.to(self.device))
            held.rows = len(keep)
        if rows != held.rows or columns != held.columns + length:
            raise ProtocolError(f"evaluation batch {key!r}: a step of {rows} rows and {columns} positions, the cache "
                                f"holds {held.rows} rows and {held.columns} positions")  # fmt: skip
        held.columns = columns
        return held.kv

    @wire(args={"tokens": EVAL, "labels": EVAL})
    def eval_generated(self, tokens: Tensor, labels: Tensor) -> None:
        self._eval_cache = None  # the batch is decoded
        self._add_eval_stats(self.task.generation_stats(tokens, labels))

    def pop_eval_metrics(self) -> dict[str, float]:
        self._eval_cache = None
        stats, self._eval_stats = self._eval_stats, {}
        return self.task.finalize(stats)

    def server_digest(self) -> str:
        return tensors_digest(p for p in self.model.parameters())


class WorkerBase:
    """Parts every client worker shares: hosting logical clients, binding replicas into the client module."""

    def __init__(
        self,
        cfg: Config,
        split: SplitModel,
        data: FederatedData,
        hosted: Sequence[int],
        transport: Transport,
        collective: Collective,
    ) -> None:
        self.cfg = cfg
        self.split = split
        self.module = split.client
        self.data = data
        self.hosted = set(hosted)
        self.transport = transport
        self.collective = collective
        self.slots = trainable_slots(self.module)
        self.processed = 0
        """Samples processed by all clients so far (every worker knows the total)."""

    def plan(self, t: int) -> tuple[list[int], list[int]]:
        """(S_t, the sampled clients this worker hosts)."""
        sampled = round_plan(self.cfg, t)
        return sampled, [m for m in sampled if m in self.hosted]

    def bind(self, params: Sequence[nn.Parameter]) -> None:
        """Point the client module's trainable slots at a replica's tensors (no copy)."""
        bind_slots(self.slots, params)

    def current_params(self) -> list[Tensor]:
        return slot_tensors(self.slots)

    def fresh_params(self, requires_grad: bool = True) -> list[nn.Parameter]:
        """Copies of the trainable tensors as initialised (every replica starts from the same θc^0)."""
        return [nn.Parameter(p.detach().clone(), requires_grad=requires_grad) for p in self.current_params()]

    def client_forward(self, inputs: Any) -> Activation:
        return self.split.client_forward(_to(inputs, self.device))

    @property
    def device(self) -> torch.device:
        return next(iter(self.module.parameters()), torch.zeros(0)).device

    def run_round(self, t: int) -> int:
        """One round for the hosted clients; returns the samples all clients processed in it."""
        raise NotImplementedError

    eval_kv_cache = True
    """Generation tasks: greedy decoding keeps KV caches on both sides of the split (False: each step re-runs the
    whole sequences, the reference path that bench/generation.py times against it)."""

    def evaluate(self, t: int) -> None:
        """Run the held-out split through an up-to-date θc and the server (leader worker only)."""
        self.bind(self.eval_params(t))
        self.module.eval()
        generation = hasattr(self.split.task, "generate")  # generation tasks decode through the split
        with torch.no_grad():
            for i, (x, y) in enumerate(self.data.eval_batches(self.cfg.train.eval_batch_size)):
                if not generation:
                    self.transport.call("eval_batch", act=self.client_forward(x), labels=y)
                else:
                    self.transport.call("eval_generated", tokens=self.generate(x, key=(t, i)), labels=y)
        self.module.train()

    def generate(self, x: dict[str, Tensor], key: Hashable) -> Tensor:
        """Greedy continuations (B, n) of a batch of prompts through f_c and the server (-1 after a row's end).

        With :attr:`eval_kv_cache` and a decoder-LM client, f_c runs each new token only, on a cache this worker
        keeps for the batch, and the server keeps the matching cache of f_s under ``key``.
        """
        task = self.split.task
        client = _decoder_client(self.module) if self.eval_kv_cache else None
        if client is None:
            step = lambda act: self.transport.call("eval_next_token", act=act)["token"]  # noqa: E731
            return task.generate(x, self.client_forward, step)
        kv = client.new_cache()

        def cached_step(input_ids: Tensor, attention_mask: Tensor, keep: Tensor | None) -> Tensor:
            if keep is not None:
                kv.batch_select_indices(keep.to(self.device))
            act = client(input_ids.to(self.device), attention_mask.to(self.device), past_key_values=kv)
            return self.transport.call("eval_next_token", act=act, cache=key, keep=keep)["token"]

        return task.generate_cached(x, cached_step)

    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        raise NotImplementedError

    def sync_all(self, t: int) -> None:
        """Bring what the worker holds to round t at the end of the run, so that digests are comparable."""
        raise NotImplementedError

    def quiesce(self) -> None:
        """Let every call of the finished round reach the server before a checkpoint is taken."""

    def state_dict(self) -> dict[str, Any]:
        """What the worker keeps between rounds: its clients' data-stream positions and the samples processed."""
        return {"data": self.data.state_dict(sorted(self.hosted)), "processed": self.processed}

    def load_state_dict(self, state: dict[str, Any], from_server: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``from_server`` is the server's :meth:`ServerBase.resume_payload`."""
        self.data.load_state_dict(state["data"])
        self.processed = state["processed"]

    def client_digest(self) -> str:
        raise NotImplementedError


def _to(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return inputs.to(device)


@dataclass
class _EvalCache:
    """The server's KV cache of one evaluation batch: the worker's key, the cache, and what it holds."""

    key: Hashable
    kv: Any
    rows: int
    columns: int = 0


def _decoder_client(module: nn.Module) -> nn.Module | None:
    """The split decoder LM's f_c inside a client module (None for other models): cached decoding calls it with a
    KV cache, past wrappers such as ZeroOrderClient that only forward the two inputs."""
    from hosfl_dist.models.hf_split import HFClient  # transformers only for LMs

    return next((m for m in module.modules() if isinstance(m, HFClient)), None)
