"""Experiment suite: run several methods or a grid of settings over seeds, and report them as the paper does.

- ``python -m hosfl_dist.experiments.compare``: a set of methods on one setting -> table + plots;
- ``python -m hosfl_dist.experiments.sweep``: a grid of overrides (ablations: P, μ, cut layer) -> table + plots.
"""
