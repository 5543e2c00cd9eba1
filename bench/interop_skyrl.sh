#!/usr/bin/env bash
# Interop check: this project's Tinker adapter against SkyRL's self-hosted Tinker API server.
#
# Builds SkyRL's server in a venv of its own (SkyRL 0.4.0 needs Python >= 3.12; ~6 GB), starts it on
# 127.0.0.1 with the JAX backend on CPU and a small Qwen3 model built here, and runs, through the tinker
# SDK and this project's adapter: a fixed-batch comparison with the local backend and `retool serve`,
# `retool train` for a few steps on all three, a SIGKILL of the SkyRL trainer and a `--resume`, and
# `retool eval` on the saved weights (bench/interop_skyrl.py does the runs and prints the tables).
# Not a CI test: it takes minutes and gigabytes. Exit status 0 when every check passes.
#
# Usage: bench/interop_skyrl.sh [WORK_DIR]          (default runs/interop_skyrl, git-ignored)
# Environment:
#   SKYRL_VENV    the SkyRL venv (default runs/skyrl-0.4.0-venv; reused when it already has skyrl 0.4.0)
#   SKYRL_PYTHON  a Python >= 3.12 for it (default: python3.12, 3.13, 3.14, else pyenv's 3.12-3.14)
#   SKYRL_PORT    the server's port on 127.0.0.1 (default: a free one)
#   PYTHON        this project's Python (default: python)
#   SFT_STEPS     cold-start SFT steps for the model (default 300)
#   WRITE         set (WRITE=1): also write the tables to docs/results/interop_skyrl.md (bench/_results.py)
#
# SkyRL's own gaps, worked around here only (nothing of this is in the project's code):
#   1. skyrl 0.4.0 starts its engine as `uv run <flags> -m skyrl.tinker.engine ...`, the flags parsed
#      from the API server's parent command line: without uv that is a FileNotFoundError. A `uv` on PATH
#      that runs this venv's python on what follows `-m` (as a child, so the API server's parent reads
#      `uv run python ...`) stands in.
#   2. skyrl 0.4.0 imports aiohttp without declaring it: installed explicitly.
#   3. skyrl 0.4.0's /api/v1/asample answer has no `sample_sequence_ids`, which tinker >= 0.38 asserts
#      on ("asample promises always carry sample_sequence_ids"): the server is started by a launcher
#      that adds them (an ASGI middleware) and otherwise runs skyrl.tinker.api's own __main__ code.
#   4. skyrl 0.4.0's --host defaults to 0.0.0.0: passed 127.0.0.1.
#   5. peft==0.18.1 (a skyrl 0.4.0 dependency) pulls a CUDA torch and ~3 GB of NVIDIA wheels unless a
#      torch is installed first: torch 2.13.0 CPU from download.pytorch.org when reachable, else the
#      torch 2.13.0 the configured index has (on this machine's local index that is the default build,
#      whose NVIDIA wheels then come too).
# The adapter's own handling of SkyRL (per-sequence-mean reduction, resume, unload on close, the missing
# session-finish endpoint) is in src/retool/backends/remote/tinker.py and training/reduction.py.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mkdir -p "${1:-$REPO/runs/interop_skyrl}" && cd "${1:-$REPO/runs/interop_skyrl}" && pwd)"
SKYRL_VERSION=0.4.0
TORCH_VERSION=2.13.0
VENV="${SKYRL_VENV:-$REPO/runs/skyrl-$SKYRL_VERSION-venv}"
PY="${PYTHON:-python}"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's retool
START=$(date +%s)
say() { echo "[interop $(date +%H:%M:%S)] $*"; }

# -- 1. SkyRL's venv --------------------------------------------------------------------------------------
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('skyrl') != '$SKYRL_VERSION')" 2>/dev/null; then
    PY312=""
    # The first that runs and is >= 3.12 (a pyenv shim for a version not selected exists but fails).
    for candidate in ${SKYRL_PYTHON:-} python3.12 python3.13 python3.14 "$HOME"/.pyenv/versions/3.1[234]*/bin/python; do
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then PY312="$candidate"; break; fi
    done
    [ -n "$PY312" ] || { echo "SkyRL $SKYRL_VERSION needs Python >= 3.12 (none found); set SKYRL_PYTHON" >&2; exit 2; }
    say "building SkyRL $SKYRL_VERSION's venv in $VENV with $("$PY312" --version)"
    t0=$(date +%s)
    "$PY312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if ! "$VENV/bin/python" -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
        say "download.pytorch.org unreachable: torch $TORCH_VERSION from the configured index instead (gap 5)"
        "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    fi
    "$VENV/bin/python" -m pip install -q "skyrl[tinker,jax]==$SKYRL_VERSION" aiohttp
    say "venv built in $(( $(date +%s) - t0 )) s, $(du -sh "$VENV" | cut -f1)"
