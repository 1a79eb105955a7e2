"""A client run on one host of a ``netns.Hosts`` test (``ip netns exec NS python host_client.py
JSON``): it connects to the master, runs the steps of JSON, and prints one JSON line of what it
saw. Values are derived from keys, so any host can check bytes it did not write."""

from __future__ import annotations

import hashlib
import json
import sys
import time

import kvpool


def value(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def main() -> None:
    cmd = json.loads(sys.argv[1])
    c = kvpool.Client(cmd["master"], cmd["api_key"], fingerprint=cmd["fingerprint"], timeout=5.0,
                      dead_after=1.0, node_answer_within=0.1)
    out: dict[str, object] = {"cluster": c.cluster}
    size = int(cmd.get("size", 65536))
    if "put" in cmd:
        keys = cmd["put"]
        parents = [None, *keys[:-1]]
        out["put"] = c.put_batch(keys, [value(k, size) for k in keys], parents=parents)
    if "get" in cmd:
        t = time.monotonic()
        got = c.get_batch(cmd["get"])
        out["get_s"] = time.monotonic() - t
        out["get"] = ["ok" if st == "ok" and v == value(k, size) else ("wrong" if st == "ok" else st)
                      for k, (st, v) in zip(cmd["get"], got)]
    c.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
