"""retool.pipeline: the generic demo pipeline on top of the core -- a tiny local model, cold-start SFT, the
phases of ``retool demo`` -- and the interface a recipe implements.

- ``retool.pipeline.recipe``: ``Recipe``, what the pipeline asks of a task (source, held-out set, cold start,
  evaluation checker); the recipes themselves are ``retool.recipes`` (one layer up).
- ``retool.pipeline.run``: ``run_pipeline`` (cold start -> evaluate -> RL -> evaluate -> report,
  resumable by phase) and ``run_recipe_sft``; it names no task. ``retool.pipeline.settings``: ``DemoSettings``
  (a preset plus demo-only fields); ``retool.pipeline.phases``: the phase bookkeeping (``phases.json``);
  ``retool.pipeline.report``: the table, gain and report files.
- ``retool.pipeline.model``: the demo's tiny Qwen2 model, its tokenizer trained on the task text;
  ``retool.pipeline.real_model``: where a named pretrained model's file is.
- ``retool.pipeline.traces``: ``retool sft --data``, SFT of any model on a trace file (the traces are built
  below: ``retool.train.trace``, ``retool.train.annotated`` for ``retool data coldstart``; the synthetic
  styles are the tiny recipe's, ``retool.recipes.tiny.styles``).
- ``retool.pipeline.cli``: the progress printer the demo's commands share, and ``retool data coldstart``.

The synthetic task family itself is data (``retool.data.synthetic``, the environment ``tasks``) and the
generic tiny model builder a backend concern (``retool.backends.local.tinymodel``); nothing below this package
imports it.
"""
