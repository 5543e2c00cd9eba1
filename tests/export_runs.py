"""Test helper for the export tests (tests/test_export.py, tests/test_export_errors.py): trained runs to
export, and the engines' side of each check.

- ``lora_run``: a tiny Llama model (the engine size: heads of 32, the smallest vLLM's CPU build runs)
  fine-tuned in full on four fixed questions (it stands for an SFT model), then a LoRA run over it that
  changes every answer, checkpointed at steps 20 and 40 by the trainer's own checkpoint code
  (``CheckpointManager`` and the local backend's ``save_state``). Its reference answers are the run's as
  ``retool eval --checkpoint RUN`` samples them: a local client with the checkpoint loaded, greedy.
- ``demo``: a demo folder as ``retool demo`` leaves it (settings.json, model_sft/, rl/, model_rl/,
  report.md): Qwen2, full fine-tuning, as the tiny recipe trains.
- llama.cpp through xllamacpp's in-process server (completions on token ids, ``/tokenize`` over HTTP),
  transformers' greedy ``generate``, and the CLI run as a user runs it.

Both models are trained to confident answers (top-1 margins above one logit), so greedy decoding does not
hinge on the last bits of a float and every engine must give the run's answers exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from test_cli_errors import run_retool  # tests/ helper

REPO = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="session")
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


def hf_greedy(
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


def llama_complete(server: Any, prompt: list[int], max_tokens: int) -> list[int]:
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


def llama_tokenize(server: Any, text: str) -> list[int]:
    import urllib.request

    body = json.dumps({"content": text, "parse_special": True}).encode()
    request = urllib.request.Request(
        server.listening_address + "/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return [int(t) for t in json.loads(reply.read())["tokens"]]


def next_token_agreement(a: Any, b: Any, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Along each of ``answers`` (teacher-forced), the share of positions where ``a`` and ``b`` pick the
    same next token."""
    same = total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        for i in range(len(answer) + 1):
            prefix = prompt + answer[:i]
            same += llama_complete(a, prefix, 1) == llama_complete(b, prefix, 1)
            total += 1
    return same / total


def check_gguf(folder: Path, trained: Trained) -> float:
    """llama.cpp on the f16 and q8_0 files: the HF tokenizer's ids, the run's greedy answers (f16), and
    q8_0's next-token agreement with f16 (returned)."""
    files = {t: next(folder.glob(f"*-{t}.gguf")) for t in ("f16", "q8_0")}
    with llama_server(files["f16"]) as f16, llama_server(files["q8_0"]) as q8:
        for text, prompt in zip(trained.texts, trained.prompts, strict=True):
            assert llama_tokenize(f16, text) == prompt
        answers = [cut(llama_complete(f16, p, MAX_NEW), trained.eos) for p in trained.prompts]
        assert answers == trained.reference
        agreement = next_token_agreement(f16, q8, trained.prompts, answers)
    assert agreement >= Q8_AGREEMENT, agreement
    return agreement


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A demo folder as ``retool demo`` leaves it: settings.json, model_sft/, rl/ (a full fine-tuning
    checkpoint), model_rl/ and report.md; Qwen2, the tiny recipe's architecture."""
    import torch
    from transformers import AutoTokenizer

    from retool.backends.local.tinymodel import build_tiny_model
    from retool.pipeline.settings import DemoSettings
    from retool.protocol.formats import HermesJsonFormat

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


def retool_cli(cwd: Path, *args: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m retool ARGS`` offline, as tests/test_cli_errors.py runs it; ``limit_bytes`` caps the size
    of any file it writes (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as on a full
    disk a write fails with ENOSPC)."""
    import resource
    import signal

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


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".export-" in p.name]
