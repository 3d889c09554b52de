"""Shared fixtures: tiny configs that run the whole pipeline in seconds."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Checkpoints and exports are signed with the user's key (hosfl_dist/runfolder/signing.py): the tests, and every
# process they start, use a key of their own, made on first use in a folder of this session, never the user's.
os.environ["HOSFL_KEY_FILE"] = os.path.join(tempfile.mkdtemp(prefix="hosfl-test-key-"), "key")

# A user's own files in the checkout (docs/python-api.md's watch.py, architecture.md's mymethod.py) must not change
# what the tests' processes import: no process they start puts its working folder (the checkout, for most) or its
# script's folder first on its import path (PYTHONSAFEPATH, python -P), and the checkout is reached through
# PYTHONPATH, after the folders a test puts there (its own plug-ins, tiny.user_folder), for the packages it holds
# beside hosfl_dist (bench). The modules the tests write have names no user would choose (tiny.user_module).
os.environ["PYTHONSAFEPATH"] = "1"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), _CHECKOUT]))

from tiny import TINY_OVERRIDES  # noqa: E402

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
