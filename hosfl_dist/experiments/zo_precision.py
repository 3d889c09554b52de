"""Kept for the command line ``python -m hosfl_dist.experiments.zo_precision``; the command is
:mod:`hosfl_dist.measure.zo_precision`."""

import sys

from hosfl_dist.measure.zo_precision import main

if __name__ == "__main__":
    sys.exit(main())
