#!/usr/bin/env bash
# Deterministic costs of the TCP bulk channel on loopback (issue 34): for each op and value
# size, a fixed transfer (`kvpool-bench bulk-cost`) to a fresh kvpool-server, counted four ways
# over exactly the measured requests:
#   copies   user-space bytes copied (memcpy/memmove, LD_PRELOAD copycount.so) per payload byte
#   syscalls system calls and context switches per request (perf stat tracepoints, no ptrace)
#   ir       instructions per byte and per request (callgrind), the server and the client each
#            measured in a run of its own (the other side runs natively)
# usage: bulk-cost.sh BIN_DIR OUT_DIR [tls|tcp] [modes] [sizes] [ops]
#   BIN_DIR holds kvpool-server and kvpool-bench (release); defaults: tls, "copies syscalls ir",
#   "64KiB 256KiB 1MiB 4MiB", "put get". BATCH (default 1) values per request.
set -euo pipefail
BIN=$(realpath "$1"); OUT=$(realpath -m "$2"); CHANNEL=${3:-tls}
MODES=${4:-copies syscalls ir}; SIZES=${5:-64KiB 256KiB 1MiB 4MiB}; OPS=${6:-put get}
BATCH=${BATCH:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
SO="$OUT/copycount.so"
[ -f "$SO" ] || cc -O2 -shared -fPIC -o "$SO" "$HERE/copycount.c" -ldl

# Measured bytes per run: native runs move 64 MiB, callgrind runs 16 MiB (4 requests at least).
requests() { # size bytes-per-run
    local b; b=$(numfmt --from=iec-i "${1%B}")
    echo $(( ($2 / (b * BATCH)) > 4 ? $2 / (b * BATCH) : 4 ))
}

SPID=""; DIR=""
start_server() { # prefix-command...
    DIR=$(mktemp -d /tmp/kvpool-bulk-cost.XXXXXX)
    local extra=()
    [ "$CHANNEL" = tcp ] && extra=(--bulk-trusted-networks 127.0.0.0/8)
    "$@" "$BIN/kvpool-server" --data-dir "$DIR" --listen 127.0.0.1:0 --metrics-listen off \
        --dram-size 1GiB --ssd-capacity 0 "${extra[@]}" >"$DIR/server.log" 2>&1 &
    SPID=$!
    for _ in $(seq 600); do [ -f "$DIR/endpoint.json" ] && return 0; sleep 0.1; done
    echo "server did not start: $(tail -5 "$DIR/server.log")" >&2; exit 1
}
stop_server() { kill "$SPID" 2>/dev/null || true; wait "$SPID" 2>/dev/null || true; rm -rf "$DIR"; }
trap stop_server EXIT

drive() { # op size requests [prefix-command...] -- extra bulk-cost args
    local op=$1 size=$2 n=$3; shift 3
    local pre=(); while [ "$1" != -- ]; do pre+=("$1"); shift; done; shift
    "${pre[@]}" "$BIN/kvpool-bench" bulk-cost --data-dir "$DIR" --channel "$CHANNEL" --op "$op" \
        --size "$size" --batch "$BATCH" --requests "$n" "$@"
}

for mode in $MODES; do for size in $SIZES; do for op in $OPS; do
    tag="$CHANNEL-$op-$size-x$BATCH"
    case $mode in
    copies)
        n=$(requests "$size" $((64 << 20)))
        CC="$OUT/cc-$tag"; rm -rf "$CC"; mkdir -p "$CC"
        start_server env COPYCOUNT_DIR="$CC" LD_PRELOAD="$SO"
        snap='for f in '"$CC"'/copycount.'"$SPID"' '"$CC"'/copycount.$KVPOOL_BENCH_PID; do echo $(od -A n -t u8 -N 24 $f); done'
        line=$(drive "$op" "$size" "$n" env COPYCOUNT_DIR="$CC" LD_PRELOAD="$SO" -- \
            --before "$snap > $CC/before" --after "$snap > $CC/after" | grep '^bulk-cost')
        bytes=$(sed 's/.*bytes=\([0-9]*\).*/\1/' <<<"$line")
        python3 - "$CC" "$bytes" "$n" "$tag" <<'PY' | tee -a "$OUT/copies.txt"
