"""retool.tasks: the embedded default on top of the core -- a tiny local model, cold-start SFT, `retool demo`.

- ``retool.tasks.model``: the demo's tiny Qwen2 model, its tokenizer trained on the task text.
- ``retool.tasks.sft``: code-interleaved SFT trajectories built with ``retool.protocol`` and trained with
  ``cross_entropy`` through a ``TrainingClient``.
- ``retool.tasks.demo``: the whole pipeline (``run_demo``) and ``run_sft``, with ``DemoSettings`` (the
  ``demo`` preset plus demo-only fields); ``retool.tasks.report``: its table, gain and report files;
  ``retool.tasks.cli``: the commands.

The synthetic task family itself is data (``retool.data.synthetic``, the environment ``tasks``) and the
generic tiny model builder a backend concern (``retool.backends.local.tinymodel``); nothing below this package
imports it.
"""
