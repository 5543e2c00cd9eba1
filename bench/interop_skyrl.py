"""Driver of ``bench/interop_skyrl.sh``: this project's Tinker adapter against SkyRL's Tinker API server.

Run by the shell script with this project's Python (the SkyRL server runs in its own venv, started by
the script). Two commands:

- ``model WORK``: the small Qwen3 model SkyRL and the local backend both load: the demo's tokenizer
  (trained on the synthetic task text) and sizes with Qwen3 layers (SkyRL's JAX backend has no Qwen2,
  the demo model's architecture), cold-start SFT'd briefly (``retool sft``'s stage) so that some rollouts are
  well formed and groups are not all-equal (a random model's rewards all are -1: nothing would train).
- ``run WORK --skyrl URL``: the checks, then the table:
  1. one fixed batch (the same datums, on-policy, loop weights ``1/n_tokens/n_datums``) through the
     local backend, through the Tinker adapter to ``retool serve``, and to SkyRL: loss, gradient norm
     after one ``optim_step`` at learning rate 0, and the norm of the same batch sent twice with the
     loop's weights halved (the gradient must not change; SkyRL's raw per-sequence mean halves it,
     shown by the adapter with its reduction forced to Tinker's ``sum``), and the largest difference of
     the learner logprobs from the local backend's;
  2. ``retool train`` for a few steps on each of the three (same seed, config and model), against SkyRL
     with a SIGKILL of the trainer after a checkpoint and a ``--resume``; ``retool eval`` on SkyRL on the
     saved weights; step-1 reward, loss, gradient norm and throughput side by side.

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's retool, not another

from _harness import ServeProcess, child_env, sft_model, sft_start, wait_healthy
from _machine import machine
from _results import recording, write_printed

RANK = 8
ALPHA = 32  # SkyRL fixes LoRA alpha at 32 (skyrl/tinker/api.py create_model); the local runs use it too
STEPS = 4
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the retool CLI's
KILL_AFTER = 2  # the SkyRL run is killed once this step's checkpoint is saved, then resumed
PPO = {"clip_low": 0.8, "clip_high": 1.28}
LOSS_RTOL = 1e-3  # fp32 JAX vs fp32 torch on the same base weights (LoRA B starts at 0 on both)
RATIO_RTOL = 1e-3  # the duplicated batch's gradient norm over the batch's: 1 on every backend


def log(msg: str) -> None:
    print(f"[interop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    # SkyRL checks no key; the SDK wants one that starts with tml-. No telemetry leaves this machine.
    return child_env(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")


def retool(*args: str, log_to: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    with log_to.open("a") as out:
        proc = subprocess.run([sys.executable, "-m", "retool", *args], stdout=out, stderr=subprocess.STDOUT,
                              text=True, env=env(), check=False)  # fmt: skip
    if check and proc.returncode != 0:
        raise SystemExit(f"retool {args[0]} failed ({proc.returncode}); see {log_to}")
    return proc


# -- the model ----------------------------------------------------------------------------------------


def build_model(work: Path, sft_steps: int) -> Path:
    from retool.pipeline.settings import DemoSettings  # deferred: the model command only

    made = sft_model(work / "sft")
    if made is not None:
        log(f"model: {made} (built before)")
        return made
    work.mkdir(parents=True, exist_ok=True)
    # The SFT runs' log lines, as `retool sft` writes them.
    logging.basicConfig(
        filename=work / "model.log", level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S"
    )
    # The demo's tiny model, built by the SFT stage itself, gives the tokenizer trained on the task text.
    sft_start(DemoSettings.load(["sft.steps=1"], out=str(work / "qwen2")))
    init = work / "qwen3_init"
    qwen3_twin(work / "qwen2" / "model_init", init)
    t0 = time.monotonic()
    final = sft_start(DemoSettings.load([f"sft.steps={sft_steps}"], out=str(work / "sft")), init)
    log(
        f"model: Qwen3 twin of the demo model, {sft_steps} SFT steps in {time.monotonic() - t0:.0f} s: {final}"
    )
    return final


def qwen3_twin(src: Path, out: Path) -> None:
    """The same tokenizer and sizes as ``src`` (a Qwen2 folder) in Qwen3 layers, fresh random weights."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    c = AutoConfig.from_pretrained(src)
    cfg = Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


# -- servers --------------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_retool_serve(model: Path, work: Path) -> ServeProcess:
    # The server's own LoRA alpha (a Tinker client sends only the rank): SkyRL's, as the local runs use.
    serve = ServeProcess(
        model, work / "serve", "--set", f"lora.alpha={ALPHA}", log=work / "serve.log", env=env()
    )
    return serve.start()


# -- 1. the fixed batch ---------------------------------------------------------------------------------


