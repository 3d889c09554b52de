"""Kept for the command line ``python -m hosfl_dist.experiments.centralized_lora``; the command is
:mod:`hosfl_dist.centralized.lora`."""

import sys

from hosfl_dist.centralized.lora import main

if __name__ == "__main__":
    sys.exit(main())
