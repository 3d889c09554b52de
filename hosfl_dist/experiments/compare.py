"""Compare methods on one setting over seeds: runs (or reuses) every (method, seed) and writes the report.

    python -m hosfl_dist.experiments.compare --config configs/paper/table3/cifar10_iid.yaml \\
        --methods hosfl,sfl,fsl_sage,zo_sfl,mu_splitfed --seeds 0,1,2 --out runs/table3_cifar10_iid

Outputs in --out: runs/<method>/seed<k>/ (each run's files), table.md, table.json, accuracy.png (metric vs processed
samples, mean ± std band over seeds), traffic.png (training traffic by category, paper Table 5). Under results/ git
tracks the report and ignores runs/ (results/README.md: an experiment's runs are packed into its runs.tar.xz).

Every method runs with the config plus ``algorithm.name=<method>``, then the paper's per-method optimizer where it
differs (App. B.4: MU-SplitFed uses plain SGD with client lr 0.005, server lr 0.01, global lr 0.3; unless
--no-paper-defaults), then the overrides for all methods (``--set KEY=VALUE``, or positional ``KEY=VALUE`` as for
``python -m hosfl_dist.run``; positional ones after --set), then --method-set overrides (one method). Every method's
config is checked before anything starts, and built as its run would build it (an LM's split on the meta device, a
text task's files): a mistyped key is one line ``error: ...``, a method that cannot be built one line each, naming
the method (exit code 2, nothing run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.errors import ConfigError
from hosfl_dist.experiments.cli import parse, parse_list, parser, run_experiment, user_overrides

if TYPE_CHECKING:
    from hosfl_dist.experiments.runs import RunSpec

PROG = "hosfl_dist.experiments.compare"
EXAMPLES = """\
examples:
  python -m hosfl_dist.experiments.compare --config configs/quickstart.yaml --methods hosfl,frozen_client \\
      --seeds 0,1 --out runs/cmp                 # two methods over two seeds: runs/cmp/table.md, accuracy.png
  python -m hosfl_dist.experiments.compare --config configs/quickstart.yaml --methods sfl --seeds 0,1 \\
      --out runs/cmp                             # one more row: the earlier rows stay, their runs reused
  python -m hosfl_dist.experiments.compare --config configs/quickstart.yaml --methods hosfl,sfl --out runs/cmp_lr \\
      --method-set sfl:clients.optim.lr=0.01 train.budget_samples=20000   # one method's override, one for all
  python -m hosfl_dist.experiments.compare --config configs/quickstart.yaml --methods hosfl,sfl --out runs/cmp \\
      --dry-run                                  # the commands of the runs still to do; nothing runs
  python -m hosfl_dist.experiments.compare --config configs/quickstart.yaml --methods hosfl,sfl --out runs/cmp_tr \\
      --launcher torchrun --nproc 3 --jobs 2     # each run a torchrun job of 3 processes, two at a time
  python -m hosfl_dist.experiments.collect runs/cmp   # the report again from the runs as they stand
"""
"""What ``--help`` ends with (tests/test_cli.py parses each command)."""

# App. B.4: "For MU-SplitFed, we follow the original paper and use standard SGD without momentum, with client
# learning rate 0.005, server learning rate 0.01, and global learning rate 0.3." (τ = 2 per App. B.3.)
PAPER_METHOD_DEFAULTS: dict[str, list[str]] = {
    "mu_splitfed": [
        "clients.optim.name=sgd",
        "clients.optim.lr=0.005",
        "clients.optim.momentum=0",
        "clients.optim.weight_decay=0",
        "server.optim.name=sgd",
        "server.optim.lr=0.01",
        "server.optim.momentum=0",
        "server.optim.weight_decay=0",
        "algorithm.global_lr=0.3",
        "algorithm.server_steps=2",
    ],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, __doc__, EXAMPLES)
    p.add_argument("--methods", required=True, help="comma-separated algorithm names (hosfl, sfl, fsl_sage, ...)")
    p.add_argument(
        "--method-set",
        action="append",
        default=[],
        metavar="METHOD:KEY=VALUE",
        help="override for one method, applied last (repeatable)",
    )
    p.add_argument("--no-paper-defaults", action="store_true", help="do not apply the paper's per-method optimizers")
    return parse(p, argv)


def method_overrides(args: argparse.Namespace, methods: list[str]) -> dict[str, list[str]]:
    per: dict[str, list[str]] = {m: [] for m in methods}
    for item in args.method_set:
        method, sep, override = item.partition(":")
        if not sep or "=" not in override:
            raise ConfigError(f"--method-set {item!r} is not of the form METHOD:section.key=value")
        if method not in per:
            raise ConfigError(f"--method-set {item!r}: {method!r} is not one of --methods {methods}")
        per[method].append(override)
    out = {}
    for m in methods:
        defaults = [] if args.no_paper_defaults else PAPER_METHOD_DEFAULTS.get(m, [])
        out[m] = [f"algorithm.name={m}", *defaults, *user_overrides(args), *per[m]]
    return out


def plan(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each method's overrides (an unknown method fails the check of its algorithm.name, with the known names)."""
    return method_overrides(args, parse_list(args.methods, "--methods"))


def build(args: argparse.Namespace) -> tuple[dict[str, list[RunSpec]], str, dict[str, Any]]:
    from hosfl_dist.experiments.runs import RunSpec  # imports torch: after the overrides are checked

    overrides = plan(args)
    methods = list(overrides)
    seeds = parse_list(args.seeds, "--seeds", int)
    out = Path(args.out)
    specs = {m: [RunSpec(m, s, overrides[m], out / "runs" / m / f"seed{s}") for s in seeds] for m in methods}
    title = args.title or f"{Path(args.config).stem}: {', '.join(methods)} over seeds {seeds}"
    return specs, title, {"overrides": overrides}


def row_overrides(args: argparse.Namespace, method: str) -> list[str]:
    """The overrides this invocation would give ``method`` (a row of an earlier invocation into --out)."""
    methods = parse_list(args.methods, "--methods")
    return method_overrides(args, [*methods, *([method] if method not in methods else [])])[method]


def main(argv: list[str] | None = None) -> int:
    return run_experiment(PROG, parse_args(argv), argv, build, plan, row="method", row_overrides=row_overrides)


if __name__ == "__main__":
    sys.exit(main())
