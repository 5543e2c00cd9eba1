#!/usr/bin/env bash
# Build .venv-mathematics: the environment of DeepMind Mathematics' official generator
# (mathematics-dataset==1.0.1, Apache-2.0), which `retool data mathematics` runs unchanged.
# Its own pins conflict with this project's: it needs sympy 1.4 (it imports
# sympy.solvers.diophantine.base_solution_linear, moved in sympy 1.6, and its calculus modules fail on
# 1.5.1) and numpy < 1.24 (it uses np.object). retool's environment keeps its own sympy and numpy.
#   bash scripts/setup_mathematics.sh            # -> .venv-mathematics/ in this checkout
#   MATHEMATICS_VENV=DIR bash scripts/setup_mathematics.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-python3}"
VENV="${MATHEMATICS_VENV:-.venv-mathematics}"
PINS=$("$PY" -c "import ast, pathlib; src = pathlib.Path('src/retool/data/mathematics/__init__.py').read_text(); print(' '.join(next(ast.literal_eval(n.value) for n in ast.parse(src).body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'GENERATOR_PINS')))")
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q $PINS
"$VENV/bin/python" src/retool/data/mathematics/generator.py --split extrapolate --list --out /dev/null --per-module 0 >/dev/null
echo "setup_mathematics: $VENV ready ($PINS)"
