"""The offline GGUF path: the tiny model exported to GGUF loads through transformers' GGUF support in the
local backend, matches the HF folder it came from, and `retool eval` / `retool train` accept the file."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers refuses GGUF files without it

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import SamplingParams
from retool.errors import ModelLoadError
from retool.export.errors import ExportError
from retool.export.gguf import write_gguf_from_folder

# Small budgets shared by the CLI runs: one short turn pair, one thread (the CPU is shared).
SMALL = [
    "backend.device=cpu",
    "backend.dtype=float32",
    "backend.cpu_threads=1",
    "rollout.max_tokens_per_turn=16",
    "rollout.max_assistant_turns=2",
    "rollout.max_code_calls=1",
]


@pytest.fixture(scope="module")
def gguf_path(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_from_folder(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def _client(model: str, extra: list[str] = ()) -> TrainingClient:
    from retool.backends import make_training_client
    from retool.config import load_config

    cfg = load_config(None, [f'model.name="{model}"', "lora.enabled=false", *SMALL, *extra])
    return make_training_client(cfg)


def _run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "retool.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_exported_file_holds_qwen2_tensors_and_tokenizer(gguf_path: Path, tiny_model_dir: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" in names and "blk.0.attn_q.bias" in names and "output_norm.weight" in names
    assert "output.weight" not in names  # tied embeddings
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "qwen2"
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == len(hf)


def test_local_client_loads_gguf_and_matches_hf_folder(gguf_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    gg = _client(str(gguf_path))
    ref = _client(str(tiny_model_dir))
    try:
        assert gg.gguf_file == gguf_path.name and gg.model_path == str(gguf_path.parent)
        hf_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        assert gg.tokenizer.chat_template == hf_tok.chat_template
        assert gg.eos_ids == ref.eos_ids and gg.pad_id == ref.pad_id
        messages = [
            {"role": "user", "content": "What is 12+30? print(sum(range(10))) <tool_call> x_y (a)"},
        ]
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert gg.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
        prompt = hf_tok(text)["input_ids"]
        # The GGUF tokenizer is rebuilt from metadata: it must split text exactly like the original.
        assert gg.tokenizer(text)["input_ids"] == prompt
        assert hf_tok.convert_tokens_to_ids("<tool_call>") in prompt

        params = SamplingParams(max_tokens=12, temperature=0.0, seed=0)
        got = gg.sampling_client().sample(prompt, 1, params)[0]
        want = ref.sampling_client().sample(prompt, 1, params)[0]
        assert got.tokens == want.tokens
        assert len(got.logprobs) == len(want.logprobs) > 0
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-4
        # Greedy text from a random model is repetitive, so also compare every position's full logits.
        import torch

        ids = torch.tensor([prompt + got.tokens])
        with torch.no_grad():
            diff = (gg.model(input_ids=ids).logits - ref.model(input_ids=ids).logits).abs().max()
        assert float(diff) < 1e-4
    finally:
        gg.close()
        ref.close()


def test_folder_plus_gguf_file_setting(gguf_path: Path) -> None:
    client = _client(str(gguf_path.parent), [f'model.gguf_file="{gguf_path.name}"'])
    try:
        assert client.gguf_file == gguf_path.name
        assert client.tokenizer.chat_template
    finally:
        client.close()


def test_lora_on_a_gguf_model_saves_merged_as_a_plain_folder(gguf_path: Path, tmp_path: Path) -> None:
    """A GGUF-loaded model is dequantised: its merged LoRA weights save as an ordinary HF folder (no GGUF
    quantizer mark that would make save_pretrained refuse, or the folder point back at a GGUF file), and
    the folder reloads to the same outputs as the client's sampler."""
    import torch

    from retool.pipeline.run import save_hf

    client = _client(str(gguf_path), ["lora.enabled=true", "lora.rank=4"])
    try:
        with torch.no_grad():  # a trained adapter: B != 0
            for name, p in client.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        client._weights_version += 1
        folder = save_hf(client, tmp_path / "merged")
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config
        reloaded = _client(str(folder), ["lora.enabled=false"])
        try:
            prompt = client.tokenizer("What is 12+30?")["input_ids"]
            params = SamplingParams(max_tokens=8, temperature=0.0, seed=0)
            live = client.sampling_client().sample(prompt, 1, params)[0]
            saved = reloaded.sampling_client().sample(prompt, 1, params)[0]
            assert live.tokens == saved.tokens
            ids = torch.tensor([prompt + live.tokens])
            with torch.no_grad():  # the adapter (unmerged) and the saved merged weights agree
                diff = (client.model(input_ids=ids).logits - reloaded.model(input_ids=ids).logits).abs().max()
            assert float(diff) < 1e-4
        finally:
            reloaded.close()
    finally:
        client.close()


def test_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model\.gguf': no such file or folder"):
        _client(str(tmp_path / "nowhere" / "model.gguf"))


def test_eval_cli_runs_on_a_gguf_file(gguf_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "question": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
            for i in (1, 2)
        )
    )
    out = tmp_path / "eval" / "records.jsonl"
    args = ["eval", "--mode", "retool", "--model", str(gguf_path), "--dataset", str(data)]
    args += ["--val-n", "1", "--limit", "1", "--concurrency", "1", "-o", str(out)]
    for item in [*SMALL, "sandbox.workers=1"]:
        args += ["--set", item]
    proc = _run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(out.with_name("records.summary.json").read_text())
    assert summary["completed"] == summary["total"] == 1
    assert summary["status"] == "complete"
    assert len(out.read_text().splitlines()) == 1


def test_train_cli_takes_one_step_on_a_gguf_file(gguf_path: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--config", "tiny", "--run-dir", str(run_dir)]
    sets = [
        f'model.name="{gguf_path}"',
        "train.steps=1",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "checkpoint.every=1",
        "logging.tracker=none",
        "sandbox.workers=1",
        *SMALL,
    ]
    for item in sets:
        args += ["--set", item]
    proc = _run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    state = json.loads(
        (run_dir / "checkpoints" / "step_000001" / "backend" / "trainer_state.json").read_text()
    )
    assert state["gguf_file"] == gguf_path.name
    assert state["model_path"] == str(gguf_path.parent)
    assert (run_dir / "metrics.jsonl").read_text().strip()


def test_phrase_tokens_that_transformers_would_split_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from retool.backends.local.tinymodel import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", size="test", phrase_tokens=["Solve it step by step."])
    with caplog.at_level(logging.WARNING, logger="retool.export.gguf"):
        write_gguf_from_folder(folder, tmp_path / "m.gguf")
    assert "Solve it step by step." in caplog.text


def test_export_refuses_bad_output_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"\.gguf"):
        write_gguf_from_folder(tiny_model_dir, tmp_path / "model.bin")
