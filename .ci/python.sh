#!/usr/bin/env bash
# The Python client (python/): wheel build with maturin, the pytest suite against real kvpool
# servers (started by the tests), the Mooncake switch example run on kvpool and on Mooncake.
# Called by .ci/run after the Rust suite (which built kvpool-server); works alone too. Mooncake
# is required (bench/peers/setup.sh mooncake), never skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export KVPOOL_REQUIRE_PEERS="${KVPOOL_REQUIRE_PEERS:-1}"
pip=("$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore)
t0=$SECONDS
"${pip[@]}" "maturin>=1.9,<2" pytest numpy
target="$(cargo metadata --format-version 1 --no-deps | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
wheels="$target/kvpool-wheels"
rm -rf "$wheels"
echo "== wheel (maturin, release): pip wheel ./python"
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps ./python -w "$wheels"
"${pip[@]}" --force-reinstall --no-deps "$wheels"/kvpool-*.whl
t1=$SECONDS
# The server the tests start: this tree's debug build (the one scripts/test.sh built), never a
# stale binary from another profile; beside it the stand-in device runtimes' carrier, which
# test_device_memory.py asks for the CUDA and ACL stand-ins.
cargo build -q -p kvpool-server --bin kvpool-server -p kvpool-devmem --bin kvpool-devmem-standin
export KVPOOL_SERVER_BIN="$target/debug/kvpool-server"
t2=$SECONDS
echo "== pytest python/tests (the slow vLLM ones are deselected here: .ci/vllm-e2e.sh runs them)"
# From the tests folder so that `import kvpool` finds the installed wheel, not the source tree.
(cd python/tests && "$PYTHON" -m pytest -q -rs -m "not slow and not vllm")
echo "== python client: deps+wheel $((t1 - t0)) s, server build $((t2 - t1)) s, tests $((SECONDS - t2)) s"
