"""Worker death during a tiny training run: the real ``Trainer``, the tiny local model, a real fork-server
sandbox and a real verifier pool; one worker is SIGKILLed mid-run.

Each kill must end at most the trajectories in flight (counted in the step's ``faults/*`` metrics), the
worker must be respawned, and the run must finish every step. Faults are injected by the test harness
only: thin wrappers around the real executor / verifier that SIGKILL the real worker process at a chosen
call, and for the local sampler (which has no process pool: generation runs on the training client's one
worker thread) a failing generation batch on that thread.

To make the tiny, untrained model exercise the sandbox and the verifier, tests A and B sample from a
scripted sampler (every branch calls the tool once, then boxes an answer) over the tiny model's own
tokenizer and chat template; training (``forward_backward`` / ``optim_step`` / checkpoints) is the real
local backend's. Rewards come from the parity of the sampled tokens (``train_harness.ParityScoredSource``) so
that groups are mixed and real optimizer steps happen.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from retool.backends import make_training_client
from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import Sample, SamplingParams
from retool.components import Components
from retool.config import Config, load_config
from retool.env import source_from_config
from retool.protocol import ChatProtocol
from retool.reward import Verifier
from retool.sandbox import ExecResult, ForkServerExecutor
from retool.train.checkpoint import CheckpointManager, CheckpointWriteError
from retool.train.loop import Trainer
from retool.train.metrics import MetricsLog
from sandbox_helpers import server_pids
from train_harness import ParityScoredSource

STEPS = 3
GROUP = 4
# The slow call says which fork-server runs it (its parent) before it sleeps, so the test kills that one
# and no other (a server busy with a fast call at the same moment would otherwise look alike).
SLOW_MARK = Path(tempfile.gettempdir()) / f"retool-test-slow-call-{os.getpid()}"
SLOW_CODE = (
    f"import os, time\nopen({str(SLOW_MARK) + '.tmp'!r}, 'w').write(str(os.getppid()))\n"
    f"os.rename({str(SLOW_MARK) + '.tmp'!r}, {str(SLOW_MARK)!r})\ntime.sleep(60)\nprint('never')"
)


def tiny_config(model_dir: Path, **extra: Any) -> Config:
    sets = {
        "model.name": str(model_dir),
        "data.source": "synthetic",
        "data.options.count": 40,
        "train.steps": STEPS,
        "checkpoint.every": 1,
        "checkpoint.keep_last": 3,
        "rollout.questions_per_step": 2,
        "rollout.group_size": GROUP,
        "rollout.max_tokens_per_turn": 24,
        "rollout.max_assistant_turns": 3,
        "rollout.max_trajectory_tokens": 1400,
        "model.max_context": 2048,
        "backend.micro_batch_tokens": 2048,
        "backend.sample_batch_size": GROUP,  # one group request per generation batch
        "backend.cpu_threads": 1,
        "logging.tracker": "none",
        "logging.progress": False,
        **extra,
    }
    return load_config(
        None, [f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower()}" for k, v in sets.items()]
    )


class ToolScriptSampler(SamplingClient):
    """First turn: every branch calls the tool (``code_for(step, question, branch)``); later turns: a boxed
    answer. Branches run different code, so their tokens (and parity rewards) differ."""

    def __init__(self, protocol: ChatProtocol, code_for: Any) -> None:
        self.protocol = protocol
        self.code_for = code_for
        self.end = int(next(iter(protocol.stop_token_ids)))
        self.group_requests = 0

    def _sample(self, text: str) -> Sample:
        ids = [*self.protocol.tokenizer.encode(text, add_special_tokens=False), self.end]
        return Sample(ids, [-0.05] * len(ids), "stop")

    async def sample_async(
        self, prompt_tokens: Any, num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        await asyncio.sleep(0)
        if num_samples > 1:
            self.group_requests += 1
            # Two questions per step, asked in order (the rollout starts them in order, before awaiting).
            step, question = (self.group_requests + 1) // 2, (self.group_requests + 1) % 2
            return [
                self._sample(self.protocol.fmt.render_call(self.code_for(step, question, b)))
                for b in range(num_samples)
            ]
        return [self._sample("The answer is \\boxed{4}.")]


class ScriptedClient:
    """The real local training client, sampling from a ``ToolScriptSampler`` instead of the tiny model."""

    def __init__(self, inner: Any, sampler: ToolScriptSampler) -> None:
        self._inner = inner
        self._sampler = sampler

    async def sampling_client_async(self) -> ToolScriptSampler:
        return self._sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def _until(condition: Any, what: str, limit: float = 60.0) -> None:
    """Poll ``condition()``; the limit only keeps a broken test from hanging."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


