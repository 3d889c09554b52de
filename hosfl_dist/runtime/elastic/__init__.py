"""Elastic runs: a server that client workers join and leave while it runs, and rounds that go on without the
clients that do not answer in time.

    python -m hosfl_dist.run --config X --serve [--address H:P]  the server, the run's trainer
                                                                (:mod:`hosfl_dist.runtime.serve`)
    python -m hosfl_dist.run --join RUN_DIR                     a client worker, as many as wanted (:mod:`.driver`)

What is elastic here is membership alone (:mod:`.membership`: who the live workers are, who serves whom, the dynamic
RPC group): the rounds are every runtime's, the method's own ``run_round`` over live rounds decided at the server's
round gate (:mod:`hosfl_dist.runtime.gate`), and the run is the one trainer's (:mod:`hosfl_dist.runtime.trainer`).
docs/participation.md#elastic-runs.
"""
