"""Kept for the command line ``python -m hosfl_dist.experiments.zo_dimension``; the command is
:mod:`hosfl_dist.measure.zo_dimension`."""

import sys

from hosfl_dist.measure.zo_dimension import main

if __name__ == "__main__":
    sys.exit(main())