def config_for(model: Path, kind: str, url: str | None, run_dir: Path, *extra: str) -> list[str]:
    sets = [f"model.name={model}", f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "train.seed=0",
            f"backend.kind={kind}", "logging.tracker=none", "logging.progress=false",
            "rollout.questions_per_step=2", "rollout.group_size=4", f"train.run_dir={run_dir}",
            "backend.cpu_threads=1", *extra]  # fmt: skip
    if url:
        sets.append(f"backend.base_url={url}")
    return sets


def fixed_batch(model: Path, urls: dict[str, str | None], work: Path) -> dict[str, dict[str, float]]:
    """Loss, gradient norms and logprobs of one fixed batch on every backend (module docstring, 1)."""
    from transformers import AutoTokenizer

    from retool.backends import make_training_client
    from retool.backends.interface.types import AdamParams, Datum
    from retool.config import load_config

    tok = AutoTokenizer.from_pretrained(model)
    texts = [("What is 12 + 30?", " 12 + 30 = 42. The answer is 42."), ("What is 7 * 6?", " It is 42."),
             ("Compute 100 - 58.", " 100 - 58 = 42"), ("What is 2 + 2?", " The answer is 5, no: 4.")]  # fmt: skip
    seqs = [(tok.encode(q), tok.encode(a)) for q, a in texts]

    def datums(old: list[list[float]] | None, copies: int) -> list[Datum]:
        out = []
        n = len(seqs) * copies
        for _ in range(copies):
            for i, (q, a) in enumerate(seqs):
                full = q + a
                w = [0.0] * (len(q) - 1) + [1.0 / len(a) / n] * len(a)
                # Sampler logprobs 0.1 below the learner's: ratio 1.105, inside PPO's clip, and the loss is
                # not the cancellation an on-policy batch with centred advantages would give.
                lp = [x - 0.1 for x in old[i]] if old is not None else [0.0] * (len(full) - 1)
                adv = [0.0] * (len(q) - 1) + [(1.0, -0.5, 0.75, 1.0)[i]] * len(a)
                out.append(Datum(full[:-1], full[1:], list(lp), adv, w))
        return out

    results: dict[str, dict[str, float]] = {}
    reference: list[list[float]] | None = None
    plan = [("local", None, None), ("retool serve", urls["retool serve"], None), ("SkyRL", urls["SkyRL"], None),
            ("SkyRL, reduction forced to sum", urls["SkyRL"], "sum")]  # fmt: skip
    for name, url, forced in plan:
        kind = "local" if url is None else "tinker"
        cfg = load_config("tiny", config_for(model, kind, url, work / "fixed"))
        row: dict[str, float] = {}
        for copies in (1, 2):  # a fresh client each: every gradient is taken at the initial weights
            client = make_training_client(cfg)
            try:
                if kind == "tinker":
                    probe = client.probe_loss(datums(None, 1), "cross_entropy")  # type: ignore[attr-defined]
                    lps = probe.learner_logprobs
                    if forced is None:
                        asyncio.run(client.check_reduction_async("ppo", PPO))
                    else:
                        client.set_reduction("ppo", forced)  # type: ignore[attr-defined]
                else:
                    lps = local_logprobs(client, datums(None, 1))
                if reference is None:
                    reference = lps
                row["max |dlogprob| vs local"] = max(
                    abs(a - b) for x, y in zip(lps, reference, strict=True) for a, b in zip(x, y, strict=True)
                )
                res = client.forward_backward(datums(reference, copies), "ppo", PPO)
                step = client.optim_step(AdamParams(lr=0.0, weight_decay=0.0, grad_clip_norm=0.0))
                row[f"loss x{copies}"] = res.loss
                row[f"grad_norm x{copies}"] = step.grad_norm
            finally:
                asyncio.run(client.close_async())
        row["grad_norm x2 / x1"] = row["grad_norm x2"] / row["grad_norm x1"]
        results[name] = row
        log(f"fixed batch, {name}: " + ", ".join(f"{k} {v:.6g}" for k, v in row.items()))
    return results


def local_logprobs(client: Any, datums: list[Any]) -> list[list[float]]:
    """The local backend's learner logprobs of ``datums`` (its sampler's scoring path)."""
    import torch

    model = client.sampling_model()
    out = []
    with torch.no_grad():
        for d in datums:
            ids = torch.tensor([d.input_tokens])
            logits = model(ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(d.target_tokens)[:, None])[:, 0]
            out.append([float(x) for x in lp])
    return out


# -- 2. retool train / eval -------------------------------------------------------------------------------


def metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def train(
    model: Path, name: str, kind: str, url: str | None, work: Path, *, kill_after: int = 0
) -> dict[str, Any]:
    run = work / "train" / name.replace(" ", "_")
    sets = config_for(model, kind, url, run, f"train.steps={STEPS}", "checkpoint.every=1")
    args = ["train", "-c", "tiny", "--run-dir", str(run)] + [x for s in sets for x in ("--set", s)]
    logf = work / f"train_{run.name}.log"
    t0 = time.monotonic()
    info: dict[str, Any] = {}
    if not kill_after:
        retool(*args, log_to=logf)
    else:
        with logf.open("a") as out:
            proc = subprocess.Popen([sys.executable, "-m", "retool", *args], stdout=out, stderr=subprocess.STDOUT,
                                    text=True, env=env())  # fmt: skip
        while proc.poll() is None and not any(r["step"] >= kill_after for r in metrics(run)):
            time.sleep(0.5)
        done = max((r["step"] for r in metrics(run)), default=0)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log(f"{name}: SIGKILL after step {done} ({time.monotonic() - t0:.0f} s)")
        retool("train", "--resume", str(run), log_to=logf)
        info["resume"] = f"killed after step {done}, resumed to {max(r['step'] for r in metrics(run))}"
    rows = metrics(run)
    info["wall_s"] = time.monotonic() - t0
    info["rows"] = rows
    info["run"] = run
    log(f"{name}: {len(rows)} steps in {info['wall_s']:.0f} s")
    return info


def evaluate(model: Path, url: str, run: Path, work: Path) -> tuple[bool, str]:
    """``retool eval`` (retool mode, a few problems) on the run's last checkpoint, through SkyRL."""
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    if not ckpts:
        return False, "no checkpoint to evaluate"
    out = work / "eval" / "skyrl.jsonl"
    sets = config_for(model, "tinker", url, work / "eval")
    proc = retool("eval", "--config", "tiny", "--mode", "retool", "--checkpoint", str(ckpts[-1]), "--dataset",
                  "synthetic", "--limit", "4", "--val-n", "2", "-o", str(out), *[x for s in sets for x in ("--set", s)],
                  log_to=work / "eval.log", check=False)  # fmt: skip
    summary_file = out.with_suffix(".summary.json")
    if proc.returncode != 0 or not summary_file.is_file():
        return False, f"retool eval failed ({proc.returncode}); see {work / 'eval.log'}"
    summary = json.loads(summary_file.read_text())
    m = summary.get("metrics", {})
    keys = [k for k in m if isinstance(m[k], int | float)][:6]
    shown = ", ".join(f"{k} {m[k]:.3g}" for k in keys)
    return summary.get("status") == "complete", (
        f"{ckpts[-1].name}: {summary.get('status')}, {summary.get('completed')}/{summary.get('total')} "
        f"problems; {shown}"
    )


def jax_compiles(log_file: Path) -> tuple[int, float]:
    """How many JIT compilations SkyRL's log reports, and their seconds (its console wraps lines)."""
    import re

    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    times = [float(t) for t in re.findall(r"JIT compilation for \w+ seq_len=\d+\s+took ([\d.]+)s", text)]
    return len(times), sum(times)


def rate(rows: list[dict[str, Any]], tokens: str, seconds: str) -> float:
    t = sum(float(r.get(seconds, 0.0)) for r in rows)
    return sum(float(r.get(tokens, 0.0)) for r in rows) / t if t > 0 else math.nan


# -- the table --------------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def table(title: str, cols: list[str], rows: list[tuple[str, list[Any]]]) -> str:
    width = [max(len(c), 12) for c in cols]
    head = max(len(r[0]) for r in rows)
    lines = [title, " " * head + " | " + " | ".join(c.rjust(w) for c, w in zip(cols, width, strict=True))]
    lines.append("-" * len(lines[-1]))
    for label, values in rows:
        lines.append(
            label.ljust(head)
            + " | "
            + " | ".join(fmt(v).rjust(w) for v, w in zip(values, width, strict=True))
        )
    return "\n".join(lines)


