"""What a server asks of the runtime's compute: forward/backward over a round's rows, and the optimizer step of θs.

The runtime's :class:`~hosfl_dist.runtime.server_compute.GroupCompute` implements it on one rank or over a server
group (FSDP2 shards of θs); a server never sees which. The gradient contract lives there, in one place: after
:meth:`ServerCompute.forward_backward` the gradients of θs hold Σ_m ∇ℓ_m over the clients whose loss was finite (ℓ_m
the mean loss of client m's batch), and :meth:`ServerCompute.step` steps θs with their mean, (1/kept) Σ_m ∇ℓ_m.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from hosfl_dist.models import Activation


@dataclass
class Upload:
    """One client's rows of a round: its activation (``z`` and, for language models, the attention mask) and
    labels."""

    act: Activation
    labels: Tensor

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    @property
    def tokens_per_row(self) -> int:
        z = self.act["z"]
        return z.shape[1] if z.dim() == 3 and "attention_mask" in self.act else 1

    @property
    def shape_key(self) -> tuple:
        return tuple((k, tuple(v.shape[1:])) for k, v in sorted(self.act.items()))


@dataclass
class Passes:
    """What the round's forward/backward found, the same on every server rank (λ on the rank that answers)."""

    losses: dict[int, float]
    """Client -> ℓ_m, for the clients whose loss is finite."""
    nonfinite: set[int]
    """Clients with a non-finite loss: left out of the backward."""
    finite: bool
    """Every gradient of θs and every λ_m came out finite."""
    lams: dict[int, Tensor] = field(default_factory=dict)
    """Client -> λ_m = ∂ℓ_m/∂z_m (Eq. 11), for the clients in ``losses`` (empty on the ranks that do not answer)."""


class ServerCompute(Protocol):
    """The server's compute (see the module docstring). Every server rank calls it in the same order."""

    @property
    def optimizer(self) -> Any:
        """θs's torch optimizer (checkpointed beside θs)."""

    def forward_backward(self, uploads: dict[int, Upload], counts: dict[int, float]) -> Passes:
        """Forward/backward of every upload's rows, gradients zeroed first. ``counts``: client -> its sample count
        C_m (each sample's loss is divided by it, so ℓ_m is the client's mean loss)."""

    def step(self, kept: int, lr: float | None = None) -> None:
        """θs ← opt(θs, (1/kept) Σ_m ∇ℓ_m) at learning rate ``lr`` (None: the optimizer's own); ``kept`` = 0: no
        step. Called once after each :meth:`forward_backward`."""
