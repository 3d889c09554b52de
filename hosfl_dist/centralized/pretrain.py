"""Centralised first-order pretraining of a whole vision model, saved in the layout ``model.pretrained`` loads.

    python -m hosfl_dist.experiments.pretrain --config X.yaml [key=value ...] --out weights.pt
        [--epochs N] [--lr LR] [--batch-size B] [--weight-decay WD] [--threads T]

The model of the config (``model.name``: resnet18, small_cnn or conv_mlp, ``model.width``) is trained uncut with
ordinary backprop on the config's training split (``data.name``, ``data.classes``, ``data.train_max_samples``,
``data.augment``; ``job.seed``, ``job.device``): SGD with Nesterov momentum 0.9 and a cosine decay of the learning
rate to 0 over the epochs. BatchNorm is trainable and in train mode, so the saved running statistics are those of the
data (a federated run with ``model.freeze_bn=all`` then normalises with them). Every epoch prints its mean training
loss and the accuracy on the held-out split (``data.eval_max_samples``), in eval mode.

``--out`` gets the whole model's state dict (ResNet-18 in torchvision's layout, fc included; small_cnn as
``blocks.i.*`` / ``head.*``); beside it, the same name with ``.json``: the command, the config, the epochs and their
metrics, the final held-out accuracy, the wall time and the saved file's SHA-256 (the same command on a machine with
another CPU can give other weights: kernels differ by instruction set, so the digest says which weights a result
used). A federated run on other classes loads it with a new head
(``model.pretrained`` drops a head of another size).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from hosfl_dist.config import config_to_dict
from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.logs import init_logging

logger = logging.getLogger(__name__)

SMALLEST_BATCH = 2
"""A last batch smaller than this is skipped: train-mode BatchNorm needs two values per channel."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hosfl_dist.experiments.pretrain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML config (its model, data and job sections are used)")
    p.add_argument("--out", required=True, help="where the state dict goes (a .json with the run's record beside it)")
    p.add_argument("--epochs", type=int, default=30, help="passes over the training split (default 30)")
    p.add_argument("--lr", type=float, default=0.05, help="peak SGD learning rate, decayed by a cosine (default 0.05)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step (default 128)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 weight decay (default 5e-4)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default 0: torch's choice)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, as for hosfl_dist.run")
    args = p.parse_intermixed_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: {getattr(args, name)} (must be >= 1)")
    if not (math.isfinite(args.lr) and args.lr > 0) or args.weight_decay < 0 or args.threads < 0:
        raise ConfigError(f"--lr {args.lr} must be > 0, --weight-decay {args.weight_decay} and --threads "
                          f"{args.threads} >= 0")  # fmt: skip
    return args


def pretrain(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Train, print one line per epoch, save the weights and the record; returns the record."""
    import torch

    from hosfl_dist.core.digest import file_sha256
    from hosfl_dist.core.seeding import Stream, generator
    from hosfl_dist.data import get_task, load_vision_data
    from hosfl_dist.models import build_whole_vision_model, pretrainable_models
    from hosfl_dist.runtime.checks import load_run_config
    from hosfl_dist.tasks.classification import ClassificationTask

    cfg = load_run_config(args.config, args.overrides)
    if cfg.model.name not in pretrainable_models():
        raise ConfigError(f"invalid value for model.name: {cfg.model.name!r} (pretraining is implemented for the "
                          f"vision models {pretrainable_models()})")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    record_path = out.with_suffix(".json")
    from hosfl_dist.cli.guard import check_destination
    from hosfl_dist.runtime.process.host import check_devices

    for written in (out, record_path):
        check_destination(written)  # a run's checkpoint or record is never replaced by the weights
    check_devices(cfg)
    start = time.perf_counter()
    data = load_vision_data(cfg.data, cfg.job.seed)
    device = torch.device(cfg.job.device)
    net = build_whole_vision_model(cfg.model, data.info, cfg.job.seed, cfg.job.device).train()
    task = get_task(cfg.data.name).scoring().get("scorer") or ClassificationTask()  # a plug-in task's loss, if any
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=args.weight_decay)
    n = len(data.train_y)
    steps_per_epoch = max(1, -(-n // args.batch_size))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)
    # the centralised reference's own streams: sample order (0) and augmentation (1), from job.seed
    order_gen = generator(cfg.job.seed, Stream.CENTRALIZED_ORDER, 0)
    aug_gen = generator(cfg.job.seed, Stream.CENTRALIZED_ORDER, 1)
    params = sum(p.numel() for p in net.parameters())
    logger.info(f"pretrain {cfg.model.name} ({params / 1e6:.2f}M parameters) on {cfg.data.name}"
                f"{f' classes {cfg.data.classes}' if cfg.data.classes else ''}: {n} training / {len(data.eval_y)} "
                f"held-out samples, {args.epochs} epochs of {steps_per_epoch} steps (batch {args.batch_size}), SGD lr "
                f"{args.lr:g}, {torch.get_num_threads()} threads, device {device}")  # fmt: skip
    history = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        net.train()
        loss_sum, seen = 0.0, 0
        for idx in torch.randperm(n, generator=order_gen).split(args.batch_size):
            if len(idx) < SMALLEST_BATCH:
                continue
            x = data.train_transform(data.train_x[idx], aug_gen).to(device)
            y = data.train_y[idx].to(device)
            loss = task.loss(net(x), y)
            if not math.isfinite(loss.item()):
                raise HosflError(f"epoch {epoch}: non-finite training loss (lower --lr)")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(idx)
            seen += len(idx)
        acc = evaluate(net, data, device, cfg.train.eval_batch_size)
        row = {"epoch": epoch, "train_loss": loss_sum / max(seen, 1), "eval_accuracy": acc,
               "epoch_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
        history.append(row)
        logger.info(f"epoch {epoch}/{args.epochs}  train_loss {row['train_loss']:.4f}  eval_accuracy {acc:.4f}  "
                    f"({row['epoch_s']:.1f} s)")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in net.state_dict().items()}, out)
    record = {
        "command": command,
        "weights": str(out),
        "config": config_to_dict(cfg),
        "epochs": args.epochs,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "weight_decay": args.weight_decay,
        "optimizer": "sgd nesterov momentum 0.9, cosine decay to 0",
        "num_classes": data.info["num_classes"],
        "train_size": n,
        "eval_size": len(data.eval_y),
        "final_eval_accuracy": history[-1]["eval_accuracy"],
        "history": history,
        "threads": torch.get_num_threads(),
        "wall_time_s": round(time.perf_counter() - start, 2),
        "sha256": file_sha256(out),
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out} and {record_path} (held-out accuracy {record['final_eval_accuracy']:.4f}, "
          f"{record['wall_time_s']:.1f} s)", flush=True)  # fmt: skip
    return record


def evaluate(net: Any, data: Any, device: Any, batch_size: int) -> float:
    """Accuracy on the held-out split, in eval mode (BatchNorm on its running statistics)."""
    import torch

    net.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(data.eval_y), batch_size):
            x = data.eval_transform(data.eval_x[start : start + batch_size], None).to(device)
            pred = net(x).argmax(1).cpu()
            correct += int((pred == data.eval_y[start : start + batch_size]).sum())
    net.train()
    return correct / max(len(data.eval_y), 1)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    init_logging()
    from hosfl_dist.cli.guard import guarded

    def body() -> int:
        pretrain(parse_args(words), "python -m hosfl_dist.experiments.pretrain " + " ".join(words))
        return 0

    return guarded("the pretraining", body)


if __name__ == "__main__":
    sys.exit(main())
