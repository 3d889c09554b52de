"""Kept for the command line ``python -m hosfl_dist.experiments.pretrain``; the command is
:mod:`hosfl_dist.centralized.pretrain`."""

import sys

from hosfl_dist.centralized.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
