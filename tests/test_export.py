"""``retool export`` (``retool.export``): a trained model out to the formats serving engines load, each one
checked in the engine that loads it, against the greedy answers of the run itself.

The run: a tiny Llama model (the engine size: heads of 32, the smallest vLLM's CPU build runs) fine-tuned in
full on four fixed questions (it stands for an SFT model), then a LoRA run over it that changes every answer,
checkpointed at steps 20 and 40 by the trainer's own checkpoint code (``CheckpointManager`` and the local
backend's ``save_state``). The reference answers are the run's as ``retool eval --checkpoint RUN`` samples
them: a local client with the checkpoint loaded, greedy. Trained to confident answers (top-1 margins above
one logit), greedy decoding does not hinge on the last bits of a float, so every engine must match exactly
(f16 and bf16 included); q8_0 is held to next-token agreement with f16.

Measured here (2 shared cores): f16 GGUF in llama.cpp and the bf16 / fp32 folders in transformers give the
run's answers token for token; q8_0's next token agrees with f16's at every position along f16's answers
(1.00 on both models; the bar is ``Q8_AGREEMENT``).

A demo folder (Qwen2, full fine-tuning, as the tiny recipe trains) exports its RL model and card; bad input
ends in one line with nothing left behind; the Hub push goes through huggingface_hub's own client to a
local stand-in of the Hub's upload API.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from retool.export import ExportError, ExportRequest, export_model

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("RETOOL_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
Q8_AGREEMENT = 0.85  # q8_0 vs f16: share of positions where the next greedy token is the same
MAX_NEW = 40
QUESTIONS = ["What is 17 times 23?", "What is 2+3?", "Is 91 prime?", "Sum 1 to 10?"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _answers(call: Any) -> tuple[list[str], list[str]]:
    """The SFT answers and the different ones the LoRA run teaches (``call`` renders a tool call)."""
    sft = [call("print(17*23)"), "2+3 = 5, so \\boxed{5}", "91 = 7*13: not prime. \\boxed{no}"]
    rl = [call("print(17 * 23)"), "2+3 is 5. \\boxed{5}", "91 = 7*13, not a prime: \\boxed{no}"]
    return [*sft, call("print(sum(range(11)))")], [*rl, "1+2+...+10 = 55. \\boxed{55}"]


@dataclass
class Trained:
    folder: Path  # the run (or demo) folder
    base: Path  # the model training started from
    prompts: list[list[int]]  # the chat prompts of QUESTIONS, as the protocol builds them
    texts: list[str]  # the same prompts as text
    reference: list[list[int]]  # the run's greedy answers, cut before the end of turn
    eos: set[int]


def _protocol(tokenizer: Any) -> Any:
    from retool.protocol import ChatProtocol

    return ChatProtocol(tokenizer, "hermes", use_tools=False, system_prompt="compact")


def _datums(tokenizer: Any, prompts: list[list[int]], answers: list[str]) -> list[Any]:
    from retool.backends.interface.types import Datum

    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        target = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        seq = prompt + target
        out.append(Datum(seq[:-1], seq[1:], weights=[0.0] * (len(prompt) - 1) + [1.0] * len(target)))
    return out


def _train(client: Any, datums: list[Any], steps: int, lr: float, on_step: Any = None) -> None:
    from retool.backends.interface.types import AdamParams

    for step in range(1, steps + 1):
        client.forward_backward(datums, "cross_entropy")
        client.optim_step(AdamParams(lr=lr))
        if on_step is not None:
            on_step(step)


def _checkpoint(client: Any, run: Path, step: int) -> None:
    """What ``Trainer._checkpoint`` writes for a local backend."""
    from retool.train.checkpoint import CheckpointManager, TrainerState

    manager = CheckpointManager(run)
    tmp = manager.begin(step)
    path = client.save_state(str(tmp / "backend"))
    manager.commit(tmp, TrainerState(step=step, data_position={}), path, True)


def cut(tokens: list[int], eos: set[int]) -> list[int]:
    """An answer up to its end of turn (engines differ in whether they report the stop token)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return list(tokens[:i])
    return list(tokens)


def _greedy_of_client(client: Any, prompts: list[list[int]]) -> list[list[int]]:
    from retool.backends.interface.types import SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, seed=0)
    return [cut(client.sampling_client().sample(p, 1, params)[0].tokens, client.eos_ids) for p in prompts]


