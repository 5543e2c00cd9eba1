"""``retool data fetch NAME``: a dataset from the Hugging Face Hub (or a local copy) into the data folder.

The data folder (``retool.data.paths``: ``--data-dir``, else ``$RETOOL_DATA_DIR``, else the user cache) is
where every command that reads a dataset by name looks, under the file names listed in ``FETCHABLE``: the
named evaluation sets (``aime2024.jsonl`` ...), GSM8K's two splits, DAPO (also prepared into ``dapo/``, as
``retool prepare dapo`` would) and DeepMind Mathematics.

From the Hub each split is read through ``datasets`` and written as JSONL, one row a line with the Hub's
own columns (the readers know each set's column names). ``--from DIR`` imports a local copy instead: the
same file names, copied as they are. Either way a file is written whole or not at all (a temporary file,
then a rename), and a failed download is one line naming the dataset, the address tried and ``--from``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from retool.data.dapo import DAPO_HUB_ID, prepare_dapo
from retool.data.evalsets import NAMED_SETS
from retool.data.paths import data_dir as resolve_data_dir
from retool.data.readers import DataError

logger = logging.getLogger(__name__)

HUB_URL = "https://huggingface.co/datasets/{hub_id}"


@dataclass(frozen=True)
class DataFile:
    """One file of a dataset in the data folder: its name, the Hub split it is written from, and the other
    names a local copy may carry (``--from``)."""

    name: str
    split: str
    also: tuple[str, ...] = ()
    required: bool = True  # a local copy without it is refused (else it is skipped)


@dataclass(frozen=True)
class FetchSpec:
    hub_id: str
    config: str | None
    files: tuple[DataFile, ...]
    about: str
    prepare_dapo: bool = False  # also write <data>/dapo/{train,dev}.jsonl


FETCHABLE: dict[str, FetchSpec] = {
    "gsm8k": FetchSpec(
        "openai/gsm8k",
        "main",
        (DataFile("gsm8k_train.jsonl", "train"), DataFile("gsm8k_test.jsonl", "test")),
        "GSM8K train and test (MIT)",
    ),
    "math500": FetchSpec(
        NAMED_SETS["math500"].hub_id, None, (DataFile("math500.jsonl", "test"),), "MATH-500 (MIT)"
    ),
    "aime2024": FetchSpec(
        NAMED_SETS["aime2024"].hub_id, None, (DataFile("aime2024.jsonl", "train"),), "AIME 2024 problems"
    ),
    "aime2025": FetchSpec(
        NAMED_SETS["aime2025"].hub_id, None, (DataFile("aime2025.jsonl", "test"),), "AIME 2025 problems"
    ),
    "dapo": FetchSpec(
        DAPO_HUB_ID,
        None,
        (DataFile("dapo_math_17k.jsonl", "train", also=("dapo_math_sample.jsonl",)),),
        "DAPO-Math-17k (Apache-2.0), prepared into dapo/",
        prepare_dapo=True,
    ),
    # The Hub copy has one module per config and its test split is the interpolation set; `retool data
    # mathematics` generates the dataset locally (train, interpolate and extrapolate).
    "mathematics": FetchSpec(
        "deepmind/math_dataset",
        "algebra__linear_1d",
        (
            DataFile("mathematics_train.jsonl", "train"),
            DataFile("mathematics_interpolate.jsonl", "test"),
            DataFile("mathematics_extrapolate.jsonl", "extrapolate", required=False),
        ),
        "DeepMind Mathematics (Apache-2.0), one module",
    ),
}

# Reads one split of a Hub dataset: (hub_id, config, split) -> rows. Tests give their own.
Loader = Callable[[str, "str | None", str], Iterable[dict[str, object]]]


@dataclass
class FetchResult:
    name: str
    folder: Path
    source: str  # the Hub address or the local folder
    files: dict[str, int]  # file name -> rows written
    prepared: Path | None = None


def spec_of(name: str) -> FetchSpec:
    spec = FETCHABLE.get(name.lower())
    if spec is None:
        raise DataError(f"no dataset named {name!r} to fetch; one of: {', '.join(FETCHABLE)}")
    return spec


def hub_loader(hub_id: str, config: str | None, split: str) -> Iterable[dict[str, object]]:
    """One split of a Hub dataset through ``datasets`` (its own cache under ``~/.cache/huggingface``).

    The dataset's page is asked for first, without retries: offline, that fails at once, where the
    download itself would retry for half a minute and log each try."""
    try:
        import datasets  # deferred: datasets is heavy, and --from never needs it
        import huggingface_hub  # deferred: as datasets (its dependency)
    except ImportError:
        raise DataError(
            "retool data fetch needs the datasets package: pip install 'retool-rl[hub]' (or use --from DIR)"
        ) from None
    huggingface_hub.HfApi().dataset_info(hub_id, timeout=30)
    return datasets.load_dataset(hub_id, config, split=split)


def _rows_lines(rows: Iterable[dict[str, object]], dedupe: bool) -> Iterable[str]:
    seen: set[str] = set()
    for row in rows:
        line = json.dumps(dict(row), ensure_ascii=False, default=str)
        if dedupe:
            if line in seen:
                continue
            seen.add(line)
        yield line


def _write_whole(path: Path, lines: Iterable[str]) -> int:
    """``lines`` into ``path`` through a temporary file: a failure leaves no partial file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line + "\n")
                n += 1
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def _from_hub(name: str, spec: FetchSpec, folder: Path, loader: Loader, config: str | None) -> dict[str, int]:
    url = HUB_URL.format(hub_id=spec.hub_id)
    written: dict[str, int] = {}
    for file in spec.files:
        if not file.required:
            continue  # not on the Hub (the generator writes it)
        try:
            # The Hub's DAPO-Math-17k holds each row many times over: one copy of each is kept.
            written[file.name] = _write_whole(
                folder / file.name,
                _rows_lines(loader(spec.hub_id, config, file.split), spec.prepare_dapo),
            )
        except DataError:
            raise
        except Exception as exc:  # offline, no such repo or split: all mean "not from the Hub, not now"
            raise DataError(
                f"cannot fetch {name}: {url} (split {file.split}) failed ({type(exc).__name__}); "
                f"offline, import a local copy with `retool data fetch {name} --from DIR`"
            ) from exc
    return written


