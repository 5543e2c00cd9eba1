"""PNG plots of eval comparisons and training curves (matplotlib, Agg backend: no display needed).

- ``accuracy.png``: Average@N per checkpoint, one bar per mode, with its 95% bootstrap interval as an
  error bar and Pass@N as a marker above it;
- ``format_rate.png``: share of candidates with a valid ``\\boxed{}`` per checkpoint and mode;
- ``code_calls.png``: mean code calls and tool-call rate per checkpoint and mode;
- ``pass_at_k.png``: the unbiased pass@k curve of every eval;
- ``training_curves.png``: per step from ``metrics.jsonl`` (whichever panels' keys the log has): reward,
  correct rate, format rate, code calls and tool-call rate, the policy's entropy beside the sampled
  tokens' NLL, the KL to the starting policy (measured every ``train.ref_kl_every`` steps: a step without
  it is skipped, not drawn as 0), void-turn and truncation rates, and the informative share of groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from retool.analyze.report import EvalResult, TrainingLog, ordered_checkpoints, ordered_modes
from retool.jsonl import as_list, as_number, as_object

if TYPE_CHECKING:  # matplotlib is imported only when plots are drawn (see _pyplot)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

# (title, predicate over a metric key): the panels of the training-curves figure, in order.
CURVE_PANELS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("reward", lambda k: "reward" in k),
    ("correct rate", lambda k: "correct_rate" in k and "without" not in k and "with_code" not in k),
    ("format rate", lambda k: "format_rate" in k),
    ("code calls", lambda k: ("code_calls" in k or "code_share" in k) and not k.startswith("stop/")),
    ("entropy (nats)", lambda k: k in ("policy/entropy", "policy/sampled_nll")),
    ("KL to the starting policy", lambda k: k == "policy/ref_kl"),
    ("void turns, truncation", lambda k: k in ("task/void_turn_rate", "task/truncated_rate")),
    ("informative share of groups", lambda k: k == "sampling/informative_share"),
)


def _pyplot() -> ModuleType:
    import matplotlib  # deferred: matplotlib (~1 s) only when plots are drawn

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # deferred: as matplotlib above

    return plt


def _grouped_bars(
    evals: list[EvalResult],
    key: str,
    ax: Axes,
    *,
    percent: bool,
    with_ci: bool = False,
    with_pass: bool = False,
) -> None:
    ckpts = ordered_checkpoints(evals)
    modes = ordered_modes(evals)
    by_key = {(e.label, e.mode): e for e in evals}
    width = 0.8 / max(1, len(modes))
    scale = 100.0 if percent else 1.0
    for j, mode in enumerate(modes):
        xs, ys, lo_err, hi_err, passes = [], [], [], [], []
        for i, ckpt in enumerate(ckpts):
            e = by_key.get((ckpt, mode))
            if e is None or e.metrics.get(key) is None:
                continue
            y = float(as_number(e.metrics[key])) * scale
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(y)
            lo, hi = as_list(e.metrics.get("average_at_n_ci95", [None, None])) if with_ci else (None, None)
            lo_err.append(max(0.0, y - float(as_number(lo)) * scale) if lo is not None else 0.0)
            hi_err.append(max(0.0, float(as_number(hi)) * scale - y) if hi is not None else 0.0)
            passes.append(float(as_number(e.metrics.get("pass_at_n", 0.0))) * scale)
        if not xs:
            continue
        ax.bar(xs, ys, width=width * 0.95, label=mode)
        if with_ci:
            ax.errorbar(xs, ys, yerr=[lo_err, hi_err], fmt="none", ecolor="black", capsize=4, linewidth=1)
        if with_pass:
            label = "Pass@N" if j == 0 else None
            ax.scatter(xs, passes, marker="_", s=400, linewidths=2.5, color="black", zorder=3, label=label)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(
                f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7
            )
    ax.set_xticks(range(len(ckpts)))
    ax.set_xticklabels(
        ckpts, rotation=20 if len(ckpts) > 3 else 0, ha="right" if len(ckpts) > 3 else "center"
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend()


def plot_evals(evals: list[EvalResult], out_dir: Path) -> list[Path]:
    if not evals:
        return []
    plt = _pyplot()
    n_values = sorted({str(e.settings.get("val_n", e.metrics.get("val_n", "N"))) for e in evals})
    n = n_values[0] if len(n_values) == 1 else "N"
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(ordered_checkpoints(evals))), 4.5))
    _grouped_bars(evals, "average_at_n", ax, percent=True, with_ci=True, with_pass=True)
    ax.set_ylabel("% correct")
    ax.set_title(f"Average@{n} with 95% bootstrap CI (bars); Pass@{n} (dash)")
    ax.set_ylim(0, 105)
    written.append(_save(fig, out_dir / "accuracy.png", plt))

    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(ordered_checkpoints(evals))), 4.5))
    _grouped_bars(evals, "format_rate", ax, percent=True)
    ax.set_ylabel("% of candidates")
    ax.set_title("Format rate (a valid \\boxed{} answer)")
    ax.set_ylim(0, 105)
    written.append(_save(fig, out_dir / "format_rate.png", plt))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 4 * len(ordered_checkpoints(evals))), 4.5))
    _grouped_bars(evals, "mean_code_calls", ax1, percent=False)
    ax1.set_title("Mean code calls per candidate")
    _grouped_bars(evals, "tool_call_rate", ax2, percent=True)
    ax2.set_title("Tool-call rate (% candidates with >= 1 call)")
    ax2.set_ylim(0, 105)
    written.append(_save(fig, out_dir / "code_calls.png", plt))

    from matplotlib.ticker import MaxNLocator  # deferred: matplotlib, as in _pyplot

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for e in evals:
        curve = {int(k): float(as_number(v)) for k, v in as_object(e.metrics.get("pass_at_k") or {}).items()}
        if curve:
            ks = sorted(curve)
            ax.plot(ks, [100 * curve[k] for k in ks], marker="o", label=f"{e.label} ({e.mode})")
    ax.set_xlabel("k")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("pass@k (%)")
    ax.set_title("Unbiased pass@k (k = 1 is Average@N, k = N is Pass@N)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "pass_at_k.png", plt))
    return written


def curve_keys(logs: list[TrainingLog]) -> list[tuple[str, list[str]]]:
    """(panel title, metric keys) for each panel that has at least one key in the logs."""
    keys: list[str] = []
    for log in logs:
        for row in log.rows:
            for k in row:
                if k != "step" and k not in keys:
                    keys.append(k)
    panels = []
    for title, pred in CURVE_PANELS:
        chosen = [k for k in keys if pred(k)]
        if chosen:
            panels.append((title, chosen[:4]))
    return panels


def plot_training(logs: list[TrainingLog], out_dir: Path) -> list[Path]:
    if not logs:
        return []
    panels = curve_keys(logs)
    if not panels:
        logger.warning(
            "training logs have none of the curves' keys (reward, correct, format, ...); no curves drawn"
        )
        return []
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # deferred: matplotlib, as in _pyplot

    cols = min(4, len(panels))  # rows of at most four panels
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for log in logs:
            for key in keys:
                pts = [(r["step"], r[key]) for r in log.rows if key in r]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                name = key if len(logs) == 1 else f"{log.label}: {key}"
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return [_save(fig, out_dir / "training_curves.png", plt)]


def _save(fig: Figure, path: Path, plt: ModuleType) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
