"""Centralised pretraining (python -m hosfl_dist.experiments.pretrain): it trains the whole model with real BatchNorm
statistics, and what it saves loads back through ``model.pretrained``, a head of other classes replaced."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hosfl_dist.config import load_config
from hosfl_dist.data import data_info
from hosfl_dist.errors import ConfigError
from hosfl_dist.centralized.pretrain import main
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime.build import data_sections

TINY = ["data.name=synthetic", "data.train_max_samples=64", "data.eval_max_samples=32", "clients.total=4",
        "clients.per_round=2", "clients.batch_size=8", "train.eval_batch_size=32"]  # fmt: skip


def pretrain(tmp_path: Path, model: list[str], *extra: str) -> tuple[Path, dict]:
    out = tmp_path / "weights.pt"
    config = tmp_path / "c.yaml"
    config.write_text("job: {seed: 3}\n")
    args = ["--config", str(config), "--out", str(out), "--epochs", "1", "--batch-size", "32", *TINY, *model, *extra]
    assert main(args) == 0
    return out, json.loads(out.with_suffix(".json").read_text())


def split_state(overrides: list[str]) -> dict[str, torch.Tensor]:
    """The state of f_c and f_s under the whole model's names (ResNet-18: torchvision's; small_cnn: blocks.i, head)."""
    cfg = load_config(None, [*TINY, *overrides])
    split = build_split_model(cfg, data_info(data_sections(cfg)), True)
    stage, first = ("layers.", "layer{}.") if cfg.model.name == "resnet18" else ("blocks.", "blocks.{}.")
    base = 1 if cfg.model.name == "resnet18" else 0  # torchvision counts its stages from layer1
    out = {}
    for part, offset in ((split.client, base), (split.server, base + cfg.split.cut)):
        for k, v in part.state_dict().items():
            if k.startswith(stage):  # the part's i-th stage (block) is the whole model's (offset + i)-th
                i, rest = k[len(stage) :].split(".", 1)
                k = first.format(int(i) + offset) + rest
            out[k] = v
    return out


@pytest.mark.parametrize("mode", ["all", "client"])
def test_resnet18_round_trip_with_real_statistics(tmp_path, mode):
    path, record = pretrain(tmp_path, ["model.name=resnet18"])
    saved = torch.load(path, weights_only=True)
    assert "fc.weight" in saved and saved["fc.weight"].shape == (4, 512)  # torchvision layout, head included
    assert not torch.equal(saved["layer3.0.bn1.running_var"], torch.ones(256))  # trained in train mode
    assert record["epochs"] == 1 and 0.0 <= record["final_eval_accuracy"] <= 1.0 and record["wall_time_s"] > 0
    assert record["config"]["job"]["seed"] == 3 and "--epochs 1" in record["command"]
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    got = split_state(["model.name=resnet18", f"model.pretrained={path}", f"model.freeze_bn={mode}"])
    assert set(got) == set(saved)
    for k, v in saved.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_a_head_of_other_classes_or_reset_is_replaced(tmp_path, capsys):
    path, _ = pretrain(tmp_path, ["model.name=resnet18", "data.classes=[0, 1]"])
    saved = torch.load(path, weights_only=True)
    assert saved["fc.weight"].shape == (2, 512)
    got = split_state(["model.name=resnet18", f"model.pretrained={path}", "data.classes=[2, 3, 1]"])
    assert "2-class head (fc); it is dropped" in capsys.readouterr().err
    assert got["fc.weight"].shape == (3, 512)
    for k, v in saved.items():
        if not k.startswith("fc."):
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    # as many classes, but other ones (fine-tuning on classes 5-9 after 0-4): model.reset_head
    same = split_state(["model.name=resnet18", f"model.pretrained={path}", "data.classes=[2, 3]"])
    assert torch.equal(same["fc.weight"], saved["fc.weight"])
    fresh = split_state(
        ["model.name=resnet18", f"model.pretrained={path}", "data.classes=[2, 3]", "model.reset_head=true"]
    )
    assert "dropped (model.reset_head)" in capsys.readouterr().err
    assert fresh["fc.weight"].shape == (2, 512) and not torch.equal(fresh["fc.weight"], saved["fc.weight"])
    assert torch.equal(fresh["layer4.1.conv2.weight"], saved["layer4.1.conv2.weight"])


def test_small_cnn_round_trip(tmp_path):
    path, _ = pretrain(tmp_path, ["model.name=small_cnn", "model.width=4"])
    saved = torch.load(path, weights_only=True)
    got = split_state(["model.name=small_cnn", "model.width=4", f"model.pretrained={path}"])
    assert set(got) == set(saved)
    for k, v in saved.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    with pytest.raises(ConfigError, match="does not match small_cnn of width 8"):
        split_state(["model.name=small_cnn", "model.width=8", f"model.pretrained={path}"])


def test_bad_input_is_one_line(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: {name: hf, source: 'tiny:llama'}\ndata: {name: sst2}\n")
    assert main(["--config", str(config), "--out", str(tmp_path / "w.pt")]) == 2
    assert "pretraining is implemented for the vision models" in capsys.readouterr().err
    assert main(["--config", str(config), "--out", str(tmp_path / "w.pt"), "--epochs", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --epochs: 0 (must be >= 1)"
