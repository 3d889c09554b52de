"""The command lines of one run, each a module whose ``main`` parses, dispatches and reports errors in one line:

- :mod:`.run`: ``python -m hosfl_dist.run`` (and under torchrun), one function per mode: ``--help-config``,
  ``--status``, ``--record-death``, ``--check``, ``--dry-run``, a run completed already, torchrun, in-process;
- :mod:`.precheck`: what ``--check`` (and a study, before it launches) refuses beyond the config tree;
- :mod:`.config_help`: every config key with its type, default and meaning (``--help-config``,
  ``python -m hosfl_dist.config_help``, docs/configuration.md);
- :mod:`.predict`: ``python -m hosfl_dist.predict``, an exported LM on a JSONL file;
- :mod:`.guard`: what every command that writes refuses or says in one line (a device it cannot run, an output in a
  run's folder, a full disk, Ctrl-C), used by the other commands too.

The modules ``hosfl_dist.run``, ``hosfl_dist.predict`` and ``hosfl_dist.config_help`` keep those command lines.
Nothing below the commands imports this package.
"""
