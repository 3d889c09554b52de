"""``python -m hosfl_dist.export``: see :mod:`hosfl_dist.export.cli`."""

from hosfl_dist.export.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
