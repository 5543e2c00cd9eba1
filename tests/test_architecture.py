"""The structure rules, checked by reading the source of ``src/retool``:

- the layer rule: a stage imports only stages below it. ``LAYERS`` lists the stages bottom-up
  (``docs/ARCHITECTURE.md`` draws the same picture). A module may import its own stage and any stage on a
  lower layer; stages on one layer are independent of each other.
- the circle rule: no import circle between modules, inside a stage too.
- the length rule: a function's body is at most 60 lines; at most five, named in ``UP_TO_80`` with the
  reason splitting them would hurt, run to 80; none is longer.
- the ``Any`` rule: at most ``MAX_ANY_USES`` uses of ``typing.Any`` in all of ``src/retool``.
- inside ``retool.backends``, the package rule: each package by role (``BACKEND_PACKAGES``: the interface,
  the training math, the engine, the local backend, the samplers, the remote adapters) imports only the
  packages named for it; the package's ``__init__`` (the factory) may import any.
- the seam rule: the rollout engine and the abstract environment modules (``KIND_FREE``) import no
  environment kind (``retool.env.retool``), directly or through other modules.
- the file-length rule: a source file is at most ``MAX_FILE_LINES`` lines unless its module docstring says
  why at its top (a paragraph beginning ``LONG_BECAUSE``), or it is named, with a reason, in ``LONG_FOR_NOW``.

Imports inside functions (and under ``TYPE_CHECKING``) count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "retool"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "jsonl", "child"),  # the user-facing error type; the one JSONL reader; child interpreters
    ("config", "retry"),  # the typed config; how remote calls are bounded and retried
    ("data", "protocol", "sandbox", "reward", "backends"),  # the foundations, independent of each other
    ("env", "components"),  # the environments (problems, the interaction, the reward); a run's parts
    ("rollout",),  # the scheduler: samples many environments with one policy; the trajectory record
    ("serve",),  # the PyTRIO / Tinker wire APIs over the local backend (retool serve)
    ("train",),
    ("evaluate",),
    ("export",),  # a trained model out to the formats serving engines load (HF, PEFT, GGUF), and the Hub
    ("analyze",),
    ("view",),  # the trajectory viewer over training runs and evals
    ("pipeline",),  # the generic demo pipeline (tiny model, SFT, phases, report) and the recipe interface
    ("recipes",),  # each task one folder (preset, source, held-out set, cold start) on the pipeline
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
    (root / "env").mkdir()
    (root / "train" / "loop.py").write_text("def f():\n    from retool.pipeline.demo import run_demo\n")
    (root / "env" / "retool.py").write_text("import retool.components\nfrom retool.data import Problem\n")
    (root / "magic.py").write_text("")
    found = violations(root)
    assert found == [
        "retool/env/retool.py:1: env imports retool.components (beside it)",
        "retool/magic.py: stage 'magic' is not in LAYERS",
        "retool/train/loop.py:2: train imports retool.pipeline.demo (above it)",
    ]


# -- inside retool.backends: packages by role ----------------------------------------------------------

# What each package of ``retool.backends`` may import of the others (``docs/ARCHITECTURE.md`` says why).
# ``retool.backends`` itself (the factory: ``make_training_client``) may import all of them; none of them
# imports it.
BACKEND_PACKAGES: dict[str, frozenset[str]] = {
    "interface": frozenset(),  # the clients, their data types and errors: what the other stages name
    "training": frozenset({"interface"}),  # loss math, packing, how a service reduces the loss
    "engine": frozenset({"interface"}),  # the local sampler's decoding engine and prefix cache
    "local": frozenset({"interface", "training", "engine"}),  # the in-process trainer and its samplers
    "samplers": frozenset({"interface", "training", "engine", "local"}),  # llama.cpp, vLLM, multi-LoRA
    "remote": frozenset({"interface", "training"}),  # PyTRIO / Tinker adapters and the retry guard
}


def backend_package(module: str) -> str | None:
    """``retool.backends.local.client`` -> ``local``; ``retool.backends`` -> ``__init__``; None outside."""
    parts = module.split(".")
    if parts[:2] != ["retool", "backends"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def backend_violations(root: Path) -> list[str]:
    out: list[str] = []
    for path in sorted((root / "backends").rglob("*.py")):
        own = backend_package(module_name(path, root).removesuffix(".__init__"))
        if own == "__init__":
            continue
        where = path.relative_to(root.parent)
        if own not in BACKEND_PACKAGES:
            out.append(f"{where}: package {own!r} is not in BACKEND_PACKAGES")
            continue
        for line, target in imported_modules(path.read_text(encoding="utf-8")):
            other = backend_package(target)
            if other is not None and other != own and other not in BACKEND_PACKAGES[own]:
                out.append(f"{where}:{line}: backends.{own} imports {target}")
    return out


def test_backend_packages_import_only_the_packages_named_for_them() -> None:
    assert backend_violations(SRC) == []


def test_the_backend_rule(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    for package in ("interface", "remote", "local", "odd"):
        (root / "backends" / package).mkdir(parents=True)
    (root / "backends" / "__init__.py").write_text("from retool.backends.remote import common\n")
    (root / "backends" / "interface" / "types.py").write_text("import torch\n")
    (root / "backends" / "remote" / "common.py").write_text(
        "from retool.backends.interface.types import Datum\n"
        "def f():\n    from retool.backends.local.client import LocalTrainingClient\n"
    )
    (root / "backends" / "local" / "client.py").write_text(
        "from retool.backends import make_training_client\n"
    )
    (root / "backends" / "odd" / "x.py").write_text("")
    assert backend_violations(root) == [
        "retool/backends/local/client.py:1: backends.local imports retool.backends",
        "retool/backends/odd/x.py: package 'odd' is not in BACKEND_PACKAGES",
        "retool/backends/remote/common.py:3: backends.remote imports retool.backends.local.client",
    ]


# -- import circles ------------------------------------------------------------------------------------


def module_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import}, over the modules under ``root`` (a package
    is its ``__init__``). ``from a.b import c`` points at ``a.b.c`` when that is a module, else ``a.b``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in modules else node.module for t in targets]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> Iterator[list[str]]:
    """Tarjan's algorithm, iteratively: every group of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                yield sorted(group)