def _llama_base(folder: Path) -> Path:
    """A random tiny Llama model with the tiny model's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from retool.backends.local.tinymodel import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _full_client(model: Path, checkpoints: Path) -> Any:
    from retool.backends.local.client import LocalTrainingClient

    return LocalTrainingClient(
        model, lora=None, device="cpu", dtype="float32", seed=0, checkpoint_dir=checkpoints
    )


def _sft_model(
    start: Path, out: Path, answers: list[str], tmp: Path
) -> tuple[Path, list[list[int]], list[str]]:
    """``start`` fine-tuned in full on ``answers`` (40 steps), saved to ``out``; the prompts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(start)
    protocol = _protocol(tokenizer)
    messages = [protocol.initial_messages(q) for q in QUESTIONS]
    prompts = [protocol.build_prompt(m) for m in messages]
    texts = [protocol.render(m, add_generation_prompt=True) for m in messages]
    client = _full_client(start, tmp)
    try:
        _train(client, _datums(tokenizer, prompts, answers), 40, 3e-3)
        client.model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        client.close()
    return out, prompts, texts


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A LoRA run over a Llama SFT model, checkpoints at steps 20 and 40, and its greedy answers."""
    import torch
    from transformers import AutoTokenizer

    from retool.backends.local.client import LocalTrainingClient
    from retool.config import dump_config, load_config
    from retool.protocol.formats import HermesJsonFormat
    from retool.train.checkpoint import backend_state_of

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora_run")
    sft_answers, rl_answers = _answers(HermesJsonFormat().render_call)
    base, prompts, texts = _sft_model(_llama_base(root / "init"), root / "sft", sft_answers, root / "tmp")
    run = root / "run"
    lora = {"rank": 8, "alpha": 16, "target_modules": TARGETS}
    client = LocalTrainingClient(base, lora=lora, device="cpu", dtype="float32", seed=0, checkpoint_dir=run)
    tokenizer = AutoTokenizer.from_pretrained(base)
    try:
        datums = _datums(tokenizer, prompts, rl_answers)
        _train(client, datums, 40, 1e-2, lambda step: step % 20 == 0 and _checkpoint(client, run, step))
    finally:
        client.close()
    sets = ["lora.enabled=true", "lora.rank=8", "lora.alpha=16", f"lora.target_modules={TARGETS}"]
    config = load_config("tiny", [f'model.name="{base}"', *sets, "train.steps=40", "optimizer.lr=1e-2"])
    (run / "config.toml").write_text(dump_config(config))
    # The run's answers as `retool eval --checkpoint RUN` samples them: a fresh client, the checkpoint loaded.
    evaluator = LocalTrainingClient(
        base, lora=lora, device="cpu", dtype="float32", seed=0, checkpoint_dir=root
    )
    try:
        evaluator.load_state(backend_state_of(str(run)))
        reference = _greedy_of_client(evaluator, prompts)
        eos = set(evaluator.eos_ids)
    finally:
        evaluator.close()
    assert [tokenizer.decode(r) for r in reference] == rl_answers  # the run learned its answers
    return Trained(run, base, prompts, texts, reference, eos)


@pytest.fixture(scope="module")
def lora_export(lora_run: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports") / "tiny-llama-retool"
    request = ExportRequest(
        lora_run.folder, out, formats=("hf", "peft", "gguf"), dtype="fp32", gguf_types=("f16", "q8_0")
    )
    export_model(request)
    return out


def _hf_greedy(
    folder: Path, prompts: list[list[int]], eos: set[int], adapter: Path | None = None
) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW
            )
            answers.append(cut(out[0, len(prompt) :].tolist(), eos))
    return answers


def test_the_hf_folder_loads_in_transformers_and_answers_as_the_run(
    lora_export: Path, lora_run: Trained
) -> None:
    config = json.loads((lora_export / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "float32"
    assert (lora_export / "model.safetensors").is_file()
    generation = json.loads((lora_export / "generation_config.json").read_text())
    assert (
        set(
            generation["eos_token_id"]
            if isinstance(generation["eos_token_id"], list)
            else [generation["eos_token_id"]]
        )
        == lora_run.eos
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lora_export)
    assert tokenizer.chat_template and "tool_call" in tokenizer.chat_template
    assert _hf_greedy(lora_export, lora_run.prompts, lora_run.eos) == lora_run.reference


def test_the_peft_adapter_loads_over_its_base_and_answers_as_the_run(
    lora_export: Path, lora_run: Trained
) -> None:
    adapter = lora_export / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(lora_run.base.resolve())
    assert config["r"] == 8 and (adapter / "adapter_model.safetensors").is_file()
    assert _hf_greedy(lora_run.base, lora_run.prompts, lora_run.eos, adapter) == lora_run.reference
    # The adapter matters: the base alone answers otherwise.
    assert _hf_greedy(lora_run.base, lora_run.prompts, lora_run.eos) != lora_run.reference


@contextmanager
def llama_server(gguf_file: Path) -> Iterator[Any]:
    xllamacpp = pytest.importorskip("xllamacpp", reason="llama.cpp checks need xllamacpp (the dev extra)")
    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_file)
    params.n_ctx = 1024
    params.n_parallel = 1
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.cpuparams.poll = 0
    params.cpuparams_batch.poll = 0
    params.port = 0
    params.verbosity = -1
    params.warmup = False
    server = xllamacpp.Server(params)
    try:
        yield server
    finally:
        del server


def _llama_complete(server: Any, prompt: list[int], max_tokens: int) -> list[int]:
    request = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "n_probs": 1,
        "cache_prompt": True,
    }
    answer = server.handle_completions(request)
    assert "choices" in answer, answer
    return [int(e["id"]) for e in answer["choices"][0]["logprobs"]["content"]]


def _llama_tokenize(server: Any, text: str) -> list[int]:
    import urllib.request

    body = json.dumps({"content": text, "parse_special": True}).encode()
    request = urllib.request.Request(
        server.listening_address + "/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return [int(t) for t in json.loads(reply.read())["tokens"]]


def _next_token_agreement(a: Any, b: Any, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Along each of ``answers`` (teacher-forced), the share of positions where ``a`` and ``b`` pick the
    same next token."""
    same = total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        for i in range(len(answer) + 1):
            prefix = prompt + answer[:i]
            same += _llama_complete(a, prefix, 1) == _llama_complete(b, prefix, 1)
            total += 1
    return same / total