class ServerKiller:
    """The real executor; when ``trigger`` code runs, SIGKILL the fork-server running it, mid-call."""

    def __init__(self, inner: ForkServerExecutor, trigger: str) -> None:
        self.inner = inner
        self.trigger = trigger
        self.killed: list[int] = []

    async def arun(self, code: str) -> ExecResult:
        if code != self.trigger or self.killed:
            return await self.inner.arun(code)
        SLOW_MARK.unlink(missing_ok=True)
        task = asyncio.ensure_future(self.inner.arun(code))
        await _until(SLOW_MARK.is_file, "the slow call to start")
        server = int(SLOW_MARK.read_text())
        SLOW_MARK.unlink()
        assert server in server_pids(self.inner)
        os.kill(server, signal.SIGKILL)
        self.killed.append(server)
        return await task

    def __getattr__(self, name: str) -> Any:  # format_tool_content, stats, timeout
        return getattr(self.inner, name)


class VerifierKiller:
    """The real verifier; at check number ``at``, SIGKILL its worker just as the check is sent."""

    def __init__(self, inner: Verifier, at: int) -> None:
        self.inner = inner
        self.at = at
        self.checks = 0
        self.killed: list[int] = []

    async def ascore(self, text: str, ref: str) -> Any:
        self.checks += 1
        if self.checks == self.at:
            (pid,) = self.inner.worker_pids()
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)
            await _until(lambda: _gone(pid), "the verifier worker to die")
        return await self.inner.ascore(text, ref)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _trainer(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    *,
    client: Any,
    executor: Any,
    verifier: Any,
    protocol: Any = None,
) -> Trainer:
    """The real trainer on the tiny tasks, scored by parity, with these (real or wrapped) parts."""
    protocol = protocol or ChatProtocol.from_config(client.tokenizer, cfg)
    return Trainer(
        cfg,
        run_dir,
        resume=resume,
        source=ParityScoredSource(source_from_config(cfg)),
        components=Components(backend=client, protocol=protocol, verifier=verifier, executor=executor),
    )


def _run(cfg: Config, run_dir: Path, resume: bool = False, **parts: Any) -> list[dict[str, Any]]:
    summary = _trainer(cfg, run_dir, resume, **parts).run()
    assert summary.last_step == STEPS and not summary.interrupted
    rows = MetricsLog(run_dir / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["train/optimizer_stepped"] for r in rows)
    return rows


@pytest.fixture
def parts(tiny_model_dir: Path) -> Any:
    cfg = tiny_config(tiny_model_dir)
    client = make_training_client(cfg)
    protocol = ChatProtocol.from_config(client.tokenizer, cfg)
    yield cfg, client, protocol
    client.close()


def test_fork_server_sigkill_mid_run(parts: Any, tmp_path: Path) -> None:
    cfg, client, protocol = parts
    # Step 2, question 1, branch 0 runs the slow code; its server is SIGKILLed while it runs.
    sampler = ToolScriptSampler(
        protocol, lambda step, q, b: SLOW_CODE if (step, q, b) == (2, 1, 0) else f"print(2 + {b})"
    )
    with ForkServerExecutor(timeout=90.0, workers=2, isolation="none", preimport=[]) as real:
        killer = ServerKiller(real, SLOW_CODE)
        with Verifier(workers=1, timeout=10.0) as verifier:
            rows = _run(
                cfg,
                tmp_path / "run",
                client=ScriptedClient(client, sampler),
                protocol=protocol,
                executor=killer,
                verifier=verifier,
            )
        assert len(killer.killed) == 1 and killer.killed[0] not in server_pids(real)  # respawned
        assert len(server_pids(real)) == 2
    total = 2 * GROUP
    lost = [r["faults/trajectories_lost"] for r in rows]
    assert lost == [0.0, 1.0, 0.0]  # only the trajectory whose call was in flight
    assert rows[1]["stop/executor_error"] == pytest.approx(1 / total)
    assert rows[1]["faults/sandbox_worker_failures"] == 1 and rows[1]["faults/sandbox_worker_restarts"] == 1
    # Every other call of the run executed and was observed normally, before and after the kill.
    assert [r["env/exec_calls"] for r in rows] == [total, total - 1, total]
    assert all(r["env/exec_success_rate"] == 1.0 for r in rows)
    assert rows[2]["stop/answer"] == 1.0


