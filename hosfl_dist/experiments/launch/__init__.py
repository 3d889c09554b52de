"""How a study's runs are started: ``--launcher inprocess|torchrun|slurm`` of compare, sweep and scaling.

- ``inprocess`` (the default): every run is ``python -m hosfl_dist.run`` in one process (:func:`..runs.launch`);
- ``torchrun``: every run is a local torchrun job, ``launch/torchrun.sh`` with the run's world
  (:mod:`.torchrun`);
- ``slurm``: every run is a task of a Slurm job array, ``slurm/study_array.sbatch`` running ``slurm/hosfl.sbatch``;
  runs of one world share an array (:mod:`.slurm`).

Which world (processes, nodes, GPUs, extra overrides such as ``server.ranks``) each run gets is :mod:`.worlds`'s; what
the study checks before anything starts (roles, memory) is :mod:`.worlds` and :mod:`.memory`'s; the study's record
(``OUT/study.json``: its command, its runs and its Slurm submissions), which ``python -m
hosfl_dist.experiments.collect`` reads, is :mod:`.study`'s. Importing this package imports no torch.
"""

LAUNCHERS = ("inprocess", "torchrun", "slurm")
