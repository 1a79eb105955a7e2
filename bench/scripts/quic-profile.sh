#!/usr/bin/env bash
# Where QUIC's cycles go across hosts: a system-wide cpu-clock profile of one `kvpool-bench
# throughput --hosts` run (QUIC only), bucketed into cost categories per side.
#
#   sudo flock /work/bench.lock bench/scripts/quic-profile.sh BIN_DIR OUT_DIR [bench args]
#   sudo bench/scripts/quic-profile.sh target/release /tmp/qp --mtus 1500 \
#       --sizes 1MiB,4MiB --batches 16 --concurrency 1 --budget 1GiB
#
# BIN_DIR holds kvpool-bench and kvpool-server. Prints the bucket table (shares, and CPU-ns per
# payload byte from the bytes the bench's rows moved); keeps perf.data, the script and the
# bench's output in OUT_DIR. Needs root (namespaces) and `perf`; samples at 499 Hz on
# cpu-clock (no hardware counters in a VM). Samples of other processes (builds beside the run)
# are left out; the server's start (prefaulting its DRAM tier) is too.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BIN_DIR OUT_DIR [kvpool-bench throughput args]" >&2; exit 2; }
BIN=$1; OUT=$2; shift 2
mkdir -p "$OUT"
perf record -a -g -F 499 -e cpu-clock -o "$OUT/perf.data" -- \
    "$BIN/kvpool-bench" throughput --hosts --offloads nic --targets kvpool --lookups 10 "$@" \
    > "$OUT/bench.txt" 2> "$OUT/perf.err"
perf script -i "$OUT/perf.data" -F comm,pid,tid,ip,sym,dso 2>/dev/null > "$OUT/perf.script"
# Payload bytes: ops x batch x block size of every kvpool row (put and get).
bytes=$(awk '$1 == "kvpool" { s = $2; m = (s ~ /MiB$/) ? 1048576 : (s ~ /KiB$/ ? 1024 : 1); sub(/[KM]iB$/, "", s); t += s * m * $3 * $6 } END { printf "%.0f", t }' "$OUT/bench.txt")
grep -E '^(kvpool|udp|quic)' "$OUT/bench.txt" || true
python3 "$(dirname "$0")/quic_profile_cats.py" "$OUT/perf.script" 499 "$bytes" | tee "$OUT/cats.md"