def circle_in(graph: dict[str, dict[str, int]], group: list[str], root: Path) -> str:
    """The shortest circle through ``group[0]`` (breadth-first inside the group), each step with the file
    and line of its import."""
    members, start = set(group), group[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        frontier = [
            came_from.setdefault(t, here) and t
            for here in frontier
            for t in sorted(graph[here])
            if t in members and t not in came_from
        ]
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    steps = []
    for a, b in itertools.pairwise(path):
        file = a.replace(".", "/") + ".py"
        if not (root.parent / file).is_file():
            file = a.replace(".", "/") + "/__init__.py"
        steps.append(f"{a} -> {b} ({file}:{graph[a][b]})")
    return "; ".join(steps)


def import_circles(root: Path) -> dict[frozenset[str], str]:
    graph = module_graph(root)
    return {
        frozenset(group): circle_in(graph, group, root)
        for group in strongly_connected(graph)
        if len(group) > 1
    }


def test_no_import_circles() -> None:
    found = import_circles(SRC)
    assert found == {}, "import circles (function-local imports count):\n" + "\n".join(found.values())


def test_the_circle_rule_sees_lazy_imports_and_says_where(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    (root / "train").mkdir(parents=True)
    (root / "train" / "__init__.py").write_text("")
    (root / "train" / "a.py").write_text("import os\nfrom retool.train.b import g\n")
    (root / "train" / "b.py").write_text("def g():\n    from retool.train import c\n")
    (root / "train" / "c.py").write_text("def h():\n    import retool.train.a\n")
    (root / "train" / "d.py").write_text("from retool.train.a import g\n")  # into the circle, not in it
    assert import_circles(root) == {
        frozenset({"retool.train.a", "retool.train.b", "retool.train.c"}): (
            "retool.train.a -> retool.train.b (retool/train/a.py:2); "
            "retool.train.b -> retool.train.c (retool/train/b.py:2); "
            "retool.train.c -> retool.train.a (retool/train/c.py:2)"
        )
    }


# -- the environment seam -------------------------------------------------------------------------------

# Modules that know no environment kind: the rollout engine schedules any ``Env``, and the abstract
# environment modules (the seam, scoring, the problem source) name none. ``retool.env.retool`` (the ReTool
# environments) is reached from none of them, directly or through another module.
KIND_FREE = ("retool.rollout.engine", "retool.env.types", "retool.env.scoring", "retool.env.source")
ENV_KINDS = ("retool.env.retool",)


def reached_from(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through other modules."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def kind_violations(root: Path) -> list[str]:
    graph = module_graph(root)
    return [
        f"{module} reaches {kind}"
        for module in KIND_FREE
        for kind in ENV_KINDS
        if kind in reached_from(graph, module)
    ]


def test_the_engine_and_the_abstract_env_modules_import_no_environment_kind() -> None:
    assert all(module in module_graph(SRC) for module in KIND_FREE)
    assert kind_violations(SRC) == []


def test_the_seam_rule_follows_imports_through_other_modules(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    (root / "rollout").mkdir(parents=True)
    (root / "env").mkdir()
    (root / "rollout" / "engine.py").write_text("from retool.env.types import Env\n")
    (root / "env" / "types.py").write_text("def f():\n    from retool.env.helpers import g\n")
    (root / "env" / "helpers.py").write_text("import retool.env.retool\n")
    (root / "env" / "retool.py").write_text("")
    (root / "env" / "scoring.py").write_text("")
    (root / "env" / "source.py").write_text("")
    assert kind_violations(root) == [
        "retool.rollout.engine reaches retool.env.retool",
        "retool.env.types reaches retool.env.retool",
    ]


# -- function length -----------------------------------------------------------------------------------

MAX_FUNCTION_LINES = 60
MAX_EXCUSED_LINES = 80
# The few functions allowed past 60 lines (to 80 at most), each with why splitting it would hurt reading.
UP_TO_80: dict[str, str] = {}


def function_lengths(root: Path) -> dict[str, int]:
    """``file:Class.function`` -> lines of its body, docstring aside, for every function under ``root``."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, file: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body[1:] if ast.get_docstring(child) and len(child.body) > 1 else child.body
                out[f"{file}:{prefix}{child.name}"] = (child.end_lineno or child.lineno) - body[0].lineno + 1
                visit(child, file, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, file, f"{prefix}{child.name}.")
            else:
                visit(child, file, prefix)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(root.parent)), "")
    return out


def length_violations(lengths: dict[str, int], excused: dict[str, str]) -> list[str]:
    out = []
    for name, n in sorted(lengths.items()):
        limit = MAX_EXCUSED_LINES if name in excused else MAX_FUNCTION_LINES
        if n > limit:
            out.append(f"{name}: {n} lines (at most {limit})")
    out += [
        f"{name}: not in the source, or short now: remove it from the list"
        for name in sorted(excused)
        if lengths.get(name, 0) <= MAX_FUNCTION_LINES
    ]
    return out


def test_functions_are_short() -> None:
    assert len(UP_TO_80) <= 5 and all(reason.strip() for reason in UP_TO_80.values())
    assert length_violations(function_lengths(SRC), UP_TO_80) == []


def test_the_length_rule_reads_bodies_and_allows_only_the_named(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    root.mkdir()
    body = {n: "".join(f"    x{i} = {i}\n" for i in range(n)) for n in (60, 61, 80, 81)}
    (root / "m.py").write_text(
        f'def long():\n    """Does a lot.\n\n    Long because it must.\n    """\n{body[61]}\n'
        f'def short():\n    """Sixty lines is fine."""\n{body[60]}\n'
        f"def excused():\n{body[80]}\n"
        f"def too_long():\n{body[81]}\n"
        f"class C:\n    def method(self):\n{body[61].replace('    ', '        ')}\n"
    )
    lengths = function_lengths(root)
    assert lengths["retool/m.py:short"] == 60 and lengths["retool/m.py:C.method"] == 61
    excused = {"retool/m.py:excused": "why", "retool/m.py:too_long": "why", "retool/m.py:short": "why"}
    assert length_violations(lengths, excused) == [
        "retool/m.py:C.method: 61 lines (at most 60)",
        "retool/m.py:long: 61 lines (at most 60)",  # a docstring that explains is not a reason
        "retool/m.py:too_long: 81 lines (at most 80)",
        "retool/m.py:short: not in the source, or short now: remove it from the list",
    ]


# -- deferred imports ----------------------------------------------------------------------------------


def unexplained_deferred_imports(root: Path) -> dict[str, list[int]]:
    """file -> lines of function-local imports with no reason: a deferred import (of a heavy or optional
    package) carries a ``#`` comment on its line, on an import line right above it in the same run, or
    on a comment line right above that run."""
    out: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                first = node.lineno
                while first > 1 and lines[first - 2].strip().startswith(("import ", "from ")):
                    first -= 1  # a run of imports shares the reason given on one of them
                if first > 1 and lines[first - 2].strip().startswith("#"):
                    first -= 1  # or on a comment line right above the run
                run = lines[first - 1 : (node.end_lineno or node.lineno)]
                if not any("#" in line for line in run):
                    out.setdefault(str(path.relative_to(root.parent)), []).append(node.lineno)
    return out


def test_deferred_imports_say_why() -> None:
    found = unexplained_deferred_imports(SRC)
    assert found == {}, "function-local imports without a reason comment (file -> lines)"


def test_the_deferred_import_rule(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    root.mkdir()
    (root / "m.py").write_text(
        "import os\n\n"
        "def plain():\n    import json\n\n"
        "def explained():\n    import torch  # deferred: torch (~2 s)\n    import numpy as np\n\n"
        "def apart():\n    import torch  # deferred: torch\n    x = 1\n    import gguf\n\n"
        "def above():\n    # deferred: gguf is optional\n    import gguf\n"
    )
    assert unexplained_deferred_imports(root) == {"retool/m.py": [4, 13]}


# -- the Any rule ----------------------------------------------------------------------------------------

# Uses of ``typing.Any`` in src/retool: 320 before issue 21's typing pass, 77 after it; 163 once the serve
# and prefix-cache branches merged, 65 after the second pass (`types2`: the serve wire layers on
# ``retool.jsonl.JsonObject``, the local client and the generation engine on torch / DynamicCache types;
# 21 of them left in backends/remote.py, now backends/remote/common.py). Records, rows and summaries are TypedDicts or JSON types
# (``retool.jsonl.JsonValue``), values that only pass through are ``object``: new code does the same, so
# the count may only go down.
MAX_ANY_USES = 100


def any_uses(root: Path) -> dict[str, int]:
    """Uses of ``Any`` per file: a name ``Any`` or an attribute ``x.Any`` (the import itself not counted)."""
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        n = sum(
            1
            for node in ast.walk(tree)
            if (isinstance(node, ast.Name) and node.id == "Any")
            or (isinstance(node, ast.Attribute) and node.attr == "Any")
        )
        if n:
            out[str(path.relative_to(root.parent))] = n
    return out


def test_any_is_rare() -> None:
    uses = any_uses(SRC)
    most = sorted(uses.items(), key=lambda item: -item[1])[:8]
    assert sum(uses.values()) <= MAX_ANY_USES, f"{sum(uses.values())} uses of Any; most in {most}"


def test_the_any_rule_counts_names_and_attributes(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    root.mkdir()
    (root / "m.py").write_text(
        "import typing\nfrom typing import Any\n\n"
        "def f(x: Any, y: typing.Any) -> dict[str, Any]:\n    return {}\n\n"
        "def g(x: object) -> None:\n    pass\n"
    )
    (root / "clean.py").write_text("def h(x: int) -> int:\n    return x\n")
    assert any_uses(root) == {"retool/m.py": 3}


# -- file length -----------------------------------------------------------------------------------------

MAX_FILE_LINES = 600
# How a longer module says why at its top: a paragraph of its docstring beginning so.
LONG_BECAUSE = "Long because"
# Files allowed past MAX_FILE_LINES without saying why at their top, each with the reason (the work that
# will shorten it, or why it may stay).
LONG_FOR_NOW: dict[str, str] = {
    "retool/train/loop.py": "issue 51 item 3 reshapes the step (loop.py + sampling.py + step.py)",
    "retool/view/site.py": "finding the inputs (discover, RunInput, Inputs) can move to its own module",
}


def says_why_long(docstring: str) -> bool:
    """Whether a paragraph of ``docstring`` begins with ``LONG_BECAUSE``."""
    return any(part.strip().startswith(LONG_BECAUSE) for part in docstring.split("\n\n"))


def long_file_violations(root: Path, excused: dict[str, str]) -> list[str]:
    """Files under ``root`` over ``MAX_FILE_LINES`` lines whose module docstring has no paragraph beginning
    ``LONG_BECAUSE`` and that ``excused`` does not name; and names in ``excused`` that need no excuse."""
    out = []
    long_files = set()
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root.parent))
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= MAX_FILE_LINES:
            continue
        long_files.add(name)
        if name not in excused and not says_why_long(ast.get_docstring(ast.parse(text)) or ""):
            out.append(
                f"{name}: {lines} lines (at most {MAX_FILE_LINES}, or a docstring paragraph "
                f"'{LONG_BECAUSE} ...', or a reason in LONG_FOR_NOW)"
            )
    out += [
        f"{name}: not in the source, or short now: remove it from the list"
        for name in sorted(excused)
        if name not in long_files
    ]
    return out


def test_long_files_say_why_at_their_top() -> None:
    assert all(reason.strip() for reason in LONG_FOR_NOW.values())
    assert long_file_violations(SRC, LONG_FOR_NOW) == []


def test_the_file_length_rule_reads_the_module_docstring(tmp_path: Path) -> None:
    root = tmp_path / "retool"
    root.mkdir()
    body = "".join(f"x{i} = {i}\n" for i in range(MAX_FILE_LINES))
    (root / "short.py").write_text('"""At the limit, not over it."""\n' + body.split("\n", 1)[1])
    (root / "said.py").write_text(
        '"""A parser.\n\nLong because the grammar\'s rules refer to each other."""\n' + body
    )
    (root / "unsaid.py").write_text('"""A parser of many parts."""\n' + body)
    (root / "midway.py").write_text('"""A parser. Long because it is."""\n' + body)  # not a paragraph's start
    (root / "comment.py").write_text('"""A parser."""\n# Long because: said in a comment only\n' + body)
    (root / "excused.py").write_text("# long, and named in the list\n" + body)
    excused = {"retool/excused.py": "temporary", "retool/short.py": "why", "retool/gone.py": "why"}
    assert len((root / "short.py").read_text().splitlines()) == MAX_FILE_LINES
    why = f"(at most {MAX_FILE_LINES}, or a docstring paragraph 'Long because ...', or a reason in LONG_FOR_NOW)"
    assert long_file_violations(root, excused) == [
        f"retool/comment.py: {MAX_FILE_LINES + 2} lines {why}",
        f"retool/midway.py: {MAX_FILE_LINES + 1} lines {why}",
        f"retool/unsaid.py: {MAX_FILE_LINES + 1} lines {why}",
        "retool/gone.py: not in the source, or short now: remove it from the list",
        "retool/short.py: not in the source, or short now: remove it from the list",
    ]
