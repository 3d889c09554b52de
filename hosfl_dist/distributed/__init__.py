"""The torchrun runtime: rank 0 serves θs over RPC, the other ranks are client workers (see runtime.py)."""
