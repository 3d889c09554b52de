"""Kept for the command line ``python -m hosfl_dist.config_help``; the command is :mod:`hosfl_dist.cli.config_help`."""

import sys

from hosfl_dist.cli.config_help import main

if __name__ == "__main__":
    sys.exit(main())
