#!/usr/bin/env python3
"""Bucket a `perf script` (with call chains) of a QUIC run into cost categories (bench/scripts/quic-profile.sh).

Usage: quic_profile_cats.py PERF_SCRIPT [HZ] [PAYLOAD_BYTES]. Heuristic: by leaf symbol and call chain."""
import sys, re, collections
OURS = ("kvpool-server", "tokio-rt-worker", "kvpool-bench", "tokio-runtime-w")
NET = re.compile(r"net_rx_action|napi|veth|udp|__ip_|ip_rcv|ip_finish|ip_output|ip_local|__dev_queue|dev_hard_start|skb|sock_|__sys_sendmsg|__sys_recvmsg|___sys_|gro|gso|netif|__netif|nf_|br_|inet_")
def cat(comm, frames):
    leaf = frames[0] if frames else "?"
    chain = " ".join(frames)
    # Every thread of ours: the runtimes' workers, and threads named kvpool-* (QUIC I/O threads).
    ours = comm in OURS or comm.startswith("kvpool-")
    if not ours:
        if re.search(r"net_rx_action|__napi_poll|veth_|udp_|ip_rcv", chain):
            return "kernel: network stack (softirq on other tasks)"
        return None
    if "DramTier::new" in chain:
        return None  # the server's start (prefaulting its DRAM tier), before any timed phase
    if "clear_page" in chain or "exc_page_fault" in chain or "asm_exc_page_fault" in chain:
        return "page faults / first touch of memory"
    if re.search(r"unprotect_header|HeaderProtection|header_protection|encrypt_in_place.*hp|new_mask", chain) and re.search(r"aes|ring", leaf):
        return "header protection (AES block)"
    if re.search(r"aes_gcm|gcm_|ring_core.*aes|ring::aead", leaf):
        return "AEAD seal/open (ring AES-GCM)"
    if re.search(r"__memmove|__memcpy|memcpy", leaf):
        return "user-space copies (memcpy)"
    if re.search(r"_copy_to_iter|_copy_from_iter|copy_user|rep_movs|copy_page", leaf):
        return "kernel copies (user<->skb)"
    if leaf.startswith("xxhash"):
        return "xxh3 of values (kvpool)"
    if re.search(r"schedule|finish_task_switch|futex|try_to_wake|ttwu|enqueue_task|dequeue_task|pick_next|switch_to|epoll|ep_poll|__x64_sys_epoll|idle|cpuidle|do_idle", leaf) :
        return "kernel: scheduling, futex, epoll"
    if re.search(r"\[k\]", leaf) or leaf.startswith("k:"):
        if NET.search(chain):
            return "kernel: UDP/IP send+receive path"
        if re.search(r"futex|epoll|schedule|wake", chain):
            return "kernel: scheduling, futex, epoll"
        return "kernel: other (syscall entry, irq, mm)"
    if re.search(r"on_ack_received|on_packet_acked|detect_lost|BTreeMap|btree", chain) and leaf.startswith(("quinn_proto", "alloc::collections", "<alloc::collections", "core::")):
        if "on_ack_received" in chain or "on_packet_acked" in chain or "detect_lost" in chain:
            return "quinn-proto: ACK processing, sent-packet tracking"
    if "quinn_proto" in leaf or "rustls::" in leaf or ("quinn_proto" in chain and re.search(r"alloc::collections|core::", leaf)):
        return "quinn-proto: packet build/parse, streams, state"
    if re.search(r"tokio|parking_lot|std::sync|futex|__lll|pthread", leaf):
        return "tokio runtime, locks, wake-ups (user)"
    if leaf.startswith("bytes::"):
        return "Bytes refcounts (shared_v_drop, split_to)"
    if re.search(r"malloc|free|_int_|cfree|bytes::|alloc::|jemalloc|je_|tcache|sdallocx", leaf):
        return "allocation, Bytes refcounts"
    if re.search(r"quinn|udp", leaf):
        return "quinn driver, quinn-udp (user)"
    if re.search(r"sendmsg|recvmsg|__libc|syscall", leaf):
        return "libc syscall wrappers"
    return "other user code"

def main(path):
    tot = collections.Counter(); per = collections.defaultdict(collections.Counter)
    comm = None; frames = []; n_other = 0
    def flush():
        nonlocal n_other
        if comm is None: return
        c = cat(comm, frames)
        if c is None: n_other += 1; return
        side = "server" if comm == "kvpool-server" or srv.get(pid) else "client"
        tot[c] += 1; per[side][c] += 1
    srv = {}
    pid = None
    for line in open(path, errors="replace"):
        if not line.strip():
            flush(); comm = None; frames = []; continue
        if not line.startswith((" ", "\t")):
            parts = line.split()
            comm = parts[0]; pid = parts[1].split("/")[0] if parts[1:] else None
            if comm == "kvpool-server": srv[pid] = True
            frames = []
        else:
            f = line.strip().split(None, 1)
            sym = f[1] if len(f) > 1 else f[0]
            dso = sym[sym.rfind("("):] if "(" in sym else ""
            name = re.sub(r"\+0x[0-9a-f]+", "", sym.split(" (")[0])
            if "kernel.kallsyms" in dso: name = "[k] " + name
            frames.append(name)
    flush()
    n = sum(tot.values())
    print(f"samples: {n} in kvpool's processes or the network softirq; {n_other} elsewhere (builds, idle)")
    hz = float(sys.argv[2]) if len(sys.argv) > 2 else 499
    nbytes = float(sys.argv[3]) if len(sys.argv) > 3 else 0
    if nbytes:
        print(f"CPU time {n/hz:.2f} s for {nbytes/1e9:.3f} GB: {n/hz/nbytes*1e9:.2f} CPU-ns per byte")
    print(f"| where | share | CPU-ns/byte | server side | client side |")
    print("|---|---:|---:|---:|---:|")
    for c, k in tot.most_common():
        nsb = f"{k/hz/nbytes*1e9:.2f}" if nbytes else "-"
        print(f"| {c} | {100*k/n:.1f}% | {nsb} | {100*per['server'][c]/n:.1f}% | {100*per['client'][c]/n:.1f}% |")
main(sys.argv[1])
