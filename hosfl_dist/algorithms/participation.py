"""Who takes part in each round: a per-round decision that every process computes alike, without a message.

For round t (``clients.*``, ``server.min_clients``; docs/participation.md):
  sampled    ⌈K·(1+ε)⌉ of the M clients (``clients.over_select`` = ε), the seeded draw of
             :func:`~hosfl_dist.core.seeding.sample_clients` (ε = 0: exactly the K clients drawn before)
  dropped    each sampled client independently fails with probability ``clients.dropout``, drawn from (job.seed, t,
             client) by a hash (SplitMix64), so a drop shifts no other random stream; the stage of its failure is
             ``clients.dropout_stage`` (``mixed``: a second hash bit picks before_upload or after_upload)
  arrived    the clients that upload (all but the before_upload drops), in a seeded arrival order
  counted    the first K arrivals: the uploads the server steps with (none when the round is skipped)
  late       the arrivals after the K-th (over-selection): answered "not this round"
  delivered  the counted clients that also finish the round (all but the after_upload drops): what the aggregate
             of the client side (HO-SFL's v̄, a baseline's FedAvg of θc) is over
  skipped    fewer than ``server.min_clients`` uploads arrived: no step, no update, on either side

``clients.participation=FILE`` replaces the draw by a recorded ``participation.jsonl``, checked line by line against
the run's own draw of S_t and against what the rows imply (a file that does not fit is one ConfigError line).
Nothing here touches a tensor: the plan is data (``Participation.record`` is one line of participation.jsonl).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hosfl_dist.config import ClientsConfig
from hosfl_dist.core.seeding import Stream, sample_clients, stream_seed
from hosfl_dist.errors import ConfigError

BEFORE_UPLOAD, AFTER_UPLOAD = "before_upload", "after_upload"
STAGES = (BEFORE_UPLOAD, AFTER_UPLOAD)
RECORD_KEYS = ("round", "sampled", "arrived", "counted", "delivered", "dropped", "late", "skipped")
"""The fields of one participation.jsonl line, in the order they are written."""
_UNIT = float(1 << 63)


@dataclass(frozen=True)
class Participation:
    """One round's participation (see the module docstring); client lists sorted, ``arrived`` in arrival order."""

    round: int
    sampled: tuple[int, ...]
    arrived: tuple[int, ...]
    counted: tuple[int, ...]
    late: tuple[int, ...]
    dropped: dict[int, str] = field(default_factory=dict)
    skipped: bool = False

    @property
    def delivered(self) -> tuple[int, ...]:
        """The counted clients that finished the round (every counted one but the after_upload drops)."""
        return tuple(m for m in self.counted if self.dropped.get(m) != AFTER_UPLOAD)

    @property
    def complete(self) -> bool:
        """Everyone sampled counts and delivers (what every round is without dropout and over-selection)."""
        return not self.skipped and len(self.delivered) == len(self.sampled)

    def record(self) -> dict[str, Any]:
        """The round as one participation.jsonl object."""
        return {
            "round": self.round,
            "sampled": list(self.sampled),
            "arrived": list(self.arrived),
            "counted": list(self.counted),
            "delivered": list(self.delivered),
            "dropped": {str(m): s for m, s in sorted(self.dropped.items())},
            "late": list(self.late),
            "skipped": self.skipped,
        }


def _unit(seed: int, stream: Stream, t: int, client: int) -> float:
    """A uniform draw in [0, 1) of (seed, stream, t, client): counter-based, independent of every other draw."""
    return stream_seed(seed, stream, t, client) / _UNIT


def sample_size(per_round: int, over_select: float) -> int:
    """⌈K·(1+ε)⌉, rounded at 1e-9 first so that 10·1.1 is 11, not 12."""
    return math.ceil(round(per_round * (1.0 + over_select), 9))


