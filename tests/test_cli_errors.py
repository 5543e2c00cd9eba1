"""The project's own user-facing errors end every command with one line and exit 2, no traceback unless
``--debug`` / ``RETOOL_DEBUG=1``: a model that cannot be loaded, a backend without credentials, a bad
config, a missing input. Each command runs as a user runs it (``python -m retool``), offline
(``HF_HUB_OFFLINE=1``, an empty Hugging Face cache and home), so nothing tries the network.

The third way a model cannot be loaded, the Hub unreachable while online, ends the same way after
huggingface_hub's own retries (about a minute: run by hand with ``HF_ENDPOINT=http://127.0.0.1:9``); here its
translation is tested in-process, with transformers' OSError stood in for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
NOT_CACHED = "is neither a local path nor in the Hugging Face cache"
BAD_SET = ["--set", "nosuch.key=1"]
BAD_SET_ERROR = "invalid configuration: nosuch: Extra inputs are not permitted"


def run_retool(tmp_path: Path, *args: str, debug: bool = False) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTRIO_", "TINKER_", "HF_", "RETOOL_")) and k != "HOME"
    }
    env.update(
        HOME=str(home),
        HF_HOME=str(home / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(SRC),
        **({"RETOOL_DEBUG": "1"} if debug else {}),
    )
    return subprocess.run(
        [sys.executable, "-m", "retool", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: "), proc.stderr
    for text in expected:
        assert text in last, last
    return last


QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
TRAIN_LOCAL = [
    "train",
    "--config",
    "chapter",
    "--set",
    "backend.kind=local",
    "--set",
    "data.source=synthetic",
]

CASES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "train: model not cached": ([*TRAIN_LOCAL, "--set", f"model.name={QWEN}"], (QWEN, NOT_CACHED)),
    "train: no such model path": (
        [*TRAIN_LOCAL, "--set", "model.name=/no/such/model"],
        ("'/no/such/model': no such file or folder",),
    ),
    "train: remote backend without a key": (
        ["train", "--config", "chapter", "--set", "data.source=synthetic"],
        ("pytrio backend: no API key", "PYTRIO_API_KEY"),
    ),
    "train: bad config": (["train", "--config", "chapter", *BAD_SET], (BAD_SET_ERROR,)),
    "eval: model not cached": (
        [
            "eval",
            "--mode",
            "retool",
            "--config",
            "tiny",
            "--model",
            QWEN,
            "--dataset",
            "synthetic",
            "-o",
            "e.jsonl",
        ],
        (QWEN, NOT_CACHED),
    ),
    "eval: bad config": (
        ["eval", "--mode", "retool", "--config", "tiny", *BAD_SET, "-o", "e.jsonl"],
        (BAD_SET_ERROR,),
    ),
    "sft: no such model": (["sft", "--model", "/no/such/model"], ("/no/such/model",)),
    "sft: bad config": (["sft", *BAD_SET], (BAD_SET_ERROR,)),
    "sft --data: no such file": (
        ["sft", "--data", "/no/such/traces.jsonl"],
        ("--data /no/such/traces.jsonl: no such file",),
    ),
    "demo: unknown recipe": (["demo", "--recipe", "/no/such/recipe"], ("'/no/such/recipe'", "known: tiny")),
    "demo: no such model path": (
        ["demo", "--set", "model.name=/no/such/model", "--out", "d"],
        ("'/no/such/model'", "nor a path"),
    ),
    "demo: bad config": (["demo", *BAD_SET], (BAD_SET_ERROR,)),
    "prepare dapo: no such input": (
        ["prepare", "dapo", "--input", "/no/such/dapo.jsonl", "--out", "prepared"],
        ("/no/such/dapo.jsonl",),
    ),
    "view: no such run": (["view", "/no/such/run"], ("/no/such/run",)),
    "export: no such source": (["export", "/no/such/run", "--out", "x"], ("/no/such/run: no such folder",)),
    "export: unknown format": (["export", ".", "--out", "x", "-f", "onnx"], ("unknown format 'onnx'",)),
    "analyze: no such file": (
        ["analyze", "/no/such/eval.jsonl", "--out", "analysis"],
        ("/no/such/eval.jsonl",),
    ),
    "sandbox exec: bad option": (
        ["sandbox", "exec", "--backend", "nosuch"],
        ("invalid sandbox options: backend: Input should be 'forkserver'",),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_user_error_ends_the_command_with_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    args, expected = CASES[case]
    assert_one_line_error(run_retool(tmp_path, *args), *expected)


TRACE = {"id": "t1", "question": "q", "answer": "1", "style": "tool", "tokens": [1, 2], "weights": [0, 1]}


@pytest.mark.parametrize(
    ("second_line", "expected"),
    [
        ('{"id": "t2", "tokens": [1, 2', ("traces.jsonl:2: not a JSON line",)),
        (
            json.dumps({"question": "q", "answer": "#### 1"}),
            ("traces.jsonl:2: not an SFT trace (no id, style,",),
        ),
        (json.dumps({**TRACE, "weights": [1]}), ("traces.jsonl:2: 2 tokens but 1 weights",)),
    ],
    ids=["broken row", "not a trace file", "tokens and weights differ"],
)
def test_sft_data_names_the_line_that_is_not_a_trace(
    second_line: str, expected: tuple[str, ...], tmp_path: Path
) -> None:
    (tmp_path / "traces.jsonl").write_text(json.dumps(TRACE) + "\n" + second_line + "\n")
    assert_one_line_error(run_retool(tmp_path, "sft", "--data", "traces.jsonl", "--out", "o"), *expected)
    assert not (tmp_path / "o").exists()


def test_the_traceback_is_shown_on_request(tmp_path: Path) -> None:
    args = ["train", "--config", "chapter", "--set", "data.source=synthetic"]
    for proc in (run_retool(tmp_path, *args, debug=True), run_retool(tmp_path, "--debug", *args)):
        assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr
        assert (
            proc.stderr.rstrip()
            .splitlines()[-1]
            .startswith(
                "retool.backends.interface.errors.BackendUnavailableError: pytrio backend: no API key"
            )
        )


def _fake_hub_cache(cache: Path, repo: str, files: list[str]) -> None:
    """The Hugging Face cache layout: models--ORG--NAME/{refs/main, snapshots/REV/FILE}."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    for name in files:
        (folder / "snapshots" / "abc123").mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / "abc123" / name).write_text("{}")


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_model_is_checked_against_the_cache(
    offline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    from retool.backends import check_model_available
    from retool.errors import ModelLoadError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    _fake_hub_cache(tmp_path / "hub", "org/cached", ["config.json"])
    _fake_hub_cache(tmp_path / "hub", "org/gguf-only", ["m.Q4.gguf"])
    check_model_available("org/cached")
    check_model_available("org/gguf-only", "m.Q4.gguf")
    check_model_available(str(tmp_path))  # a local folder
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        check_model_available(str(tmp_path / "missing"))
    if offline:
        with pytest.raises(ModelLoadError, match=f"'org/absent' {NOT_CACHED}"):
            check_model_available("org/absent")
        with pytest.raises(ModelLoadError, match=NOT_CACHED):
            check_model_available("org/gguf-only")  # its config.json is not there
    else:  # online, loading will try the Hub (and say so in one line if it cannot)
        check_model_available("org/absent")


def test_a_hub_that_cannot_provide_the_model_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, loading a Hub id that is not cached goes to the Hub; when that fails, transformers raises an
    OSError (what it raises after its retries, stood in for here), said as a ModelLoadError."""
    from huggingface_hub import constants

    import retool.backends.local.client
    import retool.backends.local.data_parallel  # its class subclasses the real client: before the patch
    from retool.backends import make_training_client
    from retool.config import load_config
    from retool.errors import ModelLoadError

    def unreachable(*_: object, **__: object) -> None:
        raise OSError(
            "We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection."
        )

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(retool.backends.local.client, "LocalTrainingClient", unreachable)
    with pytest.raises(ModelLoadError) as caught:
        make_training_client(load_config("tiny", [f"model.name='{QWEN}'"]))
    assert str(caught.value) == (
        f"model.name = '{QWEN}' is neither a local path nor in the Hugging Face cache, and the Hub could not "
        "provide it (We couldn't connect to 'https://huggingface.co' to load the files.)"
    )
