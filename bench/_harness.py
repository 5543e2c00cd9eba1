"""What the benches and the serve tests share, written once.

- ``ServeProcess``: ``retool serve`` as a child process on 127.0.0.1 (a free port): started, its URL read
  from its announcement, waited for until it answers, stopped (``wait_healthy`` polls any server);
- ``demo_command`` / ``timed_demo``: ``retool demo`` run in a child process and timed from start to exit;
  ``seed_demo_command`` / ``run_seed_demo(s)``: each seed's real-model demo of a two-stage bench
  (gsm8k.py, mathematics.py), without evaluations of its own, resumed where it stopped;
- ``sft_start``: a cold-start SFT model (the SFT stage alone, no evaluation), made once and reused;
- the held-out evaluation those two-stage benches run on every model they compare (``plan``,
  ``evaluate_plan``; ``evaluate_in_process``: a process per model; ``eval_config``, ``evaluate_model``:
  inside it; ``EvalClock``: its time, kept while it runs; ``timing_gaps``: what that time may leave out),
  and the files that let a rerun skip a finished model (``results_path``, ``keep_results``);
- the cells their tables print: ``pct``, ``pts``, ``ci_cell``, ``gain_cell``.

Imported as ``_harness`` with bench/ on ``sys.path`` (a bench run as a script has it; tests insert it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retool.config import Config
    from retool.data.problem import Problem
    from retool.evaluate.store import ProblemRecord
    from retool.pipeline.settings import DemoSettings

REPO = Path(__file__).resolve().parents[1]
MODES = ("text-only", "retool")  # the two evaluation modes a two-stage bench compares
# Every demo of a two-stage bench: no evaluation of its own (the bench evaluates each model instead).
DEMO_FIELDS = ("pipeline.eval_modes=[]", "pipeline.base_eval_problems=0")


def child_env(**extra: str) -> dict[str, str]:
    """This environment with this checkout's ``src`` as ``PYTHONPATH`` (a child runs the retool beside
    the bench, not another install), and ``extra``."""
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), **extra}


# -- retool serve -------------------------------------------------------------------------------------


def wait_healthy(url: str, timeout: float, running: Callable[[], bool] = lambda: True) -> None:
    """Until ``url`` answers ``/api/v1/healthz``; raises once ``running()`` turns false or after
    ``timeout`` seconds."""
    import httpx  # deferred: only the benches that talk to a server need it

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not running():
            raise RuntimeError(f"the server at {url} exited; see its log")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no answer from {url}/api/v1/healthz within {timeout:.0f} s")


class ServeProcess:
    """``python -m retool serve`` on a free port of 127.0.0.1; ``url`` once it answers ``/api/v1/healthz``.

    ``model`` is what ``--model`` takes (a folder, or ``name=folder``), ``extra`` more arguments. The
    server's stderr is appended to ``log`` (default ``<root>-serve.log`` beside ``root``: a restart on the
    same root keeps the first run's lines); ``env`` defaults to ``child_env()``.
    """

    def __init__(
        self,
        model: str | Path,
        root: Path,
        *extra: str,
        device: str = "cpu",
        threads: int = 1,
        api_key: str | None = None,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model, self.root, self.extra, self.api_key = model, root, extra, api_key
        self.device, self.threads = device, threads
        self.log = log or root.parent / f"{root.name}-serve.log"
        self.env = dict(env) if env is not None else child_env()
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "retool", "serve", "--port", "0", "--model", str(self.model)]
        cmd += ["--root", str(self.root), "--set", f"backend.device={self.device}"]
        cmd += ["--set", f"backend.cpu_threads={self.threads}", *self.extra]
        return cmd + (["--api-key", self.api_key] if self.api_key else [])

    def start(self, timeout: float = 120.0) -> ServeProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:  # the child holds its own descriptor
            proc = subprocess.Popen(
                self.command(), stdout=subprocess.PIPE, stderr=log, text=True, env=self.env
            )
        self.proc = proc
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:  # the announcement lines come before serving starts
            if line.startswith("PYTRIO_BASE_URL="):  # TINKER_BASE_URL, the next line, is the same URL
                self.url = line.strip().split("=", 1)[1]
                break
            if time.monotonic() > deadline:
                break
        try:
            if not self.url:
                raise RuntimeError(f"retool serve did not start; see {self.log}")
            wait_healthy(self.url, max(deadline - time.monotonic(), 1.0), lambda: proc.poll() is None)
        except RuntimeError:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs (a crash, as far as the server can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- retool demo --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoRun:
    returncode: int
    wall_s: float  # start to exit, start-up included


def demo_command(*args: str) -> list[str]:
    """``python -m retool demo ARGS`` (the command a user types, in this Python)."""
    return [sys.executable, "-m", "retool", "demo", *args]


def timed_demo(
    cmd: Sequence[str], env: Mapping[str, str] | None = None, log: Path | None = None, check: bool = False
) -> DemoRun:
    """``cmd`` (a ``demo_command``) in a child process: ``env`` its environment (default this one),
    its output into ``log`` or, without one, straight to the terminal; ``check``: a failure raises
    ``CalledProcessError``."""
    started = time.perf_counter()
    if log is None:
        proc = subprocess.run(list(cmd), env=env, check=check)
    else:
        with log.open("w") as out:
            proc = subprocess.run(list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, check=check)
    return DemoRun(proc.returncode, time.perf_counter() - started)


def seed_demo_command(
    task: str,
    seed: int,
    out: Path,
    sets: Sequence[str],
    data_dir: str | None = None,
    reuse_sft: Path | None = None,
) -> list[str]:
    """The seed's ``task`` demo of SmolLM2 with ``DEMO_FIELDS`` (no evaluation of its own), then ``sets``;
    RL from ``reuse_sft``'s SFT model when given; resumed when ``out`` holds an unfinished run."""
    recipe = "smollm2" if task == "synthetic" else task  # the SmolLM2 recipe of each task
    args = ["--recipe", recipe, "--seed", str(seed), "--out", str(out), "--no-plots"]
    args += [x for s in (*DEMO_FIELDS, *sets) for x in ("--set", s)]
    if reuse_sft is not None:
        args += ["--reuse-sft", str(reuse_sft)]
    if data_dir:
        args += ["--data-dir", data_dir]
    if (out / "settings.json").is_file():
        args.append("--resume")
    return demo_command(*args)