fi
say "SkyRL venv: $VENV ($("$VENV/bin/python" -c "import importlib.metadata as m; print('skyrl', m.version('skyrl'), 'jax', m.version('jax'), 'tinker', m.version('tinker'))"))"

# -- 2. the workarounds (gaps 1 and 3) ---------------------------------------------------------------------
SHIM="$WORK/shim"
mkdir -p "$SHIM/bin"
cat > "$SHIM/bin/uv" <<EOF
#!/usr/bin/env bash
# Stand-in for \`uv run\` (gap 1): drop uv's own arguments, run "-m MODULE ..." or "python ARGS" with
# SkyRL's venv python, as a child process.
while [ \$# -gt 0 ]; do
    case "\$1" in
        -m) break ;;
        python) shift; break ;;
        *) shift ;;
    esac
done
"$VENV/bin/python" "\$@"
EOF
chmod +x "$SHIM/bin/uv"
cat > "$SHIM/skyrl_launch.py" <<'EOF'
"""skyrl.tinker.api's __main__ (skyrl 0.4.0), plus sample_sequence_ids on /api/v1/asample answers (gap 3)."""
import argparse
import json
import uuid

import uvicorn
from skyrl.tinker import api


class SequenceIds:
    """ASGI middleware: one id per requested sample in the future /asample promises."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/api/v1/asample":
            return await self.app(scope, receive, send)
        chunks = []

        async def receive_body():
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        held = []

        async def hold(message):
            held.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                start, body = held[0], b"".join(m.get("body", b"") for m in held[1:])
                try:
                    data = json.loads(body)
                    n = int(json.loads(b"".join(chunks) or b"{}").get("num_samples", 1))
                    if isinstance(data, dict) and "request_id" in data and "sample_sequence_ids" not in data:
                        data["sample_sequence_ids"] = [f"seq-{uuid.uuid4().hex[:12]}" for _ in range(n)]
                        body = json.dumps(data).encode()
                except ValueError:
                    pass
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})

        return await self.app(scope, receive_body, hold)


parser = argparse.ArgumentParser(description="SkyRL tinker API server")
api.add_model(parser, api.EngineConfig)
parser.add_argument("--host", type=str, default="127.0.0.1")
parser.add_argument("--port", type=int, default=8000)
args = parser.parse_args()
api.app.state.engine_config = api.EngineConfig.model_validate(
    {k: v for k, v in vars(args).items() if k in api.EngineConfig.model_fields}
)
api.app.add_middleware(SequenceIds)
uvicorn.run(
    api.app,
    host=args.host,
    port=args.port,
    log_config=api.get_uvicorn_log_config(),
    backlog=api.SKYRL_HTTP_CONNECTION_LIMIT,
    timeout_keep_alive=api.HTTP_KEEP_ALIVE_TIMEOUT_SECONDS,
)
EOF

# -- 3. the model --------------------------------------------------------------------------------------------
say "building the model (Qwen3 twin of the demo model, ${SFT_STEPS:-300} SFT steps)"
MODEL="$("$PY" "$REPO/bench/interop_skyrl.py" model "$WORK" --sft-steps "${SFT_STEPS:-300}" | tail -1)"

# -- 4. SkyRL's server on 127.0.0.1 ---------------------------------------------------------------------------
PORT="${SKYRL_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
rm -rf "$WORK/skyrl_ckpt" "$WORK/skyrl.sqlite"
say "starting SkyRL on 127.0.0.1:$PORT (log: $WORK/skyrl.log)"
(
    cd "$WORK"
    export PATH="$SHIM/bin:$PATH" JAX_PLATFORMS=cpu
    exec setsid uv run python "$SHIM/skyrl_launch.py" --base-model "$MODEL" --backend jax \
        --host 127.0.0.1 --port "$PORT" --checkpoints-base "$WORK/skyrl_ckpt" \
        --database-url "sqlite:///$WORK/skyrl.sqlite" \
        --backend-config '{"max_lora_rank": 32, "max_lora_adapters": 8, "train_micro_batch_size": 16, "sample_max_num_sequences": 16}'
) > "$WORK/skyrl.log" 2>&1 &
SERVER=$!
stop_server() {
    # setsid made the wrapper a group leader: its python and SkyRL's engine go with the group.
    kill -TERM -- "-$SERVER" 2>/dev/null || true
    sleep 2
    kill -KILL -- "-$SERVER" 2>/dev/null || true
}
trap stop_server EXIT

# -- 5. the runs and the tables ------------------------------------------------------------------------------
status=0
"$PY" "$REPO/bench/interop_skyrl.py" run "$WORK" --skyrl "http://127.0.0.1:$PORT" --model "$MODEL" \
    --server-pid "$SERVER" ${WRITE:+--write} || status=$?
say "interop_skyrl.sh: $(( $(date +%s) - START )) s in all (exit $status)"
exit $status
