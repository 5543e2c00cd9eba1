"""What a training step computes, the same way for every backend (local and remote).

- ``losses``: the per-token loss math of every ``loss_fn`` (Tinker semantics), computed by the local
  trainer and, for their metrics, by the remote adapters.
- ``packing``: micro-batches packed by padded area (the local trainer; ``retool.train.step``).
- ``reduction``: how a managed service normalises a summed loss, and the start-up probe that finds out
  (the remote adapters).

Imports the interface only.
"""
