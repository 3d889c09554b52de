"""The App. C.1 latency model: :mod:`.model` (closed form and Monte Carlo; numpy and the config tree only) and
:mod:`.cli` (``python -m hosfl_dist.measure.latency``: YAML, flags, table, JSON and plot)."""

from hosfl_dist.measure.latency.model import (
    Band,
    DecoderShape,
    Hardware,
    LatencyModel,
    LayerResult,
    Workload,
    simulate,
    simulate_round_time,
)

__all__ = [
    "Band",
    "DecoderShape",
    "Hardware",
    "LatencyModel",
    "LayerResult",
    "Workload",
    "simulate",
    "simulate_round_time",
]
