"""Experiment suite: run several methods or a grid of settings over seeds, and report them as the paper does.

- ``python -m hosfl_dist.experiments.compare``: a set of methods on one setting -> table + plots;
- ``python -m hosfl_dist.experiments.sweep``: a grid of overrides (ablations: P, μ, cut layer) -> table + plots;
- ``python -m hosfl_dist.experiments.zo_dimension``: cos(ĝ, g) of the zeroth-order estimates per cut and P;
- ``python -m hosfl_dist.experiments.zo_precision``: the scalars' error against float64 for half-precision weights;
- ``python -m hosfl_dist.experiments.centralized_lora``: the first-order, unsplit LoRA reference of a language config.
"""
