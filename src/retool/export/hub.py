"""``--push-to-hub``: a finished export folder uploaded as a Hugging Face Hub model repository.

Owns the two calls, through huggingface_hub's own client: ``HfApi.create_repo`` (``exist_ok``: pushing
again updates the repository) and ``HfApi.upload_folder`` (one commit of every file of the folder). The
token is huggingface_hub's (``HF_TOKEN``, or ``hf auth login``'s), the endpoint its ``HF_ENDPOINT``. Run
here only against a local stand-in of the Hub's upload API (``tests/test_export_errors.py``); see
docs/not-run-here.md.
"""

from __future__ import annotations

from pathlib import Path

from retool.export.errors import ExportError


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False, endpoint: str | None = None) -> str:
    """Upload ``folder`` to the model repository ``repo_id`` (created when missing); its URL."""
    from huggingface_hub import HfApi  # deferred: only a push needs it
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint)
    try:
        # private=None: a new repository gets the account's default visibility; an existing one keeps its own.
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message=f"retool export: {folder.name}",
        )
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ExportError(
            f"pushing {folder} to the Hub as {repo_id} failed ({first}); the export itself is complete: "
            f"log in (hf auth login, or HF_TOKEN) and push it with: hf upload {repo_id} {folder}"
        ) from None
    return str(url)
