"""Adapters to managed training services, and the guard every remote call goes through.

- ``common``: what both SDK adapters share (datums to loss inputs, futures, sampling, checkpoints, how SDK
  failures are reported to the guard).
- ``pytrio`` / ``tinker``: the two adapters (``backend.kind = "pytrio"`` / ``"tinker"``).
- ``guarded``: timeouts, retries and the gradient-accumulation guard around any client (``[retry]``).

Imports the interface and the training math only: never the local backend, its engine or its samplers.
"""
