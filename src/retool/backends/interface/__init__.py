"""The backend interface: what every other stage programs against, and nothing else.

- ``clients``: ``SamplingClient`` and ``TrainingClient`` (async-first, shaped like the Tinker / PyTRIO
  clients), ``run_sync``.
- ``types``: the plain data they exchange (``SamplingParams``, ``Sample``, ``Datum``, ``AdamParams``,
  ``ForwardBackwardResult``, ``OptimStepResult``, ``ReductionReport``, ``Tokenizer``).
- ``errors``: ``BackendUnavailableError``, ``SdkOptionError`` (user errors of an SDK or engine), ``sdk_label``.

Imports no other package of ``retool.backends`` and no torch: a stage that only names the interface loads
none of the implementations.
"""
