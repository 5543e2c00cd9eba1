"""Adapters to managed training services, and the guard every remote call goes through.

- ``common``: the remote training and sampling clients both SDK adapters are built on, made of:
  - ``sdk``: importing an SDK, resolving its futures, refusing what its version cannot take;
  - ``calls``: how an SDK call runs and how its failures are reported to the guard;
  - ``wire``: our datums as the services' loss inputs;
  - ``metrics``: loss and metrics computed here from the service's answers;
  - ``service_reduction``: the service's loss normalisation as the adapter assumes and checks it.
- ``pytrio`` / ``tinker``: the two adapters (``backend.kind = "pytrio"`` / ``"tinker"``).
- ``guarded``: timeouts, retries and the gradient-accumulation guard around any client (``[retry]``).

Imports the interface and the training math only: never the local backend, its engine or its samplers.
"""
