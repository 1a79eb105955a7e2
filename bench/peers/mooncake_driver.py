#!/usr/bin/env python3
"""Mooncake Store side of `kvpool-bench throughput`: the same put/get workload, driven through
Mooncake's own Python client (what vLLM's MooncakeStoreConnector users run).

Two roles, both talking to a `mooncake_master` the harness started on loopback:

  serve   a storage node: mounts a global segment of --segment bytes and holds it until stdin
          closes (the counterpart of the kvpool server process).
  client  reads one JSON request per stdin line and answers one JSON line per request:
            {"size": S, "batch": B, "conc": C, "ops": N, "run": "prefix"}
          -> {"put": {"seconds": s, "lat_us": [...]}, "get": {...}, "bytes": n}
          Each of C threads does N put_batch calls of B blocks of S bytes, then (after all puts)
          N get_batch calls of the same keys; the keys are removed afterwards.
          With --shm HOST:PORT the client is instead a "dummy client" of a `mooncake_client`
          process (Mooncake's own same-host path): its buffers live in a shared-memory pool
          that process maps, and each worker runs batch_put_from / batch_get_into on its own
          registered region, the counterpart of kvpool's put_from / get_into over shm.

Errors go to stderr and exit non-zero; the harness reports them.
"""
import argparse
import ctypes
import json
import os
import sys
import threading
import time

from mooncake.store import MooncakeDistributedStore


def log(msg):
    print(f"mooncake_driver: {msg}", file=sys.stderr, flush=True)


def setup(args, segment, local_buffer):
    store = MooncakeDistributedStore()
    # P2PHANDSHAKE: peers exchange transfer metadata directly, no etcd/HTTP metadata server.
    rc = store.setup(
        args.host,
        "P2PHANDSHAKE",
        segment,
        local_buffer,
        "tcp",
        "",
        args.master,
    )
    if rc != 0:
        raise SystemExit(f"mooncake setup failed: rc={rc} (master {args.master})")
    return store


def serve(args):
    store = setup(args, args.segment, 16 << 20)
    print(json.dumps({"ready": True}), flush=True)
    # Hold the segment mounted until the harness closes our stdin (or kills us).
    sys.stdin.read()
    store.close()


