"""Golden-loss regressions, one per registered algorithm: a few rounds of a tiny model with a fixed seed against
stored values (torchtune's recipe tests). Vision methods run the shared tiny synthetic run; the LoRA-only method
(SplitLoRA) and HO-SFL on a language model run a tiny random Llama on six hand-written reviews."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hosfl_dist.algorithms import algorithm_names
from tiny import TINY_OVERRIDES, run_in_process

GOLDEN = Path(__file__).parent / "golden"
REVIEWS = [
    ("a gorgeous, witty, seductive movie.", 1),
    ("the plot is a mess and the acting is worse.", 0),
    ("one of the best films of the year.", 1),
    ("dull, lifeless and far too long.", 0),
    ("a warm and funny delight.", 1),
    ("i wanted my money back.", 0),
]


def vision(name: str, tmp_path: Path) -> list[str]:
    return [*TINY_OVERRIDES, f"algorithm.name={name}", f"job.out_dir={tmp_path / 'run'}"]


def tiny_llama(name: str, tmp_path: Path) -> list[str]:
    data = tmp_path / "sst2.jsonl"
    data.write_text("".join(json.dumps({"review": s, "y": y}) + "\n" for _ in range(4) for s, y in REVIEWS))
    return [
        "model.name=hf",
        "model.source=tiny:llama",
        "split.cut=2",
        "data.name=sst2",
        f"data.train_path={data}",
        f"data.eval_path={data}",
        "data.columns={sentence: review, label: y}",
        "data.max_length=40",
        "data.eval_max_samples=6",
        "lora.r=2",
        "clients.total=4",
        "clients.per_round=2",
        "clients.batch_size=4",
        "zo.num_perturbations=2",
        "clients.optim.lr=1e-2",
        "server.optim.lr=1e-2",
        "train.budget_samples=16",
        "train.eval_every_samples=8",
        "train.eval_batch_size=4",
        "job.progress=false",
        f"algorithm.name={name}",
        f"job.out_dir={tmp_path / 'run'}",
    ]


CASES = {  # golden file -> (algorithm, overrides)
    "hosfl_tiny": ("hosfl", vision),
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
