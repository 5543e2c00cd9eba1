"""The local backend: a transformers model trained in this process, and the models it loads.

- ``client``: ``LocalTrainingClient`` (model, optional PEFT LoRA, AdamW, one worker thread), the training
  client's API; its parts beside it:
  - ``loading``: LoRA settings, device / dtype / model path, the models a client loads (a shared base too);
  - ``precision``: the compute dtype (``backend.dtype``) and training autocast;
  - ``sampling_client``: its samplers (``LocalSamplingClient``: a live view of the weights;
    ``FrozenSamplingClient``: a frozen copy for off-policy pipelining), which hand their requests to the
    engine (``retool.backends.engine``);
  - ``sampling_views``: the merged-LoRA, cast and frozen copies generation runs on;
  - ``packed_linear``: prepacked oneDNN linears for CPU generation;
  - ``datums_pass``: a forward(-backward) pass's micro-batch tensors and what it measured;
  - ``checkpoint_io``: the saved state's folder;
  - ``stats``: what the worker thread did (``BackendStats``);
  - ``shared_prefix``: training forwards that run a shared input prefix once.
- ``replica_sampling``: samplers whose generation runs in the data-parallel replica processes.
- ``tinymodel``: the tiny chat model built here (tokenizer, chat template, random Qwen2).
- ``heap``: how this process hands freed memory back to the OS (glibc's mmap threshold, ``malloc_trim``).
- ``data_parallel``: ``DataParallelTrainingClient``, a ``LocalTrainingClient`` whose training calls run on
  several processes of one CPU machine (``backend.processes``; shared-memory weights).

Imports the interface, the training math and the engine; never a sampler or a remote adapter.
"""