def run_seed_demo(
    task: str,
    seed: int,
    out: Path,
    sets: Sequence[str],
    data_dir: str | None,
    log: logging.Logger,
    reuse_sft: Path | None = None,
) -> dict[str, Any]:
    """The seed's demo (``seed_demo_command``) in a process of its own, unless it finished; its report."""
    report = out / "report.json"
    if not report.is_file():
        cmd = seed_demo_command(task, seed, out, sets, data_dir, reuse_sft)
        log.info("demo seed %d: %s", seed, " ".join(cmd))
        timed_demo(cmd, check=True)
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def run_seed_demos(
    task: str, seeds: list[int], out: Path, sets: Sequence[str], data_dir: str | None, log: logging.Logger
) -> dict[int, dict[str, Any]]:
    """Every seed's demo into ``out/seed<N>`` (``run_seed_demo``), their reports by seed: the first seed's
    run does the cold start and SFT, every other seed's RL starts from that SFT model (the seeds differ in
    RL alone)."""
    first = out / f"seed{seeds[0]}"
    reports = {seeds[0]: run_seed_demo(task, seeds[0], first, sets, data_dir, log)}
    for s in seeds[1:]:
        reports[s] = run_seed_demo(task, s, out / f"seed{s}", sets, data_dir, log, first)
    return reports


# -- the SFT start ------------------------------------------------------------------------------------


def sft_model(out: Path) -> Path | None:
    """The SFT model a finished SFT run left in ``out`` (``model_sft``), or None."""
    sft = out / "model_sft"
    return sft if (sft / "config.json").is_file() else None


def sft_start(settings: DemoSettings, model: Path | None = None) -> Path:
    """``<settings.out>/model_sft``: the cold-start SFT of ``model`` (None: the demo's tiny model, built for
    the tasks into ``<out>/model_init``) with ``settings``, no evaluation; made once, then reused."""
    from retool.pipeline.cli import Printer  # deferred: torch and the pipeline, for the benches that make one
    from retool.recipes.demo import run_sft

    out = Path(settings.out)
    if sft_model(out) is None:  # its phases and SFT steps shown as the demo shows them: minutes, not silence
        run_sft(settings, model, on_event=Printer(), evaluate=False)
    return out / "model_sft"


# -- the held-out evaluation of a two-stage bench's models ---------------------------------------------


def plan(seeds: list[int], out: Path) -> list[tuple[str, Path]]:
    """The models the claims compare, each once, with the demo folder it comes from: the base model, the
    SFT model (the first seed's run, shared by every seed's RL), the RL model of each seed."""
    first = out / f"seed{seeds[0]}"
    return [("base", first), ("sft", first)] + [(f"rl-s{s}", out / f"seed{s}") for s in seeds]


