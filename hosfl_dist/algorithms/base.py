"""What every algorithm is made of: a server and a worker, both state and math only.

- The **server** (rank 0, or in-process) holds θs, its optimizer and whatever history the method needs; its
  methods declared with :func:`~hosfl_dist.transport.wire.wire` are the only client -> server calls. Ordering,
  gathering a round's calls and running one call at a time are the endpoint's job
  (:class:`~hosfl_dist.transport.endpoint.ServerEndpoint`), not the server's.
- The **worker** (a client worker hosting some logical clients) runs a round for its hosted clients through an
  injected :class:`~hosfl_dist.transport.Transport` (to the server; held as a
  :class:`~hosfl_dist.transport.client.ClientTransport`, which also posts and prefetches calls) and
  :class:`~hosfl_dist.transport.Collective` (to the other client workers). The same worker code runs in every
  runtime.

Neither knows how it is distributed: no process group, future kept between calls, lock or thread. Evaluation is not
theirs either (:mod:`hosfl_dist.evaluation`); a worker only says which θc is evaluated (:meth:`WorkerBase.eval_params`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hosfl_dist.algorithms.compute import ServerCompute
from hosfl_dist.algorithms.participation import Participation, ParticipationPlan
from hosfl_dist.algorithms.rounds import PlannedRounds, Rounds, RoundView
from hosfl_dist.config import AlgorithmConfig, ClientsConfig, ModelConfig, ServerConfig, TrainConfig, ZOConfig
from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.core.params import bind_slots, slot_tensors, trainable_slots
from hosfl_dist.data import FederatedData
from hosfl_dist.errors import NonFiniteError, ProtocolError
from hosfl_dist.models import Activation, SplitModel
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.client import ClientTransport
from hosfl_dist.transport.stub import ServerStub

EVAL_CLIENT = -1
"""Id of the evaluation replica kept by the leader client worker."""


@dataclass(frozen=True)
class MethodConfig:
    """What a method's server and worker are built from: the config sections an algorithm reads, and job.seed.

    The runtime hands it out (:func:`hosfl_dist.runtime.build.method_config`); nothing else of a run's config (the
    job, the data, the model's build, transport, checkpoints) reaches an algorithm.
    """

    algorithm: AlgorithmConfig
    """The method's own knobs (local epochs, alignment interval, global rate, ...)."""
    clients: ClientsConfig
    """M, K, B, the clients' optimizer, replicas, participation."""
    server: ServerConfig
    """The server's optimizer and ``server.min_clients``."""
    zo: ZOConfig
    """The zeroth-order estimate (P, μ, estimator, perturbation and compute modes)."""
    train: TrainConfig
    """The budget of samples and ``train.on_nonfinite``."""
    model: ModelConfig
    """What the client's precision follows (``model.dtype`` of an hf model)."""
    seed: int
    """job.seed: every random stream of the method derives from it."""


