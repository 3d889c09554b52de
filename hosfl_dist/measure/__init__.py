"""Measurements beside the runs, each driving production code without the runtime:

- :mod:`.memory`: client memory of each method's own step against a stand-in server (paper App. C.5;
  :mod:`.modes`, :mod:`.standin`, :mod:`.tracker`), ``python -m hosfl_dist.measure.memory``;
- :mod:`.latency`: the App. C.1 latency model, ``python -m hosfl_dist.measure.latency``;
- :mod:`.zo_dimension`: cos(ĝ, g) of the zeroth-order estimates per cut and P
  (``python -m hosfl_dist.experiments.zo_dimension``);
- :mod:`.zo_precision`: the scalars' error against float64 for half-precision weights
  (``python -m hosfl_dist.experiments.zo_precision``);
- :mod:`.hash_cost`: what hashing a run's inputs costs at a start (``python -m hosfl_dist.measure.hash_cost FILE``).

The runtime imports nothing of this package (what a run records of its own memory is :mod:`hosfl_dist.runtime.memory`).
"""