def eval_output(folder: Path, model: str, mode: str) -> Path:
    return folder / f"{model}_{mode}.jsonl"


def results_path(folder: Path, label: str) -> Path:
    return folder / f"{label}.results.json"


def finished(output: Path) -> bool:
    """Whether the evaluation writing ``output`` completed (its summary says so)."""
    from retool.evaluate.store import summary_path_for  # deferred: the evaluation benches only

    summary = json.loads(summary_path_for(output).read_text())
    return bool(summary.get("status") == "complete")


def record_stats(records: list[ProblemRecord]) -> dict[str, float]:
    """Accuracy, format rate, tool-call rate, calls and completion tokens per candidate of ``records``."""
    cands = [c for r in records for c in r["candidates"]]
    n = len(cands) or 1
    return {
        "problems": float(len(records)),
        "accuracy": sum(bool(c["correct"]) for c in cands) / n,
        "format": sum(bool(c["valid_format"]) for c in cands) / n,
        "call_rate": sum(int(c["code_calls"]) > 0 for c in cands) / n,
        "calls": sum(int(c["code_calls"]) for c in cands) / n,
        "tokens": sum(int(c.get("completion_tokens", 0)) for c in cands) / n,
    }


def keep_results(folder: Path, label: str, by_mode: dict[str, list[ProblemRecord]]) -> None:
    """A model's results, kept once every mode finished: its stats per mode (a rerun skips the model)."""
    results = {"model": label, "modes": {mode: record_stats(recs) for mode, recs in by_mode.items()}}
    results_path(folder, label).write_text(json.dumps(results, indent=2) + "\n")


def evaluate_in_process(
    script: str, model: str, outputs: dict[str, Path], demo_dir: Path, extra: Sequence[str]
) -> None:
    """A model's evaluations (one per mode, all at once on one engine: wider batches) in a process of its
    own, ``script --eval-one ... EXTRA``; nothing for a mode that finished earlier."""
    from retool.evaluate.store import summary_path_for  # deferred: the evaluation benches only

    if results_path(next(iter(outputs.values())).parent, model).is_file():
        return  # kept: every mode finished earlier
    todo = [m for m, out in outputs.items() if not (summary_path_for(out).is_file() and finished(out))]
    if not todo:
        return
    folder = outputs[todo[0]].parent
    cmd = [sys.executable, script, "--eval-one", model, ",".join(todo), str(folder), str(demo_dir), *extra]
    subprocess.run(cmd, check=True)


def evaluate_plan(
    seeds: list[int],
    out: Path,
    folder: Path,
    evaluate: Callable[[str, dict[str, Path], Path], None],
    read: Callable[[Path], list[ProblemRecord]],
    log: logging.Logger,
) -> dict[str, dict[str, list[ProblemRecord]]]:
    """Every model of ``plan(seeds, out)`` evaluated in every mode into ``folder`` (``evaluate(label,
    outputs, demo_dir)``: a bench's ``evaluate_in_process`` call), then its records read back with
    ``read``, by model and mode; a model's results are kept once all its modes are read."""
    evals: dict[str, dict[str, list[ProblemRecord]]] = {}
    for label, demo_dir in plan(seeds, out):
        outputs = {mode: eval_output(folder, label, mode) for mode in MODES}
        log.info("evaluating %s (%s) -> %s", label, ", ".join(MODES), folder)
        evaluate(label, outputs, demo_dir)
        evals[label] = {mode: read(output) for mode, output in outputs.items()}
        if not results_path(folder, label).is_file():
            keep_results(folder, label, evals[label])
    return evals


def model_path(label: str, demo_dir: Path) -> Path:
    """The weights ``label`` names: ``base`` the packaged SmolLM2, else the demo's ``model_sft`` /
    ``model_rl``."""
    from retool.pipeline.real_model import resolve_model_path  # deferred: the evaluation process only

    return resolve_model_path("smollm2") if label == "base" else demo_dir / f"model_{label.split('-')[0]}"


def saved_run(demo_dir: Path) -> tuple[dict[str, Any], Config]:
    """A demo's ``settings.json`` (in today's shape, whichever version wrote it: the recipe's options under
    ``options``) and the config it ran with."""
    from retool.config import Config  # deferred: the evaluation process only
    from retool.recipes.demo import run_settings  # deferred: the evaluation process only

    saved: dict[str, Any] = run_settings(demo_dir)
    return saved, Config.model_validate(saved["config"])


