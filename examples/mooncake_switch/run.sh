#!/usr/bin/env bash
# Run mooncake_app.py on kvpool, then (when Mooncake is installed) on Mooncake: the same script,
# only STORE_IMPL (i.e. the import line) changes.
#
#   examples/mooncake_switch/run.sh [KVPOOL_SERVER_BIN]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
bin="${1:-${KVPOOL_SERVER_BIN:-}}"
if [ -z "$bin" ]; then
    target="$(cd "$repo" && cargo metadata --format-version 1 --no-deps | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
    for p in release debug; do [ -x "$target/$p/kvpool-server" ] && bin="$target/$p/kvpool-server" && break; done
    [ -n "$bin" ] || { (cd "$repo" && cargo build -q -p kvpool-server); bin="$target/debug/kvpool-server"; }
fi
work="$(mktemp -d)"
pids=()
cleanup() { exec 3>&- 2>/dev/null || true; for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

"$bin" --data-dir "$work/kvpool" --listen 127.0.0.1:0 --metrics-listen off --dram-size 256MiB --ssd-capacity 0 \
    >"$work/kvpool.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do [ -f "$work/kvpool/endpoint.json" ] && break; sleep 0.1; done
addr="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["quic_addr"])' "$work/kvpool/endpoint.json")"
echo "== kvpool ($addr)"
STORE_IMPL=kvpool MASTER="$addr" KVPOOL_DATA_DIR="$work/kvpool" "$PYTHON" "$here/mooncake_app.py"

if "$PYTHON" -c "import mooncake.store" 2>/dev/null && command -v mooncake_master >/dev/null; then
    free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
    port=$(free_port); mport=$(free_port)
    (cd "$work" && exec mooncake_master --rpc_port="$port" --rpc_address=127.0.0.1 --metrics_port="$mport" \
        --metrics_host=127.0.0.1 --enable_http_metadata_server=false) >"$work/master.log" 2>&1 &
    pids+=($!)
    "$PYTHON" - "$port" <<'PY'
import socket, sys, time
for _ in range(300):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()
        break
    except OSError:
        time.sleep(0.1)
PY
    # A Mooncake storage node lends the segment the client's puts land in.
    # It holds its segment until its stdin closes (fd 3, closed on exit).
    mkfifo "$work/serve.in"
    "$PYTHON" "$repo/bench/peers/mooncake_driver.py" serve --master "127.0.0.1:$port" --segment $((256 << 20)) \
        <"$work/serve.in" >"$work/serve.log" 2>&1 &
    pids+=($!)
    exec 3>"$work/serve.in"
    for _ in $(seq 100); do grep -q ready "$work/serve.log" 2>/dev/null && break; sleep 0.2; done
    echo "== Mooncake (127.0.0.1:$port)"
    STORE_IMPL=mooncake MASTER="127.0.0.1:$port" "$PYTHON" "$here/mooncake_app.py"
else
    echo "== Mooncake not installed here (bench/peers/setup.sh mooncake): skipped the Mooncake run"
fi
