"""Studies: run several methods or a grid of settings over seeds, and report them as the paper does.

- ``python -m hosfl_dist.experiments.compare``: a set of methods on one setting -> table + plots;
- ``python -m hosfl_dist.experiments.sweep``: a grid of overrides (ablations: P, μ, cut layer) -> table + plots;
- ``python -m hosfl_dist.experiments.scaling``: a grid over model size, client depth and P, and how the costs scale;
- ``python -m hosfl_dist.experiments.collect``: a study's report again from its runs as they stand;
- ``python -m hosfl_dist.experiments.report``: tables and plots of runs.

:mod:`.cli` is what the commands share, :mod:`.runs` the runs on this machine, :mod:`.launch` the other launchers.
``zo_dimension``, ``zo_precision`` (:mod:`hosfl_dist.measure`), ``pretrain`` and ``centralized_lora``
(:mod:`hosfl_dist.centralized`) keep their command lines here.
"""