class ParticipationPlan:
    """Every round's :class:`Participation` for a run (built once by the server, each worker and the run's record)."""

    def __init__(self, clients: ClientsConfig, seed: int, min_clients: int = 0) -> None:
        """``clients``: the run's section; ``seed``: job.seed; ``min_clients``: server.min_clients (0: K)."""
        c = clients
        self.seed, self.total, self.per_round = seed, c.total, c.per_round
        self.size = sample_size(c.per_round, c.over_select)
        self.dropout, self.stage = c.dropout, c.dropout_stage
        self.min_clients = min_clients or c.per_round
        self.path = c.participation
        self.recorded = read_participation(Path(self.path), self) if self.path else None
        self.emulated = bool(self.dropout or self.size != self.per_round or self.recorded is not None)
        """Whether a round can differ from "the K sampled clients all count and deliver"."""
        self._cache: dict[int, Participation] = {}
        self.live: dict[int, Participation] | None = None
        """Elastic runs (``--serve``): each round as the server decided it from who answered in time
        (:meth:`decide`), instead of a draw; a round not decided yet is not known."""

    def go_live(self) -> None:
        """From now on rounds are what :meth:`decide` says (the server of an elastic run)."""
        self.live, self.emulated = {}, True

    def restore(self, records: list[dict[str, Any]]) -> None:
        """The rounds a live run decided, from a checkpoint (``Participation.record`` of each, in order)."""
        self.go_live()
        assert self.live is not None
        for row in records:
            t = int(row["round"])
            dropped = {int(k): v for k, v in row["dropped"].items()}
            self.live[t] = self.settle(t, list(row["sampled"]), list(row["arrived"]), dropped)

    def decide(self, p: Participation) -> None:
        """Round ``p.round`` as it happened (decided again when its scalars are in: the drops after uploads)."""
        assert self.live is not None
        self.live[p.round] = p

    def decided(self, t: int) -> bool:
        """Whether round t's participation is known (always, but for a live round the server has not decided yet)."""
        return self.live is None or t in self.live

    def round(self, t: int) -> Participation:
        if self.live is not None:
            if t not in self.live:
                raise KeyError(f"round {t} has not been decided yet")
            return self.live[t]
        got = self._cache.get(t)
        if got is None:
            if len(self._cache) > 64:  # rounds are asked for in order: keep the recent ones
                self._cache.clear()
            got = self._cache[t] = self._recorded(t) if self.recorded is not None else self.draw(t)
        return got

    def skipped(self, t: int) -> bool:
        """Whether round t is skipped (a round past the end of a replayed record is not known to be: running it is
        refused, looking ahead at it is not)."""
        if self.recorded is not None and t >= len(self.recorded):
            return False
        if self.live is not None and t not in self.live:
            return False
        return self.round(t).skipped

    def sampled(self, t: int) -> list[int]:
        return sample_clients(self.seed, t, self.total, self.size)

    def draw(self, t: int) -> Participation:
        """Round t's seeded participation."""
        sampled = self.sampled(t)
        dropped = {}
        if self.dropout:
            for m in sampled:
                if _unit(self.seed, Stream.DROPOUT, t, m) < self.dropout:
                    stage = self.stage
                    if stage == "mixed":
                        stage = STAGES[int(_unit(self.seed, Stream.DROPOUT_STAGE, t, m) * 2)]
                    dropped[m] = stage
        arrived = [m for m in sampled if dropped.get(m) != BEFORE_UPLOAD]
        if len(arrived) > self.per_round:  # over-selection: who arrives first is drawn too
            arrived.sort(key=lambda m: stream_seed(self.seed, Stream.ARRIVAL, t, m))
        return self.settle(t, sampled, arrived, dropped)

    def settle(self, t: int, sampled: list[int], arrived: list[int], dropped: dict[int, str]) -> Participation:
        """The rest of round t from who was sampled, who dropped and the order of the arrivals. A client's fate is the
        first thing that happens to it: an upload that is late, or refused by a skipped round, ends its round, so a
        drop after it is not one (sampled = delivered + dropped + late + the uploads skipped rounds refused)."""
        if len(arrived) < self.min_clients:
            dropped = {m: s for m, s in dropped.items() if s == BEFORE_UPLOAD}
            return Participation(t, tuple(sampled), tuple(arrived), (), (), dropped, skipped=True)
        counted, late = arrived[: self.per_round], arrived[self.per_round :]
        dropped = {m: s for m, s in dropped.items() if m not in late}
        return Participation(t, tuple(sampled), tuple(arrived), tuple(sorted(counted)), tuple(sorted(late)), dropped)

    def _recorded(self, t: int) -> Participation:
        assert self.recorded is not None
        if t >= len(self.recorded):
            raise ConfigError(f"invalid value for clients.participation: {self.path!r} (it holds rounds "
                              f"0..{len(self.recorded) - 1}; the run reached round {t})")  # fmt: skip
        return self.recorded[t]

    def totals(self, rounds: int) -> dict[str, int]:
        """summary.json's ``participation`` over rounds 0..rounds-1."""
        out = dict.fromkeys(("sampled", "delivered", "dropped", "late", "rounds_skipped"), 0)
        for t in range(rounds):
            add(out, self.round(t))
        return {**out, "workers_lost": 0, "workers_joined": 0}