def _count_lines(path: Path) -> int:
    with path.open(encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


def _from_local(name: str, spec: FetchSpec, source: Path, folder: Path) -> dict[str, int]:
    if not source.is_dir():
        raise DataError(f"--from {source}: no such folder")
    written: dict[str, int] = {}
    for file in spec.files:
        found = next((source / n for n in (file.name, *file.also) if (source / n).is_file()), None)
        if found is None:
            if file.required:
                names = " or ".join((file.name, *file.also))
                raise DataError(f"--from {source}: {name} needs {names} there")
            continue
        target = folder / found.name
        if found.resolve() != target.resolve():
            folder.mkdir(parents=True, exist_ok=True)
            part = target.with_name(target.name + ".part")
            shutil.copyfile(found, part)
            part.replace(target)
        written[found.name] = _count_lines(target)
    return written


def fetch_dataset(
    name: str,
    *,
    data_dir: str | Path | None = None,
    source: str | Path | None = None,
    loader: Loader | None = None,
    config: str | None = None,
) -> FetchResult:
    """Fetch ``name`` into the data folder: from ``source`` (a local folder) when given, else the Hub
    (``config``: the Hub dataset's configuration, default the spec's: for ``mathematics``, the module)."""
    spec = spec_of(name)
    key = name.lower()
    folder = resolve_data_dir(data_dir)
    if source is not None:
        files = _from_local(key, spec, Path(source), folder)
        origin = str(source)
    else:
        files = _from_hub(key, spec, folder, loader or hub_loader, config or spec.config)
        origin = HUB_URL.format(hub_id=spec.hub_id)
    result = FetchResult(key, folder, origin, files)
    if spec.prepare_dapo:
        raw = folder / next(iter(files))
        prepare_dapo(raw, folder / "dapo")
        result.prepared = folder / "dapo"
    logger.info("fetched %s from %s into %s: %s", key, origin, folder, files)
    return result
