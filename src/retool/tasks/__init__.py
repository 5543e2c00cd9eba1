"""retool.tasks: the embedded default — synthetic tasks, a tiny local model, cold-start SFT, `retool demo`.

- ``retool.tasks.family``: seeded integer-answer problems, easy and hard, with canonical solution code.
- ``retool.tasks.tinymodel`` / ``retool.tasks.model``: the tiny Qwen2 model and its task-trained tokenizer.
- ``retool.tasks.sft``: code-interleaved SFT trajectories built with ``retool.protocol`` and trained with
  ``cross_entropy`` through a ``TrainingClient``.
- ``retool.tasks.demo``: the whole pipeline (``run_demo``) and ``run_sft``; ``retool.tasks.cli``: the commands.
"""
