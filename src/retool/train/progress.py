"""Live progress of a training run: step, reward, correct rate, code calls and ETA (rich, on stderr).

Off when ``logging.progress`` is false or stderr is not a terminal; then one log line per step is all.
"""

from __future__ import annotations

import logging
import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

from retool.train.metrics import MetricsRecord

logger = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.total = total_steps
        self.start_step = start_step
        self._t0 = time.monotonic()
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        if enabled and sys.stderr.isatty():
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")

    def eta_seconds(self, step: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return (time.monotonic() - self._t0) / done * (self.total - step)

    def update(self, step: int, metrics: MetricsRecord) -> None:
        info = (
            f"reward {metrics.get('task/reward_mean', 0.0):+.3f}  "
            f"correct {metrics.get('task/correct_rate', 0.0):.1%}  "
            f"calls {metrics.get('tool/mean_code_calls', 0.0):.2f}"
        )
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=step, info=info)
        else:
            eta = self.eta_seconds(step)
            eta_text = f"{eta:.0f}s" if eta == eta else "?"
            logger.info("step %d/%d  %s  ETA %s", step, self.total, info, eta_text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
