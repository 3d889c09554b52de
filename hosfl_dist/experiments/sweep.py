"""Sweep a grid of overrides over seeds (ablations: P, μ, cut layer, ...) and report it like a comparison.

    python -m hosfl_dist.experiments.sweep --config configs/paper/table3/cifar10_iid.yaml \\
        --grid zo.num_perturbations=1,5,10 --seeds 0,1,2 --out runs/ablation_P

Several --grid options make their cartesian product (e.g. --grid zo.mu=1e-4,1e-3 --grid split.cut=1,2). Each grid
point is one row of table.md / table.json (the first column is headed by the swept keys) and one curve of the plot,
labelled by its overrides; runs go to --out/runs/<label>/seed<k>/ and finished ones are reused.

Overrides common to every point: ``--set KEY=VALUE`` or positional ``KEY=VALUE`` (as for ``python -m
hosfl_dist.run``; positional ones after --set, the grid's last). Every point's config is checked before anything
starts, and built as its run would build it (an LM's split on the meta device, a text task's files): a mistyped key
is one line ``error: ...``, a point that cannot be built (a cut the model does not have) one line each, naming the
point by its overrides (exit code 2, nothing run, no run folder made).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.errors import ConfigError
from hosfl_dist.experiments.cli import parse, parse_list, parser, run_experiment, user_overrides

if TYPE_CHECKING:
    from hosfl_dist.experiments.runs import RunSpec

PROG = "hosfl_dist.experiments.sweep"
EXAMPLES = """\
examples:
  python -m hosfl_dist.experiments.sweep --config configs/quickstart.yaml --grid zo.num_perturbations=1,4,16 \\
      --seeds 0,1 --out runs/sweep_P             # a row per value of P: runs/sweep_P/table.md, accuracy.png
  python -m hosfl_dist.experiments.sweep --config configs/quickstart.yaml --grid zo.mu=1e-4,1e-3 \\
      --grid split.cut=1,2 --out runs/mu_cut     # the product of two grids: four rows
  python -m hosfl_dist.experiments.sweep --config configs/quickstart.yaml --grid zo.num_perturbations=1,4 \\
      --out runs/sweep_P2 --jobs 2 --threads 1 train.budget_samples=20000   # two runs at a time, one override for all
  python -m hosfl_dist.experiments.sweep --config configs/quickstart.yaml --grid zo.num_perturbations=1,4,16 \\
      --out runs/sweep_P --dry-run               # the commands of the runs still to do; nothing runs
"""
"""What ``--help`` ends with (tests/test_cli.py parses each command)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, __doc__, EXAMPLES)
    p.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2,...",
        help="a swept key and its values (repeatable: the product of all grids is run)",
    )
    return parse(p, argv)


def grid_points(grids: list[str]) -> list[list[str]]:
    """["a=1,2", "b=x"] -> [["a=1", "b=x"], ["a=2", "b=x"]]."""
    axes = []
    for g in grids:
        key, sep, values = g.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--grid {g!r} is not of the form section.key=v1,v2,...")
        axes.append([f"{key.strip()}={v}" for v in parse_list(values, f"--grid {key}")])
    keys = [a[0].split("=")[0] for a in axes]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--grid names a key twice: {keys}")
    return [list(p) for p in itertools.product(*axes)]


def plan(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each grid point's overrides, labelled ``key=value,key=value`` (the report's rows)."""
    return {",".join(point): [*user_overrides(args), *point] for point in grid_points(args.grid)}


def build(args: argparse.Namespace) -> tuple[dict[str, list[RunSpec]], str, dict[str, Any]]:
    from hosfl_dist.experiments.runs import RunSpec, safe_name  # imports torch: after the overrides are checked

    seeds = parse_list(args.seeds, "--seeds", int)
    out = Path(args.out)
    specs = {
        name: [RunSpec(name, s, overrides, out / "runs" / safe_name(name) / f"seed{s}") for s in seeds]
        for name, overrides in plan(args).items()
    }
    title = args.title or f"{Path(args.config).stem}: sweep of {', '.join(args.grid)}"
    return specs, title, {"grid": args.grid}


def row_overrides(args: argparse.Namespace, label: str) -> list[str]:
    """The overrides this invocation would give the grid point ``label`` (``key=value,key=value``: a row of an earlier
    invocation into --out): the common ones, then the point's."""
    return [*user_overrides(args), *label.split(",")]


def main(argv: list[str] | None = None) -> int:
    return run_experiment(PROG, parse_args(argv), argv, build, plan, row_overrides=row_overrides)


if __name__ == "__main__":
    sys.exit(main())