def run_phase(conc, fn):
    """Run fn(worker) on conc threads; returns (wall seconds, all latencies in us)."""
    lats = [None] * conc
    errors = []

    def work(w):
        try:
            lats[w] = fn(w)
        except Exception as e:  # surfaced to the harness below
            errors.append(f"worker {w}: {e}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(conc)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - start
    if errors:
        raise RuntimeError("; ".join(errors))
    return secs, [x for w in lats for x in w]


def shm_setup(args):
    """A dummy client of the `mooncake_client` at args.shm, with one registered region of
    args.max_bytes per worker in the shared pool; returns (store, [region address])."""
    store = MooncakeDistributedStore()
    total = args.max_bytes * args.workers
    rc = store.setup_dummy(total, 16 << 20, args.shm)
    if rc != 0:
        raise SystemExit(f"mooncake setup_dummy failed: rc={rc} (real client {args.shm})")
    base = store.alloc_from_mem_pool(total)
    if not base:
        raise SystemExit(f"mooncake alloc_from_mem_pool({total}) failed")
    rc = store.register_buffer(base, total)
    if rc != 0:
        raise SystemExit(f"mooncake register_buffer failed: rc={rc}")
    # Same random bytes in every region (generated once), and every page touched before timing.
    data = os.urandom(args.max_bytes)
    regions = [base + w * args.max_bytes for w in range(args.workers)]
    for r in regions:
        ctypes.memmove(r, data, args.max_bytes)
    return store, regions, data


def client(args):
    if args.shm:
        store, regions, expected = shm_setup(args)
        pool = None
    else:
        store = setup(args, 0, args.local_buffer)
        # Same bytes for every run, like the Rust targets (random, generated once).
        pool = os.urandom(args.max_bytes)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        size, batch, conc, ops, run = req["size"], req["batch"], req["conc"], req["ops"], req["run"]
        if pool is None and (conc > len(regions) or size * batch > args.max_bytes):
            print(json.dumps({"error": f"{conc} x {batch} x {size} B exceeds the registered regions"}), flush=True)
            continue
        if pool is not None:
            view = memoryview(pool)
            values = [view[j * size:(j + 1) * size] for j in range(batch)]

        def keys(w, op):
            return [f"bench/{run}/{size}/{batch}/{conc}/w{w}/o{op}/i{j}" for j in range(batch)]

        def ptrs(w):
            return [regions[w] + j * size for j in range(batch)]

        def put_worker(w):
            out = []
            for op in range(ops):
                k = keys(w, op)
                t = time.perf_counter()
                if pool is None:
                    rcs = store.batch_put_from(k, ptrs(w), [size] * batch)
                    out.append(max(1, int((time.perf_counter() - t) * 1e6)))
                    bad = [(i, r) for i, r in enumerate(rcs) if r != 0]
                    if bad:
                        raise RuntimeError(f"batch_put_from: item {bad[0][0]} rc={bad[0][1]}")
                    continue
                rc = store.put_batch(k, values)
                out.append(max(1, int((time.perf_counter() - t) * 1e6)))
                if rc != 0:
                    raise RuntimeError(f"put_batch rc={rc}")
            return out

        def get_worker(w):
            out = []
            for op in range(ops):
                k = keys(w, op)
                t = time.perf_counter()
                if pool is None:
                    got = store.batch_get_into(k, ptrs(w), [size] * batch)
                    out.append(max(1, int((time.perf_counter() - t) * 1e6)))
                    bad = [(i, n) for i, n in enumerate(got) if n != size]
                    if bad:
                        raise RuntimeError(f"batch_get_into: item {bad[0][0]} returned {bad[0][1]}, expected {size}")
                    continue
                got = store.get_batch(k)
                out.append(max(1, int((time.perf_counter() - t) * 1e6)))
                bad = [i for i, v in enumerate(got) if len(v) != size]
                if bad:
                    raise RuntimeError(f"get_batch: item {bad[0]} has {len(got[bad[0]])} bytes, expected {size}")
            return out

        try:
            put_s, put_l = run_phase(conc, put_worker)
            if pool is None:
                # Gets must really land: clear the regions, then compare after (neither timed).
                for w in range(conc):
                    ctypes.memset(regions[w], 0, size * batch)
            get_s, get_l = run_phase(conc, get_worker)
            if pool is None:
                for w in range(conc):
                    if ctypes.string_at(regions[w], size * batch) != expected[:size * batch]:
                        raise RuntimeError(f"batch_get_into: worker {w} read bytes that differ from the put")
        except RuntimeError as e:
            print(json.dumps({"error": str(e)}), flush=True)
            continue
        all_keys = [k for w in range(conc) for op in range(ops) for k in keys(w, op)]
        for i in range(0, len(all_keys), 1024):
            store.batch_remove(all_keys[i:i + 1024], True)
        out = {
            "put": {"seconds": put_s, "lat_us": put_l},
            "get": {"seconds": get_s, "lat_us": get_l},
            "bytes": conc * ops * batch * size,
        }
        print(json.dumps(out), flush=True)
    store.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["serve", "client"])
    p.add_argument("--master", required=True, help="mooncake_master RPC address, host:port")
    p.add_argument("--host", default="127.0.0.1", help="this process's address, as its peers reach it")
    p.add_argument("--segment", type=int, default=1 << 30, help="serve: bytes of global segment")
    p.add_argument("--local-buffer", type=int, default=512 << 20, help="client: local transfer buffer")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="client: largest batch in bytes")
    p.add_argument("--shm", help="client: host:port of a mooncake_client to use over shared memory")
    p.add_argument("--workers", type=int, default=8, help="client --shm: most concurrent workers")
    args = p.parse_args()
    if args.role == "serve":
        serve(args)
    else:
        client(args)


if __name__ == "__main__":
    main()
