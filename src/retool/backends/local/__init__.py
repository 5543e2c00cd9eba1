"""The local backend: a transformers model trained in this process, and the models it loads.

- ``client``: ``LocalTrainingClient`` (model, optional PEFT LoRA, AdamW, one worker thread) and its samplers
  (``LocalSamplingClient``: a live view of the weights; ``FrozenSamplingClient``: a frozen copy for
  off-policy pipelining), which hand their requests to the engine (``retool.backends.engine``).
- ``tinymodel``: the tiny chat model built here (tokenizer, chat template, random Qwen2).
- ``heap``: how this process hands freed memory back to the OS (glibc's mmap threshold, ``malloc_trim``).
- ``data_parallel``: ``DataParallelTrainingClient``, a ``LocalTrainingClient`` whose training calls run on
  several processes of one CPU machine (``backend.processes``; shared-memory weights).

Imports the interface, the training math and the engine; never a sampler or a remote adapter.
"""
