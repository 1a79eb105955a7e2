#!/usr/bin/env bash
# The Python client (python/): wheel build with maturin, the pytest suite against real kvpool
# servers (started by the tests), the Mooncake switch example. Called by .ci/run after the Rust
# suite (which built kvpool-server); works alone too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
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
cargo build -q -p kvpool-server --bin kvpool-server
echo "== pytest python/tests (not the slow vLLM ones)"
# From the tests folder so that `import kvpool` finds the installed wheel, not the source tree.
(cd python/tests && "$PYTHON" -m pytest -q -m "not slow")
echo "== python client: deps+wheel $((t1 - t0)) s, server build + tests $((SECONDS - t1)) s"