def test_verifier_worker_sigkill_mid_run(parts: Any, tmp_path: Path) -> None:
    cfg, client, protocol = parts
    sampler = ToolScriptSampler(protocol, lambda step, q, b: f"print(2 + {b})")
    total = 2 * GROUP
    with (
        ForkServerExecutor(timeout=30.0, workers=2, isolation="none", preimport=[]) as executor,
        Verifier(workers=1, timeout=10.0) as real,
    ):
        killer = VerifierKiller(real, at=total + 3)  # the third check of step 2
        rows = _run(
            cfg,
            tmp_path / "run",
            client=ScriptedClient(client, sampler),
            protocol=protocol,
            executor=executor,
            verifier=killer,
        )
        assert len(killer.killed) == 1 and real.worker_pids() and killer.killed[0] not in real.worker_pids()
        assert killer.checks == STEPS * total
    assert [r["faults/verify_errors"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["faults/verifier_worker_restarts"] >= 1
    assert all(r["stop/answer"] == 1.0 for r in rows)  # the check failed, the trajectory was not lost
    assert all(r["faults/trajectories_lost"] == 0.0 for r in rows)


def test_local_sampler_batch_dies_mid_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The local sampler's worker is a thread (no process pool to SIGKILL): a generation batch that dies
    on it, as with a CUDA error, ends that batch's requests only; the thread lives on."""
    cfg = tiny_config(tiny_model_dir)
    client = make_training_client(cfg)
    sampler = client._sampler
    real_start_batch = sampler._start_batch
    batches = {"n": 0}

    def dying_batch(requests: Any) -> Any:
        if len(requests) == GROUP:  # a group request (later turns ask for one sample each)
            batches["n"] += 1
            if batches["n"] == 3:  # the first group request of step 2
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real_start_batch(requests)

    sampler._start_batch = dying_batch  # type: ignore[method-assign]
    worker_pool = client._executor
    try:
        with (
            ForkServerExecutor(timeout=30.0, workers=1, isolation="none", preimport=[]) as executor,
            Verifier(workers=1, timeout=10.0) as verifier,
        ):
            rows = _run(cfg, tmp_path / "run", client=client, executor=executor, verifier=verifier)
    finally:
        client.close()
    assert client._executor is worker_pool  # the same worker thread served every later batch
    lost = [r["faults/trajectories_lost"] for r in rows]
    assert lost[0] == 0.0 and lost[2] == 0.0
    assert lost[1] == GROUP  # the group request in flight in the dead batch, not the other question
    assert rows[1]["stop/sampler_error"] == pytest.approx(GROUP / (2 * GROUP))
    assert rows[2]["tokens/completion"] > 0


def test_full_disk_while_the_local_backend_saves(parts: Any, tmp_path: Path) -> None:
    """The real local backend's save runs out of space at step 2's checkpoint: a clear error, the
    step-1 checkpoint intact, and the resumed run trains exactly like an uninterrupted one."""
    cfg, client, protocol = parts
    sampler = ToolScriptSampler(protocol, lambda step, q, b: f"print({step} * {b} + {q})")

    def run(run_dir: Path, resume: bool = False) -> list[dict[str, Any]]:
        latest = CheckpointManager(run_dir).latest() if resume else None
        sampler.group_requests = 2 * int(latest.name.split("_")[1]) if latest is not None else 0
        return _run(
            cfg,
            run_dir,
            resume=resume,
            client=ScriptedClient(client, sampler),
            protocol=protocol,
            executor=executor,
            verifier=verifier,
        )

    with (
        ForkServerExecutor(timeout=30.0, workers=1, isolation="none", preimport=[]) as executor,
        Verifier(workers=1, timeout=10.0) as verifier,
    ):
        initial = {id(p): p.detach().clone() for p in client.trainable_parameters()}
        reference = run(tmp_path / "reference")
        ref_weights = [p.detach().clone() for p in client.trainable_parameters()]
        for p in client.trainable_parameters():  # start the second run from the same weights
            p.data.copy_(initial[id(p)])
        client.optimizer = None

        real_save = client._save_state
        saves = {"n": 0}

        def full_disk_save(name: str) -> str:
            saves["n"] += 1
            folder = real_save(name)
            if saves["n"] == 2:
                target = Path(folder) / "adapter_model.safetensors"
                target.write_bytes(target.read_bytes()[:100])  # torn
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
            return folder

        client._save_state = full_disk_save
        run_dir = tmp_path / "run"
        sampler.group_requests = 0
        with pytest.raises(CheckpointWriteError) as info:
            _trainer(
                cfg,
                run_dir,
                client=ScriptedClient(client, sampler),
                protocol=protocol,
                executor=executor,
                verifier=verifier,
            ).run()
        del client._save_state
        message = str(info.value)
        assert "checkpoint step_000002: saving the backend state" in message
        assert "adapter_model.safetensors" in message and "No space left on device" in message
        assert CheckpointManager(run_dir).latest() == run_dir / "checkpoints" / "step_000001"
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))
        resumed = run(run_dir, resume=True)
    keys = ("problem_ids", "rewards", "train/optimizer_stepped", "policy/loss")
    assert [tuple(str(r[k]) for k in keys) for r in resumed] == [
        tuple(str(r[k]) for k in keys) for r in reference
    ]
    assert all((a == b).all() for a, b in zip(ref_weights, client.trainable_parameters(), strict=True))
