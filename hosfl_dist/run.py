"""Kept for the command line ``python -m hosfl_dist.run`` (and ``from hosfl_dist.run import main``); the command
is :mod:`hosfl_dist.cli.run`."""

import sys

from hosfl_dist.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
