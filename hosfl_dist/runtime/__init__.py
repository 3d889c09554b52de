"""The runtimes: one training loop and one record of the run, driven in one process or under torchrun."""