def check_gguf(folder: Path, trained: Trained) -> float:
    """llama.cpp on the f16 and q8_0 files: the HF tokenizer's ids, the run's greedy answers (f16), and
    q8_0's next-token agreement with f16 (returned)."""
    files = {t: next(folder.glob(f"*-{t}.gguf")) for t in ("f16", "q8_0")}
    with llama_server(files["f16"]) as f16, llama_server(files["q8_0"]) as q8:
        for text, prompt in zip(trained.texts, trained.prompts, strict=True):
            assert _llama_tokenize(f16, text) == prompt
        answers = [cut(_llama_complete(f16, p, MAX_NEW), trained.eos) for p in trained.prompts]
        assert answers == trained.reference
        agreement = _next_token_agreement(f16, q8, trained.prompts, answers)
    assert agreement >= Q8_AGREEMENT, agreement
    return agreement


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
    proc = _retool(tmp_path, "export", str(lora_run.folder), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported training run {lora_run.folder}, checkpoint step 40" in proc.stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (out / "adapter").exists() and not list(out.glob("*.gguf"))
    assert _hf_greedy(out, lora_run.prompts, lora_run.eos) == lora_run.reference


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
    assert "data.source = 'tasks'" in card
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


# -- a demo folder: Qwen2, full fine-tuning --------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A demo folder as ``retool demo`` leaves it: settings.json, model_sft/, rl/ (a full fine-tuning
    checkpoint), model_rl/ and report.md; Qwen2, the tiny recipe's architecture."""
    import torch
    from transformers import AutoTokenizer

    from retool.backends.local.tinymodel import build_tiny_model
    from retool.protocol.formats import HermesJsonFormat
    from retool.tasks.settings import DemoSettings

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("demo")
    folder = root / "demo"
    init = build_tiny_model(folder / "model_init", size="engine", seed=0)
    sft_answers, rl_answers = _answers(HermesJsonFormat().render_call)
    sft, prompts, texts = _sft_model(init, folder / "model_sft", sft_answers, root / "tmp")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    client = _full_client(sft, folder / "rl" / "checkpoints")
    try:
        _train(client, _datums(tokenizer, prompts, rl_answers), 40, 3e-3)
        _checkpoint(client, folder / "rl", 40)
        client.model.save_pretrained(folder / "model_rl")
        tokenizer.save_pretrained(folder / "model_rl")
        reference, eos = _greedy_of_client(client, prompts), set(client.eos_ids)
    finally:
        client.close()
    settings = DemoSettings(out=str(folder))
    (folder / "settings.json").write_text(json.dumps(settings.as_dict(), default=str))
    (folder / "report.md").write_text(
        "| model | mode | Average@N |\n|---|---|---|\n| sft | retool | 61.5% |\n| rl | retool | 92.9% |\n\n"
        "RL over SFT (retool mode): Average@N +31.4 points\n\n| phase | wall s |\n|---|---|\n| rl | 3 |\n"
    )
    return Trained(folder, sft, prompts, texts, reference, eos)