@dataclass(frozen=True)
class RoundPlan:
    """The run's rounds and who takes part in each: S_t, the K of M clients a seeded draw picks for round t (more
    with over-selection), and which of them count and deliver (:class:`Participation`). The server and every worker
    hold the same plan and compute the same sets without a message; the server's instructions to the sampled clients
    (seeds, catch-up) are the traffic."""

    seed: int
    """job.seed."""
    total: int
    """M, clients.total."""
    per_round: int
    """K, clients.per_round."""
    rounds: int
    """Rounds of the run when every sampled client delivers: K·B samples each until train.budget_samples (the
    learning-rate schedules' length; rounds that lose clients make a run longer, at the schedule's last rate)."""
    participation: ParticipationPlan
    """Who is sampled, dropped, late, counted and delivers in each round (docs/participation.md)."""

    @classmethod
    def of(cls, cfg: MethodConfig) -> RoundPlan:
        """The plan of a run (what its server and workers build once)."""
        c = cfg.clients
        rounds = -(-cfg.train.budget_samples // (c.per_round * c.batch_size))
        return cls(cfg.seed, c.total, c.per_round, rounds, ParticipationPlan(c, cfg.seed, cfg.server.min_clients))

    def sampled(self, t: int) -> list[int]:
        """S_t, sorted (⌈K·(1+ε)⌉ clients with clients.over_select)."""
        return list(self.round(t).sampled)

    def round(self, t: int) -> Participation:
        """Round t's participation."""
        return self.participation.round(t)


class ServerBase:
    """Parts every server shares: the round's size, the checks on what arrives, train-loss bookkeeping.

    The server fails closed: a call about a client that is not part of the round, or a malformed upload, is refused
    (:class:`ProtocolError`); a non-finite activation, loss, gradient or scalar stops the run or, with
    ``train.on_nonfinite=skip``, drops that client's contribution (counted in the metrics rows).
    """

    def __init__(self, cfg: MethodConfig, split: SplitModel, compute: ServerCompute) -> None:
        self.cfg = cfg
        self.compute = compute
        """The runtime's forward/backward and step of θs (one rank or the server group)."""
        self.round_plan = RoundPlan.of(cfg)
        self.model = split.server
        self.task = split.task
        self.spec = split.spec
        self.device = next(self.model.parameters()).device
        self._loss_sum = 0.0
        self._loss_count = 0
        self._skipped = 0

    def expected_in_round(self, t: int) -> int:
        """Clients whose gathered calls make up round t: the uploads it counts."""
        return len(self.round_plan.round(t).counted)

    def open_round(self, closed: int) -> int:
        """The first round from ``closed`` on that is not skipped: a skipped round (fewer uploads than
        ``server.min_clients``) sends nothing and is closed with the round before it."""
        while self.round_plan.participation.skipped(closed):
            closed += 1
        return closed

    def enter_round(self, t: int) -> None:
        """A call about round t: the server passes the skipped rounds before it; a round out of order is refused."""
        if t > self.rounds_done and self.open_round(self.rounds_done) == t:
            self.rounds_done = t  # rounds_done..t-1 were skipped: nothing to step
        if t != self.rounds_done:
            raise ProtocolError(f"server received round {t} while at round {self.rounds_done}: rounds must not mix")

    # -- what arrives --------------------------------------------------------------------------------------------
    def check_sampled(self, t: int, client: int, what: str, counted: bool = True) -> None:
        """Refuse a call about a client that round t does not count (not sampled, dropped before its upload, late);
        ``counted=False``: about a client it samples (whether it counts or not)."""
        plan = self.round_plan.participation
        if not counted or not plan.decided(t):  # a live round before its uploads decided it: any sampled client
            sampled = plan.sampled(t)
            if client not in sampled:
                raise ProtocolError(f"round {t}: {what} from client {client}, which is not sampled (S_t = "
                                    f"{sampled})")  # fmt: skip
            return
        p = self.round_plan.round(t)
        if client not in p.sampled:
            raise ProtocolError(f"round {t}: {what} from client {client}, which is not sampled (S_t = "
                                f"{list(p.sampled)})")  # fmt: skip
        if client not in p.counted:
            raise ProtocolError(f"round {t}: {what} from client {client}, which the round does not count (counted "
                                f"{list(p.counted)} of S_t = {list(p.sampled)})")  # fmt: skip

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

    # -- live rounds (decided at the runtime's round gate: hosfl_dist.runtime.gate) ----------------------------------
    def pass_skipped(self) -> None:
        """A round decided live as skipped: what the method records of it (HO-SFL: a history row of NaN)."""

    def round_samples(self, t: int) -> int:
        """The samples the server stepped with in round t (the counted clients' batches)."""
        return len(self.round_plan.round(t).counted) * self.cfg.clients.batch_size

    def batches_used(self, t: int) -> dict[int, int]:
        """The batches each counted client of round t drew (a live run moves a client's stream past them)."""
        return dict.fromkeys(self.round_plan.round(t).counted, 1)

    def forget(self, t: int, clients: list[int]) -> None:
        """Round t goes on without ``clients`` (a live round took them out before their part was complete)."""

    def pop_skipped(self) -> int:
        """Client contributions left out since the last call (non-finite, ``train.on_nonfinite=skip``)."""
        out, self._skipped = self._skipped, 0
        return out

    # -- checkpoints and the end-of-run audit --------------------------------------------------------------------
    optimizer: Any = None
    """The server's persistent torch optimizer, if it keeps one (checkpointed beside θs)."""
    rounds_done = 0

    def state_dict(self) -> dict[str, Any]:
        """What the server keeps besides θs and its optimizer, between rounds (and the rounds a live run decided)."""
        state = {"loss": (self._loss_sum, self._loss_count), "skipped": self._skipped, "rounds_done": self.rounds_done}
        live = self.round_plan.participation.live
        return state if live is None else {**state, "live_rounds": [live[t].record() for t in sorted(live)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (self._loss_sum, self._loss_count), self._skipped = state["loss"], state["skipped"]
        self.rounds_done = state["rounds_done"]
        if "live_rounds" in state:
            self.round_plan.participation.restore(state["live_rounds"])

    def resume_payload(self, clients: Sequence[int], leader: bool) -> dict[str, Any]:
        """What a worker hosting ``clients`` needs from the server to rebuild its state after a restart."""
        return {}

    def expected_client_digest(self, t: int) -> str | None:
        """The digest every client replica must report at the end of round t (None: the server cannot tell)."""
        return None

    def client_params_at(self, t: int) -> list[Tensor] | None:
        """θc's trainable tensors at the end of round t as the server knows them (what export writes beside θs), in
        the client module's trainable-slot order; None where the server cannot tell."""
        return None

    def client_stats_at(self, t: int) -> list[Tensor]:
        """θc's BatchNorm running statistics at the end of round t, where the client trains them (a first-order client
        under ``model.freeze_bn=code``); empty otherwise: the client part's own, fixed ones hold."""
        return []

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

    def server_digest(self) -> str:
        return tensors_digest(p for p in self.model.parameters())


class WorkerBase:
    """Parts every client worker shares: hosting logical clients, binding replicas into the client module, and the
    server as the worker calls it (``self.server``, a stub of :attr:`server_class`'s declared calls)."""

    server_class: type = ServerBase
    """The server this worker calls (its ``@wire`` methods make ``self.server``)."""

    def __init__(
        self,
        cfg: MethodConfig,
        split: SplitModel,
        data: FederatedData,
        hosted: Sequence[int],
        transport: Transport,
        collective: Collective,
        rounds: Rounds | None = None,
    ) -> None:
        self.cfg = cfg
        self.round_plan = RoundPlan.of(cfg)
        self.split = split
        self.module = split.client
        self.data = data
        self.hosted = set(hosted)
        self.transport = transport if isinstance(transport, ClientTransport) else ClientTransport(transport)
        self.server = ServerStub(self.server_class, self.transport)
        self.collective = collective
        self.rounds: Rounds = rounds if rounds is not None else PlannedRounds(self.round_plan, collective, hosted)
        """How each round opens and closes: the plan (and the collective), or decided live (the runtime's)."""
        self.slots = trainable_slots(self.module)
        self.processed = 0
        """Samples processed by all clients so far (every worker knows the total)."""

    @property
    def is_leader(self) -> bool:
        """The worker that keeps the evaluation replica and (planned rounds) closes each round."""
        return self.rounds.is_leader

    def begin(self, view: RoundView) -> None:
        """Take the run's count of processed samples from a live round's view (the server's)."""
        if view.processed is not None:
            self.processed = view.processed

    # -- clients that come and go (live rounds: the runtime's driver hands them over between rounds) ----------------
    def adopt(self, clients: dict[int, int], from_server: dict[str, Any]) -> None:
        """Serve ``clients`` from the next round on: each client -> the batches it has drawn so far in the run (its
        stream is rebuilt and moved past them, so it continues where its last batch left it, whoever drew it);
        ``from_server`` is the server's :meth:`ServerBase.resume_payload` for them (what a method rebuilds a
        client's state from)."""
        for m, drawn in sorted(clients.items()):
            self.data.restart(m)
            for _ in range(drawn):
                self.data.next_batch(m)
        self.hosted |= set(clients)

    def release(self, clients: Sequence[int]) -> None:
        """Stop serving ``clients`` (another worker serves them from the next round on)."""
        self.hosted -= set(clients)

    def bind(self, params: Sequence[nn.Parameter]) -> None:
        """Point the client module's trainable slots at a replica's tensors (no copy)."""
        bind_slots(self.slots, params)

    def current_params(self) -> list[Tensor]:
        return slot_tensors(self.slots)

    def fresh_params(self, requires_grad: bool = True) -> list[nn.Parameter]:
        """Copies of the trainable tensors as initialised (every replica starts from the same θc^0)."""
        return [nn.Parameter(p.detach().clone(), requires_grad=requires_grad) for p in self.current_params()]

    def client_forward(self, inputs: Any, forward: Callable[[Any], Activation] | None = None) -> Activation:
        """f_c(inputs) on the client's device, through ``forward`` where given (a compiled f_c)."""
        return (forward or self.split.client_forward)(_to(inputs, self.device))

    @property
    def device(self) -> torch.device:
        return next(iter(self.module.parameters()), torch.zeros(0)).device

    def run_round(self, t: int) -> int:
        """One round for the hosted clients; returns the samples all clients processed in it."""
        raise NotImplementedError

    def eval_params(self, t: int) -> Sequence[nn.Parameter]:
        """θc of round t, to evaluate (the leader worker's evaluation replica, brought up to date)."""
        raise NotImplementedError

    def sync_all(self, t: int) -> None:
        """Bring what the worker holds to round t at the end of the run, so that digests are comparable."""
        raise NotImplementedError

    def sync_all_words(self, t: int) -> str:
        """What :meth:`sync_all` does at round t, in words for the end-of-run log line."""
        raise NotImplementedError

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
