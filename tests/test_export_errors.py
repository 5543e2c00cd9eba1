"""``retool export`` on bad input and ``--push-to-hub``: a run folder without a checkpoint, an architecture
GGUF cannot hold, an existing ``--out`` without ``--force``, a full disk (a cap on the size of a written
file), an ``--out`` that would replace its source: one line, exit 2, nothing left behind. The push runs
huggingface_hub's own client against a local stand-in of the Hub's upload API.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from export_runs import Trained, lora_run, no_leftovers, retool_cli  # tests/ helper
from retool.export import ExportError, ExportRequest, export_model

__all__ = ["lora_run"]  # the fixture, shared with tests/test_export.py through export_runs


def test_a_run_folder_without_a_checkpoint(tmp_path: Path) -> None:
    from test_cli_errors import assert_one_line_error

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    proc = retool_cli(tmp_path, "export", str(run), "--out", "out")
    assert_one_line_error(proc, f"{run} holds no checkpoint")
    assert not (tmp_path / "out").exists()
    no_leftovers(tmp_path)


def test_an_architecture_gguf_cannot_hold(tmp_path: Path) -> None:
    """A Qwen3 model (q/k norms, another layout) is refused for GGUF, after the model was read: the
    temp folder goes too."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retool.backends.local.tinymodel import build_tokenizer
    from test_cli_errors import assert_one_line_error

    tokenizer = build_tokenizer(vocab_size=300)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        head_dim=16,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "qwen3")
    tokenizer.save_pretrained(tmp_path / "qwen3")
    proc = retool_cli(tmp_path, "export", "qwen3", "--out", "out", "-f", "hf", "-f", "gguf")
    assert_one_line_error(proc, "GGUF export writes the llama, qwen2 architectures", "not 'qwen3'")
    assert not (tmp_path / "out").exists()
    no_leftovers(tmp_path)


def test_an_existing_out_needs_force_and_is_replaced_only_when_complete(
    lora_run: Trained, tmp_path: Path
) -> None:
    from test_cli_errors import assert_one_line_error

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier export")
    proc = retool_cli(tmp_path, "export", str(lora_run.folder), "--out", "out", "-f", "peft")
    assert_one_line_error(proc, "out exists: pass --force to replace it")
    # A full disk (here: a cap on the size of a written file) fails the export in one line; the earlier
    # folder is untouched and no temp folder is left.
    args = ["export", str(lora_run.folder), "--out", "out", "--dtype", "fp32", "--force"]
    proc = retool_cli(tmp_path, *args, limit_bytes=200_000)
    assert_one_line_error(
        proc, "the export failed", "File too large", "nothing was left behind", "out is unchanged"
    )
    assert (out / "keep.txt").read_text() == "an earlier export"
    no_leftovers(tmp_path)
    result = export_model(ExportRequest(lora_run.folder, out, formats=("peft",), force=True))
    assert (out / "adapter_model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert result.files[0].format.startswith("peft")
    no_leftovers(tmp_path)


def test_out_may_not_replace_its_source(lora_run: Trained) -> None:
    with pytest.raises(ExportError, match="would replace the source"):
        export_model(ExportRequest(lora_run.folder / "checkpoints", lora_run.folder, force=True))


def test_pre_tokenizers_map_to_llama_cpp_names(fixture_data: Path) -> None:
    from transformers import AutoTokenizer

    from retool.backends.local.tinymodel import build_tokenizer
    from retool.export.gguf import pre_tokenizer_name

    def pre(tokenizer: Any) -> Any:
        return json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]

    assert (
        pre_tokenizer_name(
            pre(AutoTokenizer.from_pretrained(fixture_data / "tokenizers" / "Qwen2.5-Instruct"))
        )
        == "qwen2"
    )
    assert pre_tokenizer_name(pre(build_tokenizer(vocab_size=300))) == "smollm"
    assert pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}) == "gpt-2"
    with pytest.raises(ExportError, match="not one this exporter maps"):
        pre_tokenizer_name({"type": "Metaspace", "replacement": "\u2581"})


# -- the Hub: huggingface_hub's own client against a local stand-in of its upload API ----------------------


class HubStandIn(BaseHTTPRequestHandler):
    """The three routes ``create_repo`` and ``upload_folder`` call: create the repo, ask how each file is
    uploaded (answered "regular": inline in the commit, base64), and the commit itself (NDJSON)."""

    repos: ClassVar[dict[str, dict[str, Any]]] = {}
    metadata: ClassVar[list[Any]] = []

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _reply(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        base = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        if self.path == "/api/repos/create":
            request = json.loads(body)
            repo = (
                f"{request['organization']}/{request['name']}"
                if request.get("organization")
                else request["name"]
            )
            self.repos[repo] = {
                "visibility": request.get("visibility"),
                "files": {},
                "token": self.headers.get("authorization"),
            }
            return self._reply({"url": f"{base}/{repo}", "name": repo, "id": repo})
        if self.path == "/api/validate-yaml":  # the card's front matter, checked before the upload
            import yaml

            metadata = yaml.safe_load(json.loads(body)["content"].split("---")[1])
            self.metadata.append(metadata)
            return self._reply({"errors": [], "warnings": []})
        parts = self.path.removeprefix("/api/models/").split("/")
        repo, action = "/".join(parts[:2]), parts[2]
        if action == "preupload":
            files = json.loads(body)["files"]
            return self._reply(
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]
                }
            )
        if action == "commit":
            for line in body.decode().splitlines():
                entry = json.loads(line)
                if entry["key"] == "file":
                    self.repos[repo]["files"][entry["value"]["path"]] = base64.b64decode(
                        entry["value"]["content"]
                    )
            return self._reply(
                {"commitUrl": f"{base}/{repo}/commit/{'0' * 40}", "commitOid": "0" * 40, "success": True}
            )
        self.send_error(404)


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), HubStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    HubStandIn.repos.clear()
    HubStandIn.metadata.clear()
    yield endpoint
    server.shutdown()


def test_push_to_hub_uploads_the_finished_folder(lora_run: Trained, tmp_path: Path, hub: str) -> None:
    out = tmp_path / "pushed"
    result = export_model(
        ExportRequest(lora_run.folder, out, formats=("peft",), push_to_hub="me/tiny-retool", private=True)
    )
    assert result.hub_url == f"{hub}/me/tiny-retool"
    repo = HubStandIn.repos["me/tiny-retool"]
    assert repo["visibility"] == "private" and repo["token"] == "Bearer hf_standin"
    assert repo["files"] == {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(repo["files"]) == {"README.md", "adapter_config.json", "adapter_model.safetensors"}
    [metadata] = HubStandIn.metadata
    assert metadata["library_name"] == "peft" and "retool" in metadata["tags"]


def test_a_failed_push_keeps_the_export_and_says_how_to_retry(
    lora_run: Trained, tmp_path: Path, hub: str
) -> None:
    with pytest.raises(
        ExportError, match=r"pushing .* failed .* the export itself is complete.*hf upload me/x"
    ):
        export_model(
            ExportRequest(lora_run.folder, tmp_path / "kept", formats=("peft",), push_to_hub="me/x/y/z")
        )
    assert (tmp_path / "kept" / "adapter_model.safetensors").is_file()