def add(totals: dict[str, int], p: Participation) -> None:
    """Add round ``p`` to summary.json's ``participation`` counts."""
    totals["sampled"] += len(p.sampled)
    totals["delivered"] += len(p.delivered)
    totals["dropped"] += len(p.dropped)
    totals["late"] += len(p.late)
    totals["rounds_skipped"] += int(p.skipped)


def read_participation(path: Path, plan: ParticipationPlan) -> list[Participation]:
    """A recorded participation.jsonl, every line checked against the run (``plan``): its round, the run's own draw
    of S_t, and what its arrivals and drops imply (counted, delivered, late, skipped). ConfigError naming the line."""

    def bad(line: int, why: str) -> ConfigError:
        return ConfigError(f"invalid value for clients.participation: {str(path)!r} (line {line}: {why})")

    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc
        raise ConfigError(f"invalid value for clients.participation: {str(path)!r} (cannot read it: "
                          f"{type(exc).__name__}: {why})") from None  # fmt: skip
    rounds = []
    for i, text in enumerate(lines, 1):
        try:
            row = json.loads(text)
        except ValueError:
            raise bad(i, "not a JSON object") from None
        if not isinstance(row, dict) or sorted(row) != sorted(RECORD_KEYS):
            raise bad(i, f"an object with the keys {', '.join(RECORD_KEYS)}")
        t = i - 1
        if row["round"] != t or isinstance(row["round"], bool):
            raise bad(i, f"round {row['round']!r}, expected {t} (one line per round, in order)")
        lists = {k: row[k] for k in ("sampled", "arrived", "counted", "delivered", "late")}
        for key, value in lists.items():
            if not isinstance(value, list) or not all(type(m) is int for m in value):
                raise bad(i, f"{key} must be a list of client ids")
        dropped = row["dropped"]
        if not isinstance(dropped, dict) or not all(isinstance(s, str) for s in dropped.values()):
            raise bad(i, "dropped must map client ids to a stage")
        if not all(k.isdigit() and str(int(k)) == k for k in dropped):
            raise bad(i, "dropped must map client ids (written as decimal strings) to a stage")
        drops = {int(k): s for k, s in dropped.items()}
        if not isinstance(row["skipped"], bool):
            raise bad(i, "skipped must be true or false")
        want = plan.sampled(t)
        if lists["sampled"] != want:
            raise bad(i, f"sampled {lists['sampled']}, but this run's draw of round {t} is {want} (another seed, "
                         "clients.total, clients.per_round or clients.over_select?)")  # fmt: skip
        if any(s not in STAGES for s in drops.values()) or not set(drops) <= set(want):
            raise bad(i, f"dropped must map sampled clients to {' or '.join(STAGES)}")
        uploading = sorted(m for m in want if drops.get(m) != BEFORE_UPLOAD)
        if sorted(lists["arrived"]) != uploading:
            raise bad(i, f"arrived must list the sampled clients not dropped before their upload, {uploading}")
        got = plan.settle(t, want, lists["arrived"], drops)
        if got.skipped != row["skipped"]:
            raise bad(i, f"skipped is {row['skipped']}, but {len(uploading)} upload(s) against server.min_clients="
                         f"{plan.min_clients} make it {got.skipped}")  # fmt: skip
        if got.dropped != drops:
            raise bad(i, f"dropped {dropped}, but a late upload or a skipped round's ends a client's round first")
        for key in ("counted", "delivered", "late"):
            if lists[key] != list(getattr(got, key)):
                raise bad(i, f"{key} {lists[key]}, but its arrivals and drops make it {list(getattr(got, key))}")
        rounds.append(got)
    return rounds
