"""Elastic runs: a server that client workers join and leave while it runs, and rounds that go on without the
clients that do not answer in time.

    python -m hosfl_dist.run --config X --serve [--address H:P]  the server (:mod:`.serve`, :mod:`.coordinator`)
    python -m hosfl_dist.run --join RUN_DIR                     a client worker, as many as wanted (:mod:`.worker`)

Membership is torch's dynamic RPC group (:mod:`.membership`); the P scalars of a round are reduced through the
server (each worker sends its clients' rows, the history row it appends is what every replica replays), so no
collective among workers has to be re-formed when one is lost. docs/participation.md#elastic-runs.
"""
