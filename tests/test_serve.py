"""``retool serve`` end to end: the real ``pytrio`` and ``tinker`` SDKs against a real server process.

The server runs ``python -m retool serve`` on 127.0.0.1 (a free port) with the tiny test model on CPU, and
is always stopped. The scripts in ``examples/serve`` (written the chapter's way) run unmodified in a child
process with only ``PYTRIO_BASE_URL`` / ``PYTRIO_API_KEY`` set.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytrio
import tinker
from pytrio import types as ptypes
from tinker import types as ttypes
from tinker.lib.retry_handler import RetryConfig

from serve_harness import REPO, ServeProcess

PPO_CFG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("serve") / "root"
    with ServeProcess(tiny_model_dir, root, "--max-request-mb", "1") as proc:
        yield proc


def pytrio_service(url: str, key: str = "local") -> pytrio.ServiceClient:
    pytrio.configure(base_url=url, api_key=key, home=os.environ["HOME"])
    return pytrio.ServiceClient(api_key=key)


_TINKER_CLIENTS: list[tinker.ServiceClient] = []


def tinker_service(url: str, key: str = "tml-local") -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=url, api_key=key)
    _TINKER_CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def close_tinker_sessions() -> Iterator[None]:
    """Finish every Tinker session a test opened: the SDK heartbeats each one from a background thread until
    the process exits, and warns from there once its server is gone."""
    yield
    while _TINKER_CLIENTS:
        client = _TINKER_CLIENTS.pop()
        try:
            client.close("success").result(timeout=5)
        except Exception:  # the server may be gone (the kill and auth tests); the heartbeat still stops
            pass


def run_example(name: str, url: str, home: Path, *args: str) -> None:
    env = {**os.environ, "PYTRIO_BASE_URL": url, "PYTRIO_API_KEY": "local", "HOME": str(home)}
    script = REPO / "examples" / "serve" / name
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def rl_datums(
    prompt: list[int], samples: list[tuple[list[int], list[float]]], advantages: list[float], sdk: Any
) -> list[Any]:
    out = []
    for (tokens, logprobs), adv in zip(samples, advantages, strict=True):
        seq = prompt + tokens
        first, n = len(prompt) - 1, len(seq) - 1
        inputs = {
            "target_tokens": np.asarray(seq[1:], dtype=np.int64),
            "logprobs": np.asarray([0.0] * first + list(logprobs), dtype=np.float32),
            "advantages": np.asarray([0.0] * first + [adv] * (n - first), dtype=np.float32),
        }
        if sdk is ptypes:
            inputs = {k: ptypes.TensorData.from_numpy(v) for k, v in inputs.items()}
        out.append(sdk.Datum(model_input=sdk.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return out


# -- PyTRIO ---------------------------------------------------------------------------------------------


def test_chapter_shaped_pytrio_training_and_evaluation_scripts_run_unmodified(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path, tmp_path: Path
) -> None:
    out = tmp_path / "train.json"
    run_example("pytrio_train.py", server.url, sdk_env, str(tiny_model_dir), "2", str(out))
    report = json.loads(out.read_text())
    assert len(report["history"]) == 2
    assert all(0.0 <= h["reward"] <= 1.0 and math.isfinite(h["loss"]) for h in report["history"])
    assert all(h["opt"]["grad_norm"] > 0 for h in report["history"])  # the PPO step had a gradient
    assert report["state_path"].startswith("trio://") and report["sampler_path"].startswith("trio://")
    # save_weights_and_get_sampling_client's temporary weights stay in memory; named saves are on disk.
    saved = {p.name for p in (server.root / "checkpoints").glob("*/*/*")}
    assert {"final", "final-sampler"} <= saved and not any(n.startswith("temp-sampling-") for n in saved)

    evaluated = tmp_path / "eval.json"
    run_example(
        "pytrio_eval.py", server.url, sdk_env, str(tiny_model_dir), report["sampler_path"], str(evaluated)
    )
    rows = json.loads(evaluated.read_text())
    assert len(rows) == 4
    for row in rows:
        assert 1 <= len(row["tokens"]) <= 6 and len(row["logprobs"]) == len(row["tokens"])
        assert all(lp <= 0.0 for lp in row["logprobs"]) and row["stop_reason"] in ("stop", "length")
        assert isinstance(row["text"], str)
    assert rows[0]["tokens"] == rows[1]["tokens"]  # temperature 0: both samples of a prompt agree

    # The trained weights are what the evaluation sampled: the base model gives other logprobs.
    service = pytrio_service(server.url)
    base = service.create_sampling_client(base_model=str(tiny_model_dir))
    trained = service.create_sampling_client(
        base_model=str(tiny_model_dir), model_path=report["sampler_path"]
    )
    prompt = ptypes.ModelInput.from_ints([*rows[0]["tokens"][:1], 5, 6])
    params = ptypes.SamplingParams(max_tokens=3, temperature=0.0)
    a = base.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
    b = trained.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
    assert not np.allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_pytrio_state_resumes_into_a_new_client_with_identical_logprobs(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path
) -> None:
    service = pytrio_service(server.url)
    trainer = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1)
    prompt = trainer.get_tokenizer().encode("3 + 4 =")
    sampler = trainer.save_weights_and_get_sampling_client()
    got = sampler.sample(
        ptypes.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=ptypes.SamplingParams(max_tokens=4, seed=5),
    ).result()
    samples = [(list(s.tokens), list(s.logprobs)) for s in got.sequences]
    data = rl_datums(prompt, samples, [1.0, -1.0], ptypes)
    trainer.forward_backward(data, loss_fn="ppo", loss_fn_config=PPO_CFG).result()
    trainer.optim_step(ptypes.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("resume-me").result().path

    resumed = service.create_training_client_from_state(path)
    mine = trainer.forward(data, loss_fn="ppo", loss_fn_config=PPO_CFG).result()
    theirs = resumed.forward(data, loss_fn="ppo", loss_fn_config=PPO_CFG).result()
    for x, y in zip(mine.loss_fn_outputs, theirs.loss_fn_outputs, strict=True):
        assert np.allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-6)
    bound = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1)
    bound.load_state_with_optimizer(path).result()  # load into an existing client, before its first call
    loaded = bound.forward(data, loss_fn="ppo", loss_fn_config=PPO_CFG).result()
    for x, y in zip(mine.loss_fn_outputs, loaded.loss_fn_outputs, strict=True):
        assert np.allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-6)
    fresh = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1)
    other = fresh.forward(data, loss_fn="ppo", loss_fn_config=PPO_CFG).result()
    assert not np.allclose(
        mine.loss_fn_outputs[0]["logprobs"].to_numpy(),
        other.loss_fn_outputs[0]["logprobs"].to_numpy(),
        atol=1e-6,
    )


# -- Tinker ---------------------------------------------------------------------------------------------


def test_tinker_sdk_trains_samples_saves_and_resumes(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path
) -> None:
    service = tinker_service(server.url)
    trainer = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=2).result()
    prompt = trainer.get_tokenizer().encode("5 + 6 =")
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = ttypes.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    got = sampler.sample(
        prompt=ttypes.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params
    ).result()
    assert len(got.sequences) == 3
    samples = [(list(s.tokens), list(s.logprobs or [])) for s in got.sequences]
    assert all(len(t) == len(lp) == 4 for t, lp in samples)
    data = rl_datums(prompt, samples, [1.0, 0.0, -1.0], ttypes)
    fb = trainer.forward_backward(data, "ppo", PPO_CFG)
    opt = trainer.optim_step(ttypes.AdamParams(learning_rate=1e-2))
    # On-policy the ratio is 1, so Tinker's sum is -sum(A) over trained tokens: 4 * (1 + 0 - 1) = 0.
    assert abs(fb.result().metrics["loss:sum"]) < 1e-4
    assert opt.result().metrics["grad_norm:mean"] > 0
    state = trainer.save_state("t1").result().path
    weights = trainer.save_weights_for_sampler("t1-sampler").result().path
    assert state.startswith("tinker://") and "/weights/" in state and "/sampler_weights/" in weights

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    a = trainer.forward(data, "cross_entropy").result()
    b = resumed.forward(data, "cross_entropy").result()
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    reloaded = service.create_sampling_client(model_path=weights).result()
    greedy = ttypes.SamplingParams(max_tokens=3, temperature=0.0)
    one = reloaded.sample(
        prompt=ttypes.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy
    ).result()
    two = (
        resumed.save_weights_and_get_sampling_client()
        .result()
        .sample(prompt=ttypes.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy)
        .result()
    )
    assert list(one.sequences[0].tokens) == list(two.sequences[0].tokens)


def test_tinker_training_tokens_outside_the_vocabulary_are_refused(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path
) -> None:
    trainer = (
        tinker_service(server.url)
        .create_lora_training_client(base_model=str(tiny_model_dir), rank=4)
        .result()
    )
    bad = rl_datums([5, 6, 7], [([8, 10**6], [-1.0, -1.0])], [1.0], ttypes)
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        trainer.forward_backward(bad, "ppo", PPO_CFG).result(timeout=60)
    good = rl_datums([5, 6, 7], [([8, 9], [-1.0, -1.0])], [1.0], ttypes)
    assert trainer.forward(good, "cross_entropy").result().metrics["loss:sum"] > 0  # the client still works


def test_two_tinker_training_clients_never_see_each_others_weights(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path
) -> None:
    service = tinker_service(server.url)
    first = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    second = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    data = rl_datums([5, 6, 7], [([8, 9, 10], [-5.0, -5.0, -5.0])], [1.0], ttypes)
    before = second.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert first.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        before, rel=1e-6
    )
    for _ in range(2):
        first.forward_backward(data, "cross_entropy")
        first.optim_step(ttypes.AdamParams(learning_rate=5e-2))
    after_first = first.forward(data, "cross_entropy").result().metrics["loss:sum"]
    after_second = second.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after_first < before - 1e-3  # cross-entropy went down for the one that trained
    assert after_second == pytest.approx(before, rel=1e-6)


# -- hostile requests (point 5) -------------------------------------------------------------------------


def _post(url: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    content = kw.pop("content", None)
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=60, **kw)


def test_hostile_tinker_requests_get_a_clear_4xx_and_the_server_keeps_serving(
    server: ServeProcess, tiny_model_dir: Path
) -> None:
    url, model = server.url, str(tiny_model_dir)
    sid = _post(
        url, "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "x"}
    ).json()["session_id"]
    lora = {"rank": 4, "train_mlp": False, "train_attn": True, "train_unembed": False}
    good_model = {"session_id": sid, "model_seq_id": 0, "base_model": model, "lora_config": lora}
    cases: list[tuple[str, Any, int, str]] = [
        ("/api/v1/create_model", b"{not json", 400, "not JSON"),
        ("/api/v1/create_model", [1, 2], 400, "JSON object"),
        ("/api/v1/create_model", {**good_model, "lora_config": {**lora, "rank": "big"}}, 400, "rank"),
        ("/api/v1/create_model", {**good_model, "base_model": "Qwen/Qwen3-4B"}, 404, "not served"),
        ("/api/v1/create_model", {**good_model, "session_id": "sess-nope"}, 404, "no session"),
        (
            "/api/v1/create_model",
            {**good_model, "lora_config": {**lora, "train_attn": False}},
            400,
            "at least one",
        ),
        ("/api/v1/optim_step", {"model_id": "sess-x:train:9", "adam_params": {}}, 404, "no training run"),
        ("/api/v1/forward_backward", b"\xff\x00garbage", 400, "ForwardBackwardRequest"),
        (
            "/api/v1/load_weights",
            {"session_id": sid, "model_seq_id": 1, "path": "/etc/passwd", "optimizer": False},
            400,
            "URI",
        ),
        (
            "/api/v1/load_weights",
            {"session_id": sid, "model_seq_id": 1, "path": "tinker://../x/weights/y", "optimizer": False},
            400,
            "is not <trio|tinker>",
        ),
        (
            "/api/v1/load_weights",
            {"session_id": sid, "model_seq_id": 1, "path": "tinker://../weights/y", "optimizer": False},
            400,
            "not allowed",
        ),
        (
            "/api/v1/load_weights",
            {"session_id": sid, "model_seq_id": 1, "path": "tinker://run-1/weights/..", "optimizer": False},
            400,
            "not allowed",
        ),
        (
            "/api/v1/load_weights",
            {
                "session_id": sid,
                "model_seq_id": 1,
                "path": "tinker://run-1/weights/nothing",
                "optimizer": False,
            },
            404,
            "no checkpoint",
        ),
        ("/api/v1/retrieve_future", {"request_id": "req-unknown"}, 404, "no future"),
    ]
    for path, body, status, words in cases:
        answer = _post(url, path, content=body) if isinstance(body, bytes) else _post(url, path, body)
        assert answer.status_code == status, (path, body, answer.text)
        assert words in answer.json()["message"], (path, answer.text)

    created = _post(url, "/api/v1/create_model", good_model).json()
    model_id = created["model_id"]
    for name in ("../escape", "/abs/path", "a/b", ".hidden", "x" * 300):
        answer = _post(url, "/api/v1/save_weights", {"model_id": model_id, "path": name})
        assert answer.status_code == 400 and "not allowed" in answer.json()["message"], name
    sampler = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": model}
    samp = _post(url, "/api/v1/create_sampling_session", sampler).json()["sampling_session_id"]

    def sample(prompt: list[int], n: int = 1, **params: Any) -> httpx.Response:
        body = {"sampling_session_id": samp, "seq_id": 0, "num_samples": n,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": 2, **params}}  # fmt: skip
        return _post(url, "/api/v1/asample", body)

    for prompt, n, params, words in (
        ([5, 10**9], 1, {}, "outside the vocabulary"),
        ([5, -3], 1, {}, "outside the vocabulary"),
        ([5, 6], 1, {"max_tokens": -1}, "max_tokens"),
        ([5, 6], 1, {"max_tokens": 10**9}, "max_tokens"),
        ([5, 6], 0, {}, "num_samples"),
        ([5, 6], 10**6, {}, "num_samples"),
        ([5, 6], 1, {"max_tokens": "2"}, "max_tokens"),
        ([5, 6], 1, {"stop": [10**9]}, "outside the vocabulary"),
        ([], 1, {}, "empty"),
    ):
        answer = sample(prompt, n, **params)
        assert answer.status_code == 400 and words in answer.json()["message"], (
            prompt,
            n,
            params,
            answer.text,
        )
    assert sample([5, 6]).status_code == 200  # still serving, and serving this caller too


def test_a_planted_symlink_in_the_root_is_refused(server: ServeProcess, tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "state" / "x"
    outside.mkdir(parents=True)
    (outside / "serve.json").write_text("{}")
    (server.root / "checkpoints" / "linked").symlink_to(tmp_path / "outside")
    answer = _post(server.url, "/api/v1/weights_info", {"tinker_path": "tinker://linked/weights/x"})
    assert answer.status_code == 400
    assert "symbolic link" in answer.json()["message"] or "leaves the server root" in answer.json()["message"]


def test_hostile_pytrio_events_and_oversized_bodies(server: ServeProcess) -> None:
    import msgpack

    answer = _post(server.url, "/v1/events", content=b"\xc1\xc1 not msgpack")
    assert answer.status_code == 400
    envelope = {"version": 1, "event_id": "event_0123456789ab", "type": "trainer.forward_backward",
                "metadata": {"index": 1, "step": 0, "timestamp": 0, "sdk": "x", "sdk_version": "x", "run_id": "run-nope"},
                "payload": {}}  # fmt: skip
    answer = _post(server.url, "/v1/events", content=msgpack.packb(envelope))
    assert answer.status_code == 404 and "no training run" in answer.json()["message"]
    envelope["event_id"] = "../../etc"
    answer = _post(server.url, "/v1/events", content=msgpack.packb(envelope))
    assert answer.status_code == 400 and "event_id" in answer.json()["message"]
    big = b"x" * (2 * 1024 * 1024)  # the test server accepts 1 MB
    answer = _post(server.url, "/api/v1/create_session", content=big)
    assert answer.status_code == 413 and "larger than" in answer.json()["message"]
    assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 200


# -- faults and keys (points 4 and 5) -------------------------------------------------------------------


def test_sigkilled_server_restarts_and_every_saved_path_loads_and_a_vanished_server_is_an_sdk_error(
    tiny_model_dir: Path, tmp_path: Path, sdk_env: Path
) -> None:
    root, model = tmp_path / "root", str(tiny_model_dir)
    first = ServeProcess(tiny_model_dir, root).start()
    try:
        tk = tinker_service(first.url)
        trainer = tk.create_lora_training_client(base_model=model, rank=4, seed=1).result()
        data = rl_datums([5, 6, 7], [([8, 9, 10], [-5.0, -5.0, -5.0])], [1.0], ttypes)
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(ttypes.AdamParams(learning_rate=5e-2)).result()
        state = trainer.save_state("before-kill").result().path
        weights = trainer.save_weights_for_sampler("before-kill").result().path
        loss_before = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
        pt = pytrio_service(first.url)
        pt_trainer = pt.create_lora_training_client(base_model=model, rank=4, seed=1)
        pt_path = pt_trainer.save_weights_for_sampler("pt-before-kill").result().path
        pt_sampler = pt.create_sampling_client(base_model=model, model_path=pt_path)
        quick = RetryConfig(progress_timeout=5, retry_delay_max=1)  # the SDK's default retries for 2 hours
        tk_sampler = tk.create_sampling_client(model_path=weights, retry_config=quick).result()
        first.kill()
        # The server is gone: the SDK raises its own error (after its retries), it does not hang.
        with pytest.raises(pytrio.PyTrioError):
            pt_sampler.sample(ptypes.ModelInput.from_ints([5, 6]), num_samples=1,
                              sampling_params=ptypes.SamplingParams(max_tokens=2)).result(timeout=60)  # fmt: skip
        with pytest.raises(tinker.APIConnectionError):
            tk_sampler.sample(prompt=ttypes.ModelInput.from_ints([5, 6]), num_samples=1,
                              sampling_params=ttypes.SamplingParams(max_tokens=2)).result(timeout=60)  # fmt: skip
    finally:
        first.stop()
    with ServeProcess(tiny_model_dir, root) as second:
        tk = tinker_service(second.url)
        resumed = tk.create_training_client_from_state_with_optimizer(state).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            loss_before, rel=1e-5
        )
        sampler = tk.create_sampling_client(model_path=weights).result()
        got = sampler.sample(prompt=ttypes.ModelInput.from_ints([5, 6]), num_samples=1,
                             sampling_params=ttypes.SamplingParams(max_tokens=2)).result()  # fmt: skip
        assert len(got.sequences[0].tokens) == 2
        pt = pytrio_service(second.url)
        again = pt.create_sampling_client(base_model=model, model_path=pt_path)
        seq = again.sample(ptypes.ModelInput.from_ints([5, 6]), num_samples=1,
                           sampling_params=ptypes.SamplingParams(max_tokens=2)).result().sequences[0]  # fmt: skip
        assert len(seq.tokens) == 2 and len(seq.logprobs) == 2


def test_an_api_key_is_required_the_way_each_sdk_sends_it(
    tiny_model_dir: Path, tmp_path: Path, sdk_env: Path
) -> None:
    key = "tml-secret-key"
    with ServeProcess(tiny_model_dir, tmp_path / "root", api_key=key) as server:
        for headers in ({}, {"X-API-Key": "tml-wrong"}):
            answer = _post(server.url, "/api/v1/create_session", {"tags": []}, headers=headers)
            assert answer.status_code == 401
            assert _post(server.url, "/v1/client/heartbeat", {}, headers=headers).status_code == 401
        assert (
            httpx.get(f"{server.url}/api/openapi/v1/api-key/verify", headers={"X-API-Key": "x"}).status_code
            == 401
        )
        with pytest.raises(tinker.AuthenticationError):
            tinker_service(server.url, key="tml-wrong").create_lora_training_client(
                base_model=str(tiny_model_dir), rank=4
            ).result(timeout=60)
        with pytest.raises(pytrio.PyTrioError):
            pytrio_service(server.url, key="wrong")
        # The right key works through both SDKs, PyTRIO's actor token included.
        trainer = (
            tinker_service(server.url, key=key)
            .create_lora_training_client(base_model=str(tiny_model_dir), rank=4)
            .result()
        )
        assert trainer.get_tokenizer() is not None
        pt = pytrio_service(server.url, key=key)
        sampler = pt.create_sampling_client(base_model=str(tiny_model_dir))
        seq = sampler.sample(ptypes.ModelInput.from_ints([5, 6]), num_samples=1,
                             sampling_params=ptypes.SamplingParams(max_tokens=2)).result().sequences[0]  # fmt: skip
        assert len(seq.tokens) == 2


def test_binding_beyond_loopback_needs_an_api_key(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "retool",
        "serve",
        "--host",
        "0.0.0.0",
        "--model",
        str(tmp_path),
        "--root",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pass --api-key" in done.stderr


# -- tinker-cookbook ------------------------------------------------------------------------------------


def test_tinker_cookbook_math_rl_arithmetic_recipe_runs_against_the_server_with_its_default_loss(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path, tmp_path: Path
) -> None:
    """The recipe's own defaults for everything that changes what the server must do (loss_fn is
    stable_reinforce: stability info recorded at sampling, provenance on every datum); only the model, the
    renderer and the sizes are set, so the test is quick."""
    pytest.importorskip(
        "tinker_cookbook.recipes.math_rl.train", reason="tinker-cookbook not installed (setup.sh --dev)"
    )
    log = tmp_path / "cookbook"
    args = [
        f"model_name={tiny_model_dir}", "renderer_name=qwen3", "env=arithmetic", "group_size=2",
        "groups_per_batch=2", "max_tokens=5", "max_steps=2", "lora_rank=8",
        f"base_url={server.url}", f"log_path={log}", "behavior_if_log_dir_exists=delete",
        "eval_every=0", "save_every=0",
    ]  # fmt: skip
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HOME": str(sdk_env)}
    cmd = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stable_reinforce" in json.loads((log / "config.json").read_text())["loss_fn"]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert len(trained) == 2
    # The sampler's logprobs and the trainer's agree: the recipe's own on-policy check.
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-4 for r in trained)
    assert "Training completed successfully" in done.stderr


def test_ending_a_session_frees_its_runs_and_keeps_what_they_saved(
    server: ServeProcess, tiny_model_dir: Path
) -> None:
    url = server.url
    sid = _post(url, "/api/v1/create_session", {"tags": []}).json()["session_id"]
    lora = {"rank": 4, "train_mlp": False, "train_attn": True, "train_unembed": False}
    body = {"session_id": sid, "model_seq_id": 0, "base_model": str(tiny_model_dir), "lora_config": lora}
    model_id = _post(url, "/api/v1/create_model", body).json()["model_id"]
    future = _post(url, "/api/v1/save_weights", {"model_id": model_id, "path": "kept", "seq_id": 1}).json()
    path = _post(url, "/api/v1/retrieve_future", {"request_id": future["request_id"]}).json()["path"]
    assert _post(url, "/api/v1/get_info", {"model_id": model_id}).status_code == 200
    assert _post(url, f"/api/v1/sessions/{sid}/finish", {}).status_code == 200
    gone = _post(url, "/api/v1/get_info", {"model_id": model_id})
    assert gone.status_code == 404 and "no training run" in gone.json()["message"]
    assert _post(url, "/api/v1/weights_info", {"tinker_path": path}).json()["lora_rank"] == 4
