"""Shared fixtures: where ../shared/data lives, the real Qwen tokenizers, and a tiny local model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests/vllm_engine/ needs vLLM, which lives in an environment of its own (scripts/setup_vllm.sh);
# tests/test_vllm_engine.py runs it there. Collected directly only where vLLM is importable.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_engine"]
SHARED_DATA = Path(os.environ.get("RETOOL_SHARED_DATA", REPO.parent / "shared" / "data"))
TOKENIZER_NAMES = ("Qwen2.5-Instruct", "Qwen3", "Qwen3.5")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set RETOOL_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen_tokenizers(shared_data: Path) -> dict:
    from transformers import AutoTokenizer

    return {
        name: AutoTokenizer.from_pretrained(shared_data / "tokenizers" / name) for name in TOKENIZER_NAMES
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Qwen2 model with its own tokenizer and tool-capable chat template."""
    from retool.backends.local.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), size="test", seed=0)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small local tokenizer (300 ids) that the remote adapters load instead of the service's."""
    from retool.backends.local.tinymodel import build_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(vocab_size=300).save_pretrained(folder)
    return folder


@pytest.fixture
def sdk_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """For tests of `retool serve` through the real SDKs: an empty HOME, no SDK variables from outside,
    quick SDK retries, no telemetry."""
    import pytrio  # deferred: an SDK of the dev extra, absent from the vLLM environment that loads this file

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("PYTRIO_API_KEY", "PYTRIO_BASE_URL", "PYTRIO_ENV", "TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    pytrio.configure_observability(enabled=False)
    pytrio.configure(
        retry_max_attempts=1,
        control_retry_timeout_seconds=3,
        training_retry_timeout_seconds=3,
        sampling_retry_timeout_seconds=3,
    )
    return home
