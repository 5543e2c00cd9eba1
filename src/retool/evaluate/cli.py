"""``retool eval``: text-only vs ReTool evaluation from the command line (a thin layer over ``evaluate``)."""

from __future__ import annotations

from pathlib import Path

import typer

from retool.config import ConfigError, flag_overrides, load_config
from retool.data import DataError
from retool.errors import UserError
from retool.evaluate.runner import MODES, evaluate
from retool.evaluate.settings import EvalError
from retool.evaluate.store import EvalStoreError, EvalSummary
from retool.jsonl import as_list, as_number
from retool.sandbox import SandboxPreimportError


def format_summary(summary: EvalSummary) -> str:
    """A few human lines for the end of an eval."""
    s = summary["settings"]
    m = summary["metrics"]
    n = s["val_n"]
    lo, hi = (as_number(x) for x in as_list(m["average_at_n_ci95"]))
    lat = as_number(m["mean_exec_latency"])
    sc = m["self_correction_given_error"]
    lines = [
        f"{s['mode']} | {s['model']}{' @ ' + str(s['checkpoint']) if s['checkpoint'] else ''} | {s['dataset']} "
        f"| {summary['completed']}/{summary['total']} problems ({summary['status']})",
        f"  Average@{n}: {100 * as_number(m['average_at_n']):.2f}%  (95% CI {100 * lo:.2f}-{100 * hi:.2f})",
        f"  Pass@{n}:    {100 * as_number(m['pass_at_n']):.2f}%   maj@{n}: {100 * as_number(m['maj_at_n']):.2f}%",
        f"  format: {100 * as_number(m['format_rate']):.2f}%  tool-call rate: {100 * as_number(m['tool_call_rate']):.2f}%  "
        f"code calls: {m['mean_code_calls']:.2f}  turns: {m['mean_turns']:.2f}",
        f"  executions: {m['executions']}  mean latency: {lat:.3f}s  "
        f"self-correction after error: {'n/a' if sc is None else f'{100 * as_number(sc):.1f}%'}  tokens: {m['tokens_generated']}",
    ]
    if summary.get("failed_problems"):
        lines.append(f"  {len(summary['failed_problems'])} problems hit sampler errors; rerun to retry them")
    return "\n".join(lines)


def eval_command(
    mode: str = typer.Option(..., "--mode", help="text-only (no tool, one turn) or retool (the tool loop)."),
    model: str | None = typer.Option(
        None, "--model", help="Model (HF folder, Hub id, ...); default: config."
    ),
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", help="State to load (retool train checkpoint)."
    ),
    config: str | None = typer.Option(None, "--config", help="Config TOML file or preset name."),
    overrides: list[str] = typer.Option([], "--set", help="Config override section.key=value (repeatable)."),
    dataset: str | None = typer.Option(
        None,
        "--dataset",
        help="aime2025 | aime2024 | math500 | synthetic | dapo | PATH (default: eval.dataset).",
    ),
    data_dir: Path | None = typer.Option(
        None,
        "--data-dir",
        help="Folder with <name>.jsonl for named sets (default data.data_dir, $RETOOL_DATA_DIR, the user cache "
        "that retool data fetch fills; else the Hub).",
    ),
    question_field: str | None = typer.Option(None, "--question-field"),
    answer_field: str | None = typer.Option(None, "--answer-field"),
    id_field: str | None = typer.Option(None, "--id-field"),
    val_n: int | None = typer.Option(
        None, "--val-n", min=1, help="Candidates per problem (N of Average@N; default eval.val_n)."
    ),
    temperature: float | None = typer.Option(None, "--temperature", help="Sets sampling.temperature."),
    top_p: float | None = typer.Option(None, "--top-p", help="Sets sampling.top_p."),
    output: Path = typer.Option(
        ..., "--output", "-o", help="Per-problem JSONL; FILE.summary.json goes beside it."
    ),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Only the first N problems."),
    seed: int | None = typer.Option(None, "--seed", help="Default eval.seed."),
    concurrency: int | None = typer.Option(
        None, "--concurrency", min=1, help="Problems rolled out at once (default eval.concurrency)."
    ),
    save_transcripts: bool | None = typer.Option(
        None, "--save-transcripts", help="Keep every candidate's messages (default eval.save_transcripts)."
    ),
) -> None:
    """Evaluate a model text-only or with the code tool; resumable (rerun the same command).

    Every default comes from the config (``[eval]``, ``[sampling]``, ``[data]``); a flag overrides it only
    when given, after any ``--set``.
    """
    if mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    flags = {
        "model.name": model,
        "eval.dataset": dataset,
        "data.data_dir": None if data_dir is None else str(data_dir),
        "eval.val_n": val_n,
        "sampling.temperature": temperature,
        "sampling.top_p": top_p,
        "eval.limit": limit,
        "eval.seed": seed,
        "eval.concurrency": concurrency,
        "eval.save_transcripts": save_transcripts,
    }
    try:
        cfg = load_config(config, [*overrides, *flag_overrides(flags)])
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    fields = {"question_field": question_field, "answer_field": answer_field, "id_field": id_field}
    try:
        summary = evaluate(
            cfg,
            mode=mode,
            output=output,
            checkpoint=checkpoint,
            dataset_fields={k: v for k, v in fields.items() if v},
        )
    except (EvalError, EvalStoreError, DataError, SandboxPreimportError) as exc:
        raise UserError(str(exc)) from None
    typer.echo(format_summary(summary))
    typer.echo(f"records: {output}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
