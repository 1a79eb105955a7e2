#!/usr/bin/env python3
"""Replay a Mooncake-format trace through libCacheSim's caches, the way `kvpool-bench replay`
replays it through kvpool's policies, and print JSON on stdout.

One request = lookup of its chain (hit = longest prefix of its `hash_ids` resident, checked with
`find(update_cache=False)`), then `get` of every block in order (a resident block is promoted as
an access, a missing one is inserted, evicting as the algorithm decides). Every block has size 1,
so a capacity is a number of blocks. Tokens: 512 per block, the last block of a request holding
`input_length - 512 * (n - 1)` (clamped to 1..512).

Needs `pip install libcachesim` (0.3.x).
"""

import argparse
import json
import sys
import time

ALGOS = {
    "lru": "LRU",
    "arc": "ARC",
    "clock": "Clock",
    "s3fifo": "S3FIFO",
    "sieve": "Sieve",
    "lirs": "LIRS",
    "wtinylfu": "WTinyLFU",
}


def load_trace(path, limit):
    reqs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            ids = [int(x) for x in d["hash_ids"]]
            reqs.append((int(d.get("timestamp", 0)), ids, int(d["input_length"])))
            if limit and len(reqs) >= limit:
                break
    # Arrival order, file order among equal timestamps (as kvpool-bench does).
    reqs.sort(key=lambda r: r[0])
    return [(ids, n) for _, ids, n in reqs]


def block_tokens(i, n, input_length, block_tokens_n):
    if i + 1 < n:
        return block_tokens_n
    return min(max(input_length - block_tokens_n * (n - 1), 1), block_tokens_n)


def replay(lcs, algo, capacity, reqs, bt):
    cache = getattr(lcs, ALGOS[algo])(capacity)
    req = lcs.Request()
    req.obj_size = 1
    blocks = tokens = bhits = thits = 0
    for ids, input_length in reqs:
        n = len(ids)
        prefix = True
        for i, oid in enumerate(ids):
            t = block_tokens(i, n, input_length, bt)
            blocks += 1
            tokens += t
            if prefix:
                req.obj_id = oid
                if cache.find(req, False) is not None:
                    bhits += 1
                    thits += t
                else:
                    prefix = False
        for oid in ids:
            req.obj_id = oid
            cache.get(req)
    return {"blocks": blocks, "tokens": tokens, "block_hits": bhits, "token_hits": thits}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--capacities", required=True, help="comma-separated capacities in blocks")
    ap.add_argument("--algos", default=",".join(ALGOS), help="comma-separated: " + ",".join(ALGOS))
    ap.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    ap.add_argument("--block-tokens", type=int, default=512)
    a = ap.parse_args()
    try:
        import libcachesim as lcs
    except ImportError as e:
        print(json.dumps({"error": f"libcachesim is not installed: {e}"}))
        return 3
    reqs = load_trace(a.trace, a.limit)
    caps = [int(c) for c in a.capacities.split(",") if c]
    out = {"libcachesim": getattr(lcs, "__version__", "unknown"), "requests": len(reqs), "results": []}
    for algo in [x.strip().lower() for x in a.algos.split(",") if x.strip()]:
        if algo not in ALGOS:
            print(json.dumps({"error": f"unknown algorithm {algo}"}))
            return 2
        for cap in caps:
            t0 = time.time()
            r = replay(lcs, algo, max(cap, 1), reqs, a.block_tokens)
            r.update({"algo": algo, "impl": ALGOS[algo], "capacity": cap, "seconds": time.time() - t0})
            out["results"].append(r)
            print(f"libcachesim {ALGOS[algo]} capacity {cap}: {r['block_hits'] / max(r['blocks'], 1):.4f}",
                  file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
