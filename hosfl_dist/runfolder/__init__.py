"""A run's folder, the format every reader shares: the runtime writes it, ``python -m hosfl_dist.export`` and the
studies (compare, sweep, scaling, collect) read it.

- :mod:`.folder`: which folder a run writes into (``runs/<job.name>/<time>``, ``latest``, ``slurm-<id>``, or the
  user's ``job.out_dir``), whether it may, and how the run in it stands (``--status``);
- :mod:`.lock`: the lock of the process that writes the run, and who holds it;
- :mod:`.identity`: the run's identity (config, inputs, code, environment), its fingerprint, the inputs' hashes;
- :mod:`.environment`: what of a process's environment changes a run's bits (threads, library versions, CPU kernels,
  GPU);
- :mod:`.checkpoints`: the checkpoints' layout, their manifests and how a checkpoint is verified.

What the runtime writes into the folder (config.yaml, metrics.jsonl, summary.json) is
:mod:`hosfl_dist.runtime.record`'s; how it saves and loads a checkpoint :mod:`hosfl_dist.runtime.checkpoint`'s.
Torch-free, but for :mod:`.identity` where it lists a run's inputs and :mod:`.environment`. Nothing here imports the
runtime.
"""
