"""retool.train: the ReTool RL loop (docs/spec.md §5-§6, chapter 8.4.7).

- ``step``: datums with the interpreter feedback mask, group advantages, the one test of a group
  (``is_informative``: rewards differ), mean-reduction weights, micro-batches, one optimizer step.
- ``loop``: ``Trainer`` / ``run_training``: one RL step in ``Trainer._one_step`` (sample, build datums,
  train, log), checkpoints, resume. The synchronous step reads in ``loop``, ``sampling`` and ``step``.
- ``sampling``: groups and steps: ``GroupRollouts`` (a problem source's groups in one mode, also the
  evaluator's), ``StepBatchBuilder`` (one step's batch: rounds, dynamic sampling, the text-only share, RoC,
  each trained group's informative verdict and where each trained trajectory was sampled); ``roc``:
  Resample-on-Correct.
- ``ahead``: ``AheadBatches``, sampling the batches of later steps while one trains (only with
  ``train.max_steps_off_policy`` >= 1).
- ``datasource``: the problem stream over a problem source's epochs, with a resumable position;
  ``ProblemFeed``.
- ``checkpoint``: atomic checkpoints, keep-last-K, metrics repair on resume.
- ``metrics``: per-step metrics and ``metrics.jsonl``; ``trackers``: TensorBoard / SwanLab / W&B;
  ``progress``: the live display.
- ``sft``: the first stage's peer of the RL loop: ``SFTExample`` traces, their file, ``train_sft``;
  ``expert_iteration``: rounds of sampling, keeping verified tool-using attempts and SFT on the pool.
- ``cli``: ``retool train``.
"""

from retool.train.checkpoint import CheckpointManager, TrainerState
from retool.train.datasource import DataPosition, ProblemStream
from retool.train.loop import Trainer, TrainSummary, run_training
from retool.train.metrics import rollout_metrics
from retool.train.step import (
    build_datum,
    build_step_data,
    group_advantages,
    is_degenerate,
    is_informative,
    mean_reduction_weights,
    pack_micro_batches,
    train_step,
    trajectory_tokens,
)

__all__ = [
    "CheckpointManager",
    "DataPosition",
    "ProblemStream",
    "TrainSummary",
    "Trainer",
    "TrainerState",
    "build_datum",
    "build_step_data",
    "group_advantages",
    "is_degenerate",
    "is_informative",
    "mean_reduction_weights",
    "pack_micro_batches",
    "rollout_metrics",
    "run_training",
    "train_step",
    "trajectory_tokens",
]
