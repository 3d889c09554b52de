"""The run's record, written by one process (the in-process runtime, or rank 0 under torchrun).

- :mod:`.writer`: config.yaml, metrics.jsonl and summary.json (:class:`~.writer.RunRecord`);
- :mod:`.tracking`: TensorBoard and Weights & Biases beside metrics.jsonl (``job.loggers``);
- :mod:`.progress`: the samples bar on the console;
- :mod:`.curves`: curves.png from the metrics rows.

Which folder it writes into, and whether it may, is the run folder's (:mod:`hosfl_dist.runfolder`).
"""
