"""Measurement: client memory of each method's own step, the App. C.1 latency model."""
