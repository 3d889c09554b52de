"""Shared fixtures: tiny configs that run the whole pipeline in seconds."""

from __future__ import annotations

import os

import pytest
import torch
from tiny import TINY_OVERRIDES

# Two cores are shared by everything on a test machine: keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides for a synthetic-data HO-SFL run of a few rounds."""
    return [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'run'}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The gpu tier runs wherever CUDA is; elsewhere each of its tests is skipped and says why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device on this machine (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
