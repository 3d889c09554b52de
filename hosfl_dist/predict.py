"""Kept for the command line ``python -m hosfl_dist.predict``; the command is :mod:`hosfl_dist.cli.predict`."""

import sys

from hosfl_dist.cli.predict import main

if __name__ == "__main__":
    sys.exit(main())