def test_a_demo_exports_its_rl_model_to_gguf_and_hf(demo: Trained, tmp_path: Path) -> None:
    out = tmp_path / "demo-rl"
    result = export_model(
        ExportRequest(demo.folder, out, formats=("gguf", "hf"), dtype="fp32", gguf_types=("f16", "q8_0"))
    )
    assert result.source.what == f"demo {demo.folder}, RL model (step 40)"
    assert _hf_greedy(out, demo.prompts, demo.eos) == demo.reference
    print(f"qwen2: q8_0 next-token agreement with f16 {check_gguf(out, demo):.3f}")
    card = (out / "README.md").read_text()
    assert "| rl | retool | 92.9% |" in card and "+31.4 points" in card and "| phase |" not in card
    assert "`retool demo` on the `synthetic` task" in card and "randomly initialised by retool-rl" in card
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
    with pytest.raises(ExportError, match="saves its SFT model merged"):
        export_model(ExportRequest(demo.folder, tmp_path / "peft", formats=("peft",), model="sft"))
    assert not (tmp_path / "peft").exists()


def test_the_demo_layout_is_the_pipelines() -> None:
    """The folder names the export reads are the ones the writers of those folders use."""
    from retool.backends.local import checkpoint_io
    from retool.export import source
    from retool.tasks import pipeline, traces
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


# -- bad input: one line, exit 2, nothing left behind -----------------------------------------------------


def _retool(cwd: Path, *args: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m retool ARGS`` offline, as tests/test_cli_errors.py runs it; ``limit_bytes`` caps the size
    of any file it writes (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as on a full
    disk a write fails with ENOSPC)."""
    import resource
    import signal

    from test_cli_errors import run_retool

    if limit_bytes is None:
        return run_retool(cwd, *args)

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "retool", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
        preexec_fn=cap,
    )


def _no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".export-" in p.name]


def test_a_run_folder_without_a_checkpoint(tmp_path: Path) -> None:
    from test_cli_errors import assert_one_line_error

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    proc = _retool(tmp_path, "export", str(run), "--out", "out")
    assert_one_line_error(proc, f"{run} holds no checkpoint")
    assert not (tmp_path / "out").exists()
    _no_leftovers(tmp_path)


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
    proc = _retool(tmp_path, "export", "qwen3", "--out", "out", "-f", "hf", "-f", "gguf")
    assert_one_line_error(proc, "GGUF export writes the llama, qwen2 architectures", "not 'qwen3'")
    assert not (tmp_path / "out").exists()
    _no_leftovers(tmp_path)


def test_an_existing_out_needs_force_and_is_replaced_only_when_complete(
    lora_run: Trained, tmp_path: Path
) -> None:
    from test_cli_errors import assert_one_line_error

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier export")
    proc = _retool(tmp_path, "export", str(lora_run.folder), "--out", "out", "-f", "peft")
    assert_one_line_error(proc, "out exists: pass --force to replace it")
    # A full disk (here: a cap on the size of a written file) fails the export in one line; the earlier
    # folder is untouched and no temp folder is left.
    args = ["export", str(lora_run.folder), "--out", "out", "--dtype", "fp32", "--force"]
    proc = _retool(tmp_path, *args, limit_bytes=200_000)
    assert_one_line_error(proc, "writing the export failed", "nothing was left behind", "out is unchanged")
    assert (out / "keep.txt").read_text() == "an earlier export"
    _no_leftovers(tmp_path)
    result = export_model(ExportRequest(lora_run.folder, out, formats=("peft",), force=True))
    assert (out / "adapter_model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert result.files[0].format.startswith("peft")
    _no_leftovers(tmp_path)


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


# -- vLLM's CPU build --------------------------------------------------------------------------------------

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
