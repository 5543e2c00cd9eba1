"""retool.data: training and evaluation problems.

Owns reading DAPO-Math-17k and evaluation sets (local JSONL/JSON/parquet or the Hugging Face Hub), stripping
DAPO's instruction wrapper, deduplication, the train/dev split (``retool prepare dapo``), and the counting
of every skipped row; and the synthetic task family (:mod:`retool.data.synthetic`). The ``Problem`` record
itself lives in :mod:`retool.data.problem` (shared).
"""

from retool.data.dapo import (
    DAPO_HUB_ID,
    load_dapo,
    normalize_dapo_row,
    prepare_dapo,
    split_dev,
    strip_dapo_template,
    write_jsonl,
)
from retool.data.evalsets import NAMED_SETS, load_problems, load_problems_with_report
from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.data.report import LoadReport, PrepareReport

__all__ = [
    "DAPO_HUB_ID",
    "NAMED_SETS",
    "DataError",
    "LoadReport",
    "PrepareReport",
    "Problem",
    "load_dapo",
    "load_problems",
    "load_problems_with_report",
    "normalize_dapo_row",
    "prepare_dapo",
    "split_dev",
    "strip_dapo_template",
    "write_jsonl",
]
