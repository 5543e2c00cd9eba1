"""The import rule, checked by reading every import in ``src/retool``: a stage imports only stages below it.

``LAYERS`` lists the stages bottom-up (``docs/ARCHITECTURE.md`` draws the same picture). A module may
import its own stage and any stage on a lower layer; stages on one layer are independent of each other.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "retool"

LAYERS: list[tuple[str, ...]] = [
    ("config", "retry"),  # the typed config; how remote calls are bounded and retried
    ("data", "protocol", "sandbox", "reward", "backends"),  # the foundations, independent of each other
    ("rollout", "components"),  # the multi-turn loop; the one assembly of a run's parts
    ("serve",),  # the PyTRIO / Tinker wire APIs over the local backend (retool serve)
    ("env",),  # the environment seam: problems and how a trajectory is scored
    ("train",),
    ("evaluate",),
    ("analyze",),
    ("view",),  # the trajectory viewer over training runs and evals
    ("tasks",),  # the embedded default (tiny model, SFT, demo) sits on top of the core
    ("cli", "__init__"),  # the command line assembles every stage's commands
    ("__main__",),  # python -m retool
]
LEVEL = {stage: level for level, stages in enumerate(LAYERS) for stage in stages}


def stage_of(module: str) -> str:
    """``retool.train.loop`` -> ``train``; ``retool.config`` -> ``config``; ``retool`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute ``retool`` import, wherever it sits in the file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "retool"]
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("retool")
        ):
            found.append((node.lineno, str(node.module)))
    return found


def violations(root: Path) -> list[str]:
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        own = stage_of(module_name(path, root))
        if own not in LEVEL:
            out.append(f"{path.relative_to(root.parent)}: stage {own!r} is not in LAYERS")
            continue
        for line, target in imported_modules(path.read_text(encoding="utf-8")):
            other = stage_of(target)
            if other == own or other == "__init__":
                continue
            if other not in LEVEL:
                out.append(f"{path.relative_to(root.parent)}:{line}: imports {target}, not in LAYERS")
            elif LEVEL[other] >= LEVEL[own]:
                where = "above" if LEVEL[other] > LEVEL[own] else "beside"
                out.append(f"{path.relative_to(root.parent)}:{line}: {own} imports {target} ({where} it)")
    return out


def test_a_stage_imports_only_stages_below_it() -> None:
    assert violations(SRC) == []


def test_the_rule_catches_upward_and_lazy_imports(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    (root / "train").mkdir(parents=True)
    (root / "rollout").mkdir()
    (root / "train" / "loop.py").write_text("def f():\n    from retool.tasks.demo import run_demo\n")
    (root / "rollout" / "engine.py").write_text("import retool.components\nfrom retool.data import Problem\n")
    (root / "magic.py").write_text("")
    found = violations(root)
    assert found == [
        "retool/magic.py: stage 'magic' is not in LAYERS",
        "retool/rollout/engine.py:1: rollout imports retool.components (beside it)",
        "retool/train/loop.py:2: train imports retool.tasks.demo (above it)",
    ]


MAX_FUNCTION_LINES = 60


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions whose body (docstring aside) runs past ``limit`` lines without saying why: their
    docstring must hold a "Long because ..." sentence."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node) or ""
            body = node.body[1:] if doc and len(node.body) > 1 else node.body
            lines = (node.end_lineno or node.lineno) - body[0].lineno + 1
            if lines > limit and "Long because" not in doc:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.name} ({lines} lines)")
    return out


def test_functions_are_short_or_say_why() -> None:
    assert long_functions(SRC) == []


def test_the_length_rule_reads_bodies_and_reasons(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    root.mkdir()
    body, short = ("".join(f"    x{i} = {i}\n" for i in range(n)) for n in (61, 60))
    (root / "m.py").write_text(
        f'def long():\n    """Does a lot."""\n{body}\n'
        f'def explained():\n    """Does a lot.\n\n    Long because it must.\n    """\n{body}\n'
        f'def short():\n    """Sixty lines is fine."""\n{short}\n'
    )
    assert long_functions(root) == ["retool/m.py:1: long (61 lines)"]
