"""Process setup of the distributed runtime, by concern; the only package that reads the launcher's environment.

- :mod:`.launch`: what torchrun told this process (:class:`~.launch.LaunchEnv`) and which rank does what
  (:class:`~.launch.RoleMap`); torch-free, so a world that does not fit the roles is refused before torch loads;
- :mod:`.groups`: the process groups (default, client workers, server group), the job's store and RPC;
- :mod:`.gate`: the RPC gate: TensorPipe's listener reachable by holders of the job's token alone;
- :mod:`.host`: this host's settings for a process: intra-op threads, glibc's malloc, the network interface, devices;
- :mod:`.signals`: SIGTERM / SIGINT turned into a request to stop at the next round boundary.
"""
