"""The runtimes: one trainer, given the parts that differ between one process and a torchrun job.

- :mod:`.trainer`: the run's loop from a client worker's side (resume, rounds, evaluations, the checkpoint cadence,
  the end), the same in both runtimes;
- :mod:`.front`: the server side of a run in the process that writes its record, driven by the typed messages of
  :mod:`.control`;
- :mod:`.server_group`: how the server side executes a call, on one rank or a server group (:mod:`.fsdp` shards θs);
  :mod:`.server_compute`: the server's forward/backward and step of θs over a round's rows;
- :mod:`.checkpoint`, :mod:`.peers`, :mod:`.build`: checkpoints, the client workers' coordination, what both
  runtimes build alike;
- :mod:`.inprocess`, :mod:`.torchrun`: each runtime's parts, built, then trained (workers) or served (server ranks);
- :mod:`.record`: the run's folder and files; :mod:`.process`: the launcher's environment, process groups, host
  settings and signals.
"""