def eval_config(config: Config, path: Path, folder: Path, modes: int) -> Config:
    """A demo's ``config`` for evaluating the weights at ``path`` (no adapter) in ``modes`` modes at once
    (one engine: ``modes`` times the rows per decode step), each turn ending at its first closed
    ``\\boxed{...}`` (nothing after the answer is read); scratch state under ``folder``."""
    from retool.pipeline.run import phase_config, with_available_isolation  # deferred: evaluation only

    config = phase_config(with_available_isolation(config), path, folder / "scratch")
    backend = config.backend.model_copy(update={"sample_batch_size": 64 * modes})
    sampling = config.sampling.model_copy(update={"stop_at_boxed": True})
    lora = config.lora.model_copy(update={"enabled": False})
    return config.model_copy(update={"lora": lora, "backend": backend, "sampling": sampling})


def evaluate_model(
    label: str,
    modes: list[str],
    folder: Path,
    config: Config,
    problems: list[Problem],
    dataset: str,
    threads: int = 0,
    source: Any = None,
) -> None:
    """``--eval-one``'s work: ``problems`` in each of ``modes`` concurrently on one engine, written to
    ``eval_output(folder, label, mode)``; time and peak memory kept in ``<folder>/<label>.run.json`` by an
    ``EvalClock`` (a resumed evaluation adds its time to the first's). ``threads``: torch threads (0: every
    core)."""
    import torch  # deferred: the evaluation process only

    from retool.components import build_components
    from retool.evaluate.runner import EvalIdentity, run_eval
    from retool.pipeline.cli import Printer

    if threads:
        torch.set_num_threads(threads)
    folder.mkdir(parents=True, exist_ok=True)
    identity = EvalIdentity(model=label, checkpoint=config.model.name, dataset=dataset)

    # The modes together keep one engine batch of problems in flight, not the whole set: with more in
    # flight than the engine batches, a multi-turn trajectory's next turn queues behind the others' and its
    # context falls out of the prefix cache, so each turn prefills it again and batches are rebuilt around
    # it (no retool answer was written until nearly all first turns had been sampled).
    in_flight = max(1, min(len(problems), config.backend.sample_batch_size // len(modes)))
    printer = Printer()  # one bar for the modes side by side, as the demo shows an evaluation

    def progress(mode: str) -> Any:
        return lambda done, total: printer(
            "eval_progress", {"model": label, "mode": mode, "done": done, "total": total}
        )

    async def run(parts: Any) -> None:
        await parts.refresh_sampler()
        await asyncio.gather(
            *[
                run_eval(
                    problems,
                    parts.for_mode(mode == "retool"),
                    config=config,
                    mode=mode,
                    output=eval_output(folder, label, mode),
                    identity=identity,
                    concurrency=in_flight,
                    save_transcripts=False,
                    source=source,
                    on_progress=progress(mode),
                )
                for mode in modes
            ]
        )

    outputs = [eval_output(folder, label, mode) for mode in modes]
    with EvalClock(folder / f"{label}.run.json", outputs), build_components(config) as parts:
        asyncio.run(run(parts))  # outside the event loop: build_components starts its own


def answers_written(outputs: Sequence[Path]) -> int:
    """The records (one a problem) in the evaluation outputs that exist."""
    return sum(p.read_bytes().count(b"\n") for p in outputs if p.is_file())


class EvalClock:
    """A model's evaluation time and peak memory in its ``<label>.run.json``, rewritten every ``every``
    seconds while the evaluation runs and once at its end, so a pass that is killed (a stopped bench, a
    session's end) still counts up to its last write; a resumed evaluation adds its passes to the first's.

    ``timed_answers``: the records written to ``outputs`` while a clock ran. Fewer than the outputs hold
    means some were written by a pass nobody timed (the harness kept no time of an interrupted pass before
    this clock), so the seconds under-state the evaluation; a file without the field cannot tell.
    """

    def __init__(self, facts_file: Path, outputs: Sequence[Path], every: float = 30.0) -> None:
        self.facts_file = facts_file
        self.outputs = list(outputs)
        self.every = every
        self._before: dict[str, Any] = {}
        self._answers_at_start = 0
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EvalClock:
        if self.facts_file.is_file():  # a resumed evaluation
            self._before = json.loads(self.facts_file.read_text())
        self._answers_at_start = answers_written(self.outputs)
        self._t0 = time.perf_counter()
        self.write()
        self._thread = threading.Thread(target=self._tick, name="eval-clock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.write()

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self.write()

    def facts(self) -> dict[str, Any]:
        before = self._before
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        facts: dict[str, Any] = {
            "seconds": round(before.get("seconds", 0.0) + time.perf_counter() - self._t0, 1),
            "peak_rss_gib": round(max(peak, before.get("peak_rss_gib", 0.0)), 2),
        }
        if not before or "timed_answers" in before:  # else an untimed past: the count would be wrong
            timed = answers_written(self.outputs) - self._answers_at_start
            facts["timed_answers"] = before.get("timed_answers", 0) + timed
        return facts

    def write(self) -> None:
        """Replace the file whole (a reader, or a kill mid-write, never sees half of it)."""
        tmp = self.facts_file.with_name(self.facts_file.name + ".tmp")
        tmp.write_text(json.dumps(self.facts()) + "\n")
        os.replace(tmp, self.facts_file)


def timing_gaps(
    runs: dict[str, dict[str, float]], evals: dict[str, dict[str, list[ProblemRecord]]]
) -> list[str]:
    """What the kept evaluation time may leave out (``EvalClock``), one phrase per case. A file without
    ``timed_answers`` predates the clock: the harness then timed only a pass that ran to its end, so an
    interrupted pass before it is not counted (whether there was one, the file cannot tell). A file with
    fewer timed answers than the outputs hold had such a pass."""
    untimed = [label for label, facts in sorted(runs.items()) if "timed_answers" not in facts]
    gaps = []
    if untimed:
        gaps.append(
            f"{name_list(untimed)} kept only the time of the pass that finished {'it' if len(untimed) == 1 else 'each'};"
            " an interrupted pass before it is not counted"
        )
    for label, facts in sorted(runs.items()):
        held = sum(len(records) for records in evals.get(label, {}).values())
        if "timed_answers" in facts and facts["timed_answers"] < held:
            gaps.append(f"{label}: {int(facts['timed_answers']):,} of its {held:,} answers timed")
    return gaps


def name_list(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def eval_runs(folder: Path) -> dict[str, dict[str, float]]:
    """Each evaluated model's ``<label>.run.json`` in ``folder`` (``EvalClock``: seconds, peak RSS, and
    ``timed_answers`` where its clock kept them)."""
    return {
        p.name.removesuffix(".run.json"): json.loads(p.read_text()) for p in sorted(folder.glob("*.run.json"))
    }


def demo_table(demos: Mapping[int, Mapping[str, Any]]) -> str:
    """Each seed's demo: wall time, peak memory, its phases (SFT, or the run it reused it from; RL; its own
    held-out evaluations, when it ran any) and the cold start's yield."""
    lines = [
        "Each seed's demo (a process of its own): wall time, peak memory, its phases:",
        "",
        "| seed | total | peak RSS | SFT | RL | its own evaluations | cold start kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed, rep in demos.items():
        t = rep["timings"]
        conv = rep.get("sft", {}).get("conversion", {})
        reused = rep.get("settings", {}).get("reuse_sft")
        sft = f"reused ({Path(reused).name})" if reused else f"{t.get('sft', 0) / 60:.1f} min"
        evals = sum(float(v) for k, v in t.items() if k.startswith("eval_"))
        of = conv.get("read", conv.get("sampled", "-"))
        lines.append(
            f"| {seed} | {t['total'] / 60:.1f} min | {rep['machine'].get('peak_rss_gib', 0):.1f} GiB | {sft} | "
            f"{t.get('rl', 0) / 60:.1f} min | {evals / 60:.1f} min | {conv.get('kept', '-')} of {of} |"
        )
    return "\n".join(lines)


# -- table cells --------------------------------------------------------------------------------------


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def pts(x: float) -> str:
    """A difference of two rates in percentage points, signed."""
    return f"{100 * x:+.1f}"


def ci_cell(gain: float, lo: float, hi: float) -> str:
    """A gain with its 95% interval, in percentage points: ``+1.2 [-0.4, +2.8]``."""
    return f"{pts(gain)} [{pts(lo)}, {pts(hi)}]"


def gain_cell(before: list[ProblemRecord], after: list[ProblemRecord]) -> str:
    """``after`` minus ``before`` (the same problems), with its paired bootstrap 95% interval."""
    from retool.evaluate.metrics import paired_gain  # deferred: numpy, for the benches that compare runs

    g = paired_gain(before, after, seed=0)
    lo, hi = g["ci95"]
    return ci_cell(g["gain"], lo, hi)


def revision(src: Path) -> str:
    """The short commit of the checkout ``src`` lies in (with ``+`` when it has uncommitted changes)."""
    git = ["git", "-C", str(src)]
    try:
        rev = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: an exported tree, named so
        return src.parent.name if src.name == "src" else src.name
    return rev.stdout.strip() + ("+" if dirty.stdout.strip() else "")
