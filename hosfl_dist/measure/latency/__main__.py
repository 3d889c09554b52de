"""``python -m hosfl_dist.measure.latency``: see :mod:`hosfl_dist.measure.latency.cli`."""

import sys

from hosfl_dist.measure.latency.cli import main

if __name__ == "__main__":
    sys.exit(main())
