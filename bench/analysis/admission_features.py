"""How much could an admission filter built on request-shape features add to LRU on a trace?

An upper bound, computed in-sample (it cheats in the predictor's favour): every never-seen block
of a request is described by (is the request a continuation, its chain length bucket, its
distance from the chain's end, is it the chain's last block); the reuse probability of each
feature value is measured over the whole trace; a block is admitted when that probability is at
least t (the rest of its chain is then rejected too, as the chain rule does). Eviction is LRU.
`kvpool-bench replay` prints the oracle bound (`offline/oracle-admission+leaf-lru`) beside it.

    python3 bench/analysis/admission_features.py [TRACE] [CAPACITY_FRACTION ...]
"""

from __future__ import annotations

import collections
import json
import sys
from collections import OrderedDict
from pathlib import Path


def main() -> None:
    here = Path(__file__).resolve()
    default = here.parents[3] / "shared" / "traces" / "mooncake-conversation.jsonl"
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    fractions = [float(x) for x in sys.argv[2:]] or [0.05, 0.1]
    reqs = [json.loads(line) for line in trace.open()]
    uses: dict[int, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(reqs):
        for h in r["hash_ids"]:
            uses[h].append(i)
    distinct = len(uses)

    def feature(r: dict, hit: int, pos: int) -> tuple:
        n = len(r["hash_ids"])
        return (hit > 1, min(n // 8, 8), min((n - 1 - pos) // 4, 6), pos == n - 1)

    counts: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    seen: set[int] = set()
    for i, r in enumerate(reqs):
        ids = r["hash_ids"]
        hit = 0
        while hit < len(ids) and ids[hit] in seen:
            hit += 1
        for pos, h in enumerate(ids):
            if h in seen:
                continue
            c = counts[feature(r, hit, pos)]
            c[0] += 1
            c[1] += any(t > i for t in uses[h])
            seen.add(h)
    prob = {f: c[1] / c[0] for f, c in counts.items()}
    print(f"{len(prob)} feature values; reuse probability from {min(prob.values()):.3f} to {max(prob.values()):.3f}")

    def replay(capacity: int, t: float) -> float:
        cache: OrderedDict[int, None] = OrderedDict()
        hits = total = 0
        for r in reqs:
            ids = r["hash_ids"]
            total += len(ids)
            hit = 0
            while hit < len(ids) and ids[hit] in cache:
                hit += 1
            hits += hit
            for h in ids[:hit]:
                cache.move_to_end(h)
            for pos in range(hit, len(ids)):
                h = ids[pos]
                if h in cache:
                    cache.move_to_end(h)
                    continue
                if prob[feature(r, hit, pos)] < t:
                    break
                cache[h] = None
                while len(cache) > capacity:
                    cache.popitem(last=False)
        return hits / total

    for f in fractions:
        cap = int(distinct * f)
        row = ", ".join(f"t={t}: {replay(cap, t):.3f}" for t in (0.0, 0.05, 0.1, 0.2, 0.25, 0.3))
        print(f"{f:.0%} ({cap} blocks): block hit rate {row}")


if __name__ == "__main__":
    main()
