"""Golden-loss regressions, one per registered algorithm: a few rounds of a tiny model with a fixed seed against
stored values (torchtune's recipe tests). Vision methods run the shared tiny synthetic run; the LoRA-only method
(SplitLoRA) and HO-SFL on a language model run a tiny random Llama on six hand-written reviews."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hosfl_dist.algorithms import algorithm_names
from tiny import TINY_OVERRIDES, lm_overrides, run_in_process, write_text_files

GOLDEN = Path(__file__).parent / "golden"


def vision(name: str, tmp_path: Path) -> list[str]:
    return [*TINY_OVERRIDES, f"algorithm.name={name}", f"job.out_dir={tmp_path / 'run'}"]


def tiny_llama(name: str, tmp_path: Path) -> list[str]:
    return [*lm_overrides(tmp_path / "run", write_text_files(tmp_path)), f"algorithm.name={name}"]


CASES = {  # golden file -> (algorithm, overrides)
    "hosfl_tiny": ("hosfl", vision),
    "frozen_client_tiny": ("frozen_client", vision),
    "sfl_tiny": ("sfl", vision),
    "fsl_sage_tiny": ("fsl_sage", vision),
    "zo_sfl_tiny": ("zo_sfl", vision),
    "mu_splitfed_tiny": ("mu_splitfed", vision),
    "splitlora_tiny_llama": ("splitlora", tiny_llama),
    "hosfl_tiny_llama": ("hosfl", tiny_llama),
}


def test_every_registered_algorithm_has_a_golden_run():
    assert {alg for alg, _ in CASES.values()} == set(algorithm_names())


@pytest.mark.parametrize("golden", sorted(CASES))
def test_golden_losses(golden, tmp_path):
    alg, overrides = CASES[golden]
    _, _, _, rows = run_in_process(overrides(alg, tmp_path))
    got = [(r["processed_samples"], r["eval_accuracy"], r["train_loss"]) for r in rows]
    want = json.loads((GOLDEN / f"{golden}.json").read_text())
    assert [g[0] for g in got] == [g[0] for g in want]
    torch.testing.assert_close(
        torch.tensor([[g[1], g[2] or 0.0] for g in got], dtype=torch.float64),
        torch.tensor([[g[1], g[2] or 0.0] for g in want], dtype=torch.float64),
        rtol=1e-4,
        atol=1e-4,
    )
