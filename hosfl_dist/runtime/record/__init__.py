"""The run's record, written by one process (the in-process runtime, or rank 0 under torchrun).

- :mod:`.folder`: which folder a run writes into, and whether it may (torch-free);
- :mod:`.writer`: config.yaml, metrics.jsonl and summary.json (:class:`~.writer.RunRecord`);
- :mod:`.tracking`: TensorBoard and Weights & Biases beside metrics.jsonl (``job.loggers``);
- :mod:`.progress`: the samples bar on the console.
"""
