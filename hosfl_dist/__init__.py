"""hosfl_dist: Hybrid-Order Split Federated Learning (HO-SFL) and its baselines, in one process or under torchrun.

The Python API (docs/python-api.md), imported when first used so that ``import hosfl_dist`` stays light:

    run = hosfl_dist.train("configs/quickstart.yaml", ["job.seed=1"], callbacks=[MyCallback()])
    run.summary, run.metrics, run.out_dir
    hosfl_dist.load_run("runs/quickstart/latest")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Callback", "Run", "load_run", "train"]

if TYPE_CHECKING:
    from hosfl_dist.cli.api import train
    from hosfl_dist.runfolder.run import Run, load_run
    from hosfl_dist.runtime.callbacks import Callback

_LAZY = {
    "train": "hosfl_dist.cli.api",
    "Run": "hosfl_dist.runfolder.run",
    "load_run": "hosfl_dist.runfolder.run",
    "Callback": "hosfl_dist.runtime.callbacks",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hosfl_dist' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
