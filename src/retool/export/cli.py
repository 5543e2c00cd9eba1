"""``retool export``: a training run, a demo's model or a model folder -> HF folder, PEFT adapter, GGUF files
and a model card, optionally pushed to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

import typer

from retool.export.errors import ExportError
from retool.export.source import ModelChoice
from retool.export.writer import FORMATS, ExportRequest, export_model


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export_command(
        source: Path = typer.Argument(
            ..., help="A training run folder (its checkpoints), a demo folder, or a model folder."
        ),
        out: Path = typer.Option(
            ..., "--out", "-o", help="The folder to write (it must not exist, or --force)."
        ),
        step: int | None = typer.Option(
            None, "--step", help="The checkpoint of this step (default: the last)."
        ),
        model: str | None = typer.Option(
            None, "--model", help="A demo folder's model: sft or rl (default rl)."
        ),
        formats: list[str] = typer.Option(
            ["hf"], "--format", "-f", help=f"{' | '.join(FORMATS)}; repeat for several (default hf)."
        ),
        dtype: str = typer.Option("bf16", "--dtype", help="The hf folder's dtype: bf16, fp32 or f16."),
        gguf_types: list[str] = typer.Option(
            ["f16"], "--gguf-type", help="GGUF tensor type: f16, q8_0 or f32; repeat for several files."
        ),
        force: bool = typer.Option(False, "--force", help="Replace --out if it exists (only once complete)."),
        push_to_hub: str | None = typer.Option(
            None, "--push-to-hub", help="Upload the folder to this Hugging Face Hub model repo (owner/name)."
        ),
        private: bool = typer.Option(False, "--private", help="Create the Hub repo private."),
    ) -> None:
        """Export a trained model for serving engines (transformers, vLLM, llama.cpp, Ollama) and the Hub."""
        choice: ModelChoice | None = None
        if model == "sft":
            choice = "sft"
        elif model == "rl":
            choice = "rl"
        elif model is not None:
            raise ExportError(f"--model {model!r}: a demo's model is sft or rl")
        request = ExportRequest(
            source=source,
            out=out,
            formats=tuple(dict.fromkeys(formats)),
            step=step,
            model=choice,
            dtype=dtype,
            gguf_types=tuple(dict.fromkeys(gguf_types)),
            force=force,
            push_to_hub=push_to_hub,
            private=private,
        )
        result = export_model(request)
        typer.echo(f"exported {result.source.what} to {result.out} in {result.seconds:.1f}s:")
        for entry in result.files:
            typer.echo(f"  {entry.format:<28} {entry.path}")
        typer.echo(f"  {'model card':<28} README.md")
        if result.hub_url:
            typer.echo(f"pushed to {result.hub_url}")