import sys
d, payload, n, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
b = [list(map(int, l.split())) for l in open(d + "/before")]
a = [list(map(int, l.split())) for l in open(d + "/after")]
s = [x - y for x, y in zip(a[0], b[0])]; c = [x - y for x, y in zip(a[1], b[1])]
print(f"{tag}: copies per payload byte: server {s[0]/payload:.3f} (copies >= 1 KiB: {s[1]/payload:.3f}, {s[2]/n:.1f} per request), client {c[0]/payload:.3f} ({c[1]/payload:.3f}, {c[2]/n:.1f} per request)")
PY
        stop_server ;;
    syscalls)
        n=$(requests "$size" $((64 << 20)))
        ev=raw_syscalls:sys_enter,syscalls:sys_enter_read,syscalls:sys_enter_readv,syscalls:sys_enter_recvfrom,syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_sendto,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_recvmsg,syscalls:sys_enter_sendmsg,syscalls:sys_enter_sched_yield,context-switches
        start_server
        P="$OUT/perf-$tag"
        before="perf stat -x, -o $P.server -e $ev -p $SPID & echo \$! > $P.pids; perf stat -x, -o $P.client -e $ev -p \$KVPOOL_BENCH_PID & echo \$! >> $P.pids; sleep 1"
        after="kill -INT \$(cat $P.pids); sleep 1"
        drive "$op" "$size" "$n" -- --before "$before" --after "$after" >/dev/null
        python3 - "$P" "$n" "$tag" <<'PY' | tee -a "$OUT/syscalls.txt"
import sys
p, n, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def read(f):
    out = {}
    for l in open(f):
        parts = l.strip().split(",")
        if len(parts) > 2 and parts[0].replace(".", "").isdigit():
            out[parts[2].split(":")[-1].replace("sys_enter_", "")] = float(parts[0])
    return out
for side in ["server", "client"]:
    c = read(f"{p}.{side}")
    rd = sum(c.get(k, 0) for k in ["read", "readv", "recvfrom"]); wr = sum(c.get(k, 0) for k in ["write", "writev", "sendto"])
    udp = c.get('recvmsg', 0) + c.get('sendmsg', 0)
    print(f"{tag} {side}: per request: syscalls {c.get('sys_enter', 0)/n:.1f} (reads {rd/n:.1f}, writes {wr/n:.1f}, epoll_wait {c.get('epoll_wait', 0)/n:.1f}, futex {c.get('futex', 0)/n:.1f}, sched_yield {c.get('sched_yield', 0)/n:.1f}, QUIC sendmsg/recvmsg {udp/n:.1f}), context switches {c.get('context-switches', 0)/n:.1f}")
PY
        stop_server ;;
    ir)
        n=$(requests "$size" $((16 << 20)))
        vg=(valgrind --tool=callgrind --dump-instr=no)
        for side in server client; do
            CG="$OUT/cg-$tag-$side"; rm -rf "$CG"; mkdir -p "$CG"
            if [ $side = server ]; then
                start_server "${vg[@]}" --callgrind-out-file="$CG/out.%p"
                zero="callgrind_control -z $SPID >/dev/null"; dump="callgrind_control -d $SPID >/dev/null"
                drive "$op" "$size" "$n" -- --before "$zero" --after "$dump" >/dev/null
            else
                start_server
                drive "$op" "$size" "$n" "${vg[@]}" --callgrind-out-file="$CG/out.%p" -- \
                    --before 'callgrind_control -z $KVPOOL_BENCH_PID >/dev/null' \
                    --after 'callgrind_control -d $KVPOOL_BENCH_PID >/dev/null' >/dev/null 2>"$CG/valgrind.log"
            fi
            stop_server
            f=$(ls "$CG"/out.*.1 2>/dev/null | head -1)
            [ -n "$f" ] || { echo "$tag $side: no callgrind dump" >&2; continue; }
            ir=$(grep -m1 '^summary:\|^totals:' "$f" | awk '{print $2}')
            b=$(numfmt --from=iec-i "${size%B}")
            python3 -c "import sys; ir,n,b=int(sys.argv[1]),int(sys.argv[2]),int(sys.argv[3]); print(f'$tag $side: instructions {ir/(n*b):.2f} per byte, {ir/n:,.0f} per request ({n} requests)')" "$ir" "$n" "$((b * BATCH))" | tee -a "$OUT/ir.txt"
        done ;;
    esac
done; done; done