def run(work: Path, skyrl_url: str, model: Path, server_pid: int | None) -> int:
    t_start = time.monotonic()
    os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")  # the in-process clients' SDK too
    for old in ("train", "eval", "serve", "fixed"):  # a rerun starts its runs afresh (the model is kept)
        shutil.rmtree(work / old, ignore_errors=True)
    log(machine())
    wait_healthy(skyrl_url, 300, lambda: server_pid is None or alive(server_pid))
    serve = start_retool_serve(model, work)
    serve_url = serve.url
    failures: list[str] = []
    try:
        urls = {"retool serve": serve_url, "SkyRL": skyrl_url}
        fixed = fixed_batch(model, urls, work)
        runs = {
            "local": train(model, "local", "local", None, work),
            "retool serve": train(model, "retool serve", "tinker", serve_url, work),
            "SkyRL": train(model, "SkyRL", "tinker", skyrl_url, work, kill_after=KILL_AFTER),
        }
        eval_ok, eval_line = evaluate(model, skyrl_url, runs["SkyRL"]["run"], work)
        if not eval_ok:
            failures.append(f"retool eval on SkyRL: {eval_line}")
    finally:
        serve.stop()

    names = ["local", "retool serve", "SkyRL"]
    f_cols = [*names, "SkyRL, reduction forced to sum"]
    print()
    print(machine())
    print(table(
        "Fixed batch (4 datums, ppo at ratio 1.105, loop weights 1/n_tokens/n_datums; optim_step at lr 0 on a fresh client)",
        f_cols,
        [(k, [fixed[n][k] for n in f_cols]) for k in
         ("loss x1", "grad_norm x1", "loss x2", "grad_norm x2", "grad_norm x2 / x1", "max |dlogprob| vs local")],
    ))  # fmt: skip
    first = {n: runs[n]["rows"][0] for n in names}
    print()
    print(table(
        f"retool train, {STEPS} steps (tiny preset, seed 0, 2 questions x 4 samples, LoRA rank {RANK} alpha {ALPHA})",
        names,
        [
            ("step-1 reward mean", [first[n].get("task/reward_mean") for n in names]),
            ("step-1 loss", [first[n].get("policy/loss") for n in names]),
            ("step-1 grad norm", [first[n].get("policy/grad_norm") for n in names]),
            ("step-1 trained tokens", [first[n].get("tokens/trained") for n in names]),
            ("train tokens/s (all steps)", [rate(runs[n]["rows"], "tokens/trained", "time/train") for n in names]),
            ("sampled tokens/s (all steps)", [rate(runs[n]["rows"], "tokens/completion", "time/sample") for n in names]),
            ("wall s (whole run)", [runs[n]["wall_s"] for n in names]),
            ("steps recorded", [len(runs[n]["rows"]) for n in names]),
            ("JAX compiles in all (count / s)", ["-", "-", "{} / {:.0f}".format(*jax_compiles(work / "skyrl.log"))]),
            ("SIGKILL + resume", ["-", "-", runs["SkyRL"].get("resume", "-")]),
        ],
    ))  # fmt: skip
    print(f"\nretool eval on SkyRL (retool mode, 4 problems x 2): {eval_line}")

    # The checks (tolerances in the module constants).
    ref = fixed["local"]
    for name in ("retool serve", "SkyRL"):
        if abs(fixed[name]["loss x1"] / ref["loss x1"] - 1) > LOSS_RTOL:
            failures.append(
                f"{name}: fixed-batch loss {fixed[name]['loss x1']:.6g} vs local {ref['loss x1']:.6g}"
            )
    for name in ("local", "retool serve", "SkyRL"):
        if abs(fixed[name]["grad_norm x2 / x1"] - 1) > RATIO_RTOL:
            failures.append(
                f"{name}: the duplicated batch changed the gradient norm by {fixed[name]['grad_norm x2 / x1']:.6g}"
            )
    if abs(fixed["retool serve"]["grad_norm x1"] / ref["grad_norm x1"] - 1) > LOSS_RTOL:
        failures.append("retool serve: fixed-batch gradient norm differs from the local backend's")
    for name in names:
        if len(runs[name]["rows"]) != STEPS:
            failures.append(f"{name}: {len(runs[name]['rows'])} steps recorded, expected {STEPS}")
    print(f"\ntolerances: fixed-batch loss rel {LOSS_RTOL:g} (vs local), grad_norm x2/x1 = 1 within {RATIO_RTOL:g}; "
          "SkyRL's gradient norm is not compared with the local one: its LoRA A starts from its own random "
          "init (JAX he_uniform vs PEFT's kaiming_uniform), only B = 0 is shared")  # fmt: skip
    print(f"interop run: {time.monotonic() - t_start:.0f} s")
    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else "FAILED")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("work", type=Path)
    m.add_argument("--sft-steps", type=int, default=300)
    r = sub.add_parser("run")
    r.add_argument("work", type=Path)
    r.add_argument("--skyrl", required=True)
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--server-pid", type=int, default=None)
    r.add_argument("--write", action="store_true", help="also write docs/results/interop_skyrl.md")
    args = parser.parse_args()
    if args.cmd == "model":
        print(build_model(args.work, args.sft_steps))
        return 0
    with recording(args.write) as rec:
        status = run(args.work, args.skyrl, args.model, args.server_pid)
    if args.write:
        write_printed("interop_skyrl.md", "SkyRL's Tinker API server: `bench/interop_skyrl.sh`", rec)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
