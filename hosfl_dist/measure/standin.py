"""The stand-in server (the paper's "Mocker", App. C.5): answers any client call with a correctly shaped reply.

Nothing is computed from what the client sends, so the client's memory is measured apart from the server's while
the client runs its algorithm's own step (the worker classes of :mod:`hosfl_dist.algorithms`):

    hosfl    ``sync``: the round's seeds and an empty history; ``submit``: λ shaped like z, made when the client
             waits for it (with latency hiding it arrives after the P perturbed forwards, as on a real link)
    sfl      ``submit``: λ shaped like z, at once
    zo_sfl   ``submit``: the scalar g of the two-point estimate
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hosfl_dist.core.seeding import round_seeds


class StandInServer:
    """A transport whose server is the stand-in; client 0 is every round's only sampled client."""

    def __init__(self, seed: int, num_perturbations: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.seed, self.P = seed, num_perturbations

    def gradient(self, z: Tensor) -> Tensor:
        """λ = ∂ℓ/∂z: same shape, dtype and device as z."""
        return torch.randn(z.shape, generator=self.gen, dtype=z.dtype).to(z.device)

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Answer:
        if method == "sync":
            none = torch.zeros(0, self.P)
            seeds = torch.tensor(round_seeds(self.seed, kwargs["t"], self.P), dtype=torch.long)
            return Answer(lambda: {"seeds": seeds, "hist_seeds": none.long(), "hist_scalars": none})
        if method == "submit" and "act_plus" in kwargs:  # two-point methods: one scalar comes down
            return Answer(lambda: {"g": torch.rand((), generator=self.gen)})
        if method == "submit":
            z = kwargs["act"]["z"]
            return Answer(lambda: {"lam": self.gradient(z)})
        raise RuntimeError(f"the profiler's stand-in server does not answer {method!r}")


class Answer:
    """A reply made when the client waits for it, so it is not alive before (and holds nothing afterwards)."""

    def __init__(self, make: Callable[[], dict[str, Tensor]]) -> None:
        self.make: Callable[[], dict[str, Tensor]] | None = make

    def done(self) -> bool:
        """Not before the client waits for it: with latency hiding every z̃ is kept, as when λ arrives after the P
        perturbed forwards (the memory price measured is latency hiding's whole)."""
        return self.make is None

    def wait(self) -> dict[str, Tensor]:
        make, self.make = self.make, None  # the answer holds no reference to what was uploaded afterwards
        if make is None:
            raise RuntimeError("the stand-in's answer was already taken")
        return make()


class OneBatch:
    """The hosted client's data: the profiled batch, every step."""

    def __init__(self, x: Any, y: Tensor) -> None:
        self.batch = (x, y)

    def next_batch(self, client: int) -> tuple[Any, Tensor]:
        return self.batch


class NoPeers:
    """The collective of a worker alone that is not the leader (so it keeps no evaluation replica)."""

    is_leader = False

    def aggregate(self, exchange: Any, rows: Tensor, mine: Any, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return fn(rows)

    def coordinate(self, t: Tensor) -> Tensor:
        return t
