"""Entry point: ``python -m hosfl_dist.run --config configs/X.yaml [section.key=value ...] [--dry-run]``.

Parses, builds, runs and cleans up; errors in the user's input are reported in one line (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from hosfl_dist.config import Config, dump_config, load_config
from hosfl_dist.errors import HosflError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hosfl_dist.run", description=__doc__)
    p.add_argument("--config", help="YAML config file (sections of hosfl_dist.config.Config)")
    p.add_argument("--dry-run", action="store_true", help="build the config (and data/model) and print it; no training")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. zo.num_perturbations=8 job.seed=3")
    return p.parse_args(argv)


def dry_run(cfg: Config) -> dict:
    """Validate what can be validated without training: config, data files, model construction and split."""
    from hosfl_dist.data import build_data
    from hosfl_dist.models import build_split_model

    data = build_data(cfg)
    split = build_split_model(cfg, data.info)

    def count(m, trainable: bool) -> int:
        return sum(p.numel() for p in m.parameters() if p.requires_grad or not trainable)

    return {
        "data": data.info,
        "client_params": count(split.client, False),
        "client_trainable_params": count(split.client, True),
        "server_params": count(split.server, False),
        "server_trainable_params": count(split.server, True),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            print(dump_config(cfg), end="")
            print("# built:", json.dumps(dry_run(cfg)))
            return 0
        from hosfl_dist.engine import InProcessEngine

        summary = InProcessEngine(cfg).run()
    except HosflError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    final = summary.get("final", {})
    print(
        f"done: {summary['rounds']} rounds, {summary['processed_samples']} samples, "
        f"eval_accuracy={final.get('eval_accuracy')}, wall {summary['wall_time_s']} s -> {cfg.job.out_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
