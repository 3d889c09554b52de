"""hosfl_dist: Hybrid-Order Split Federated Learning (HO-SFL) and its baselines, in one process or under torchrun."""

__version__ = "0.1.0"
