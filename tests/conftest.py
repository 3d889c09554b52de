"""Shared fixtures: tiny configs that run the whole pipeline in seconds."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores are shared by everything on a test machine: keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides for a synthetic-data HO-SFL run of a few rounds."""
    return [
        "data.name=synthetic",
        "model.name=small_cnn",
        "model.width=4",
        "split.cut=1",
        "clients.total=6",
        "clients.per_round=3",
        "clients.batch_size=8",
        "zo.num_perturbations=3",
        "clients.optim.lr=1e-2",
        "server.optim.lr=1e-2",
        "train.budget_samples=240",
        "train.eval_every_samples=120",
        "train.eval_batch_size=250",
        "job.progress=false",
        f"job.out_dir={tmp_path / 'run'}",
    ]
