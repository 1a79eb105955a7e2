"""vLLM's own ``MooncakeStoreConnector``, unchanged, on a kvpool pool through kvpool's alias of
``mooncake.store`` (``python -m kvpool.mooncake_alias install``), on real vLLM CPU engines.

Engines (a tiny random Llama built locally, ``--inproc`` so the driver can read their caches):

- ``C``: no connector, the cold reference;
- ``W`` (``kv_both``): runs the prompts, storing their blocks through Mooncake's API;
- ``R`` (``kv_both``, a fresh engine): runs them again, loading W's blocks;
- ``P`` (``kv_producer``) runs new prompts, ``K`` (``kv_consumer``) runs them after it.

Checks: every generated token equals C's; R and K answer with cached tokens (from the pool);
the pool's objects, under the keys upstream's connector forms, hold W's KV byte for byte (each
layer's page, as vLLM's ``RankLocalStoreLayout`` registers it); K stores nothing and P loads
nothing; ``reset_prefix_cache(reset_connector=True)`` on R empties the pool of the model's
blocks. The Mooncake configuration comes from ``MOONCAKE_CONFIG_PATH`` as vLLM reads it, with
kvpool's credentials in the same file (``kvpool_data_dir``).

``--check`` exits 1 unless every check holds; ``--json`` writes the figures. Run with the vLLM
venv's Python (``setup_venv.sh``).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Checks, Engine, Pool, server_binary  # noqa: E402
from tiny_llama import build  # noqa: E402

BLOCK = 128  # vLLM's CPU block size
MAX_TOKENS = 8


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rnd = random.Random(seed)
    head = [rnd.randrange(3, 400) for _ in range(2 * BLOCK)]
    return [head + [rnd.randrange(3, 400) for _ in range(BLOCK + 37 * i)] for i in range(n)]


def alias(py: str, on: bool) -> None:
    cmd = ["install", "--prefer", "kvpool"] if on else ["uninstall"]
    subprocess.run([py, "-m", "kvpool.mooncake_alias", *cmd], check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true")
    p.add_argument("--json")
    p.add_argument("--workdir")
    p.add_argument("--server-bin")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpool-mooncake-connector-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build(workdir / "tiny-llama")
    pool = Pool(server_binary(args.server_bin), workdir / "pool")
    cfg = workdir / "mooncake.json"
    # Mooncake's own fields, as vLLM's MooncakeStoreConfig reads them, and kvpool's credentials.
    cfg.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": pool.addr, "protocol": "tcp",
        "device_name": "", "global_segment_size": "64MB", "local_buffer_size": "64MB",
        "kvpool_data_dir": str(pool.dir),
    }))
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    ck = Checks()
    engines: list[Engine] = []
    alias(sys.executable, True)
    t0 = time.monotonic()
    try:
        def engine(name: str, role: str | None) -> Engine:
            extra = ["--inproc", "--max-num-seqs", "8"]
            if role:
                extra += ["--kv-connector", "MooncakeStoreConnector", "--kv-role", role]
            e = Engine(name, model, workdir, None, "auto", extra_args=extra, env=env)
            engines.append(e)
            return e

        c, w = engine("C", None), engine("W", "kv_both")
        for e in (c, w):
            e.wait_ready()
        first = prompts(1)
        cold = c.call({"batch": first, "max_tokens": MAX_TOKENS})["outputs"]
        rw = w.call({"batch": first, "max_tokens": MAX_TOKENS})
        ck.expect(rw["outputs"] == cold, "W (MooncakeStoreConnector, stores): every token equals the cold engine's")

        from kvpool import Client

        client = Client(data_dir=str(pool.dir))
        prefix = f"{model.name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
        compared = equal = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            compared = equal = 0
            for toks in first:
                for h, raw in w.call({"kv_blocks": toks})["blocks"]:
                    if raw is None:
                        continue
                    ((st, val),) = client.get_batch([f"{prefix}@{h}"])
                    if st != "ok":
                        continue
                    compared += 1
                    equal += bytes(val) == base64.b64decode(raw)
            if compared >= len(first) * 2:
                break
            time.sleep(0.5)  # saves are asynchronous
        ck.facts["blocks_compared"], ck.facts["blocks_equal"] = compared, equal
        ck.expect(compared > 0 and equal == compared,
                  f"the pool holds W's KV under upstream's keys: {equal} of {compared} blocks byte for byte")

        r = engine("R", "kv_both")
        r.wait_ready()
        rr = r.call({"batch": first, "max_tokens": MAX_TOKENS})
        ck.facts["R_cached"] = rr["cached"]
        ck.expect(rr["outputs"] == cold, "R (a fresh engine, loads W's blocks): every token equals the cold engine's")
        ck.expect(min(rr["cached"]) >= 2 * BLOCK, f"R: every request cached tokens from the pool ({rr['cached']})")

        # Producer and consumer roles.
        second = prompts(2)
        cold2 = c.call({"batch": second, "max_tokens": MAX_TOKENS})["outputs"]
        pr, k = engine("P", "kv_producer"), engine("K", "kv_consumer")
        for e in (pr, k):
            e.wait_ready()
        rp = pr.call({"batch": second, "max_tokens": MAX_TOKENS})
        ck.expect(rp["outputs"] == cold2, "P (kv_producer): every token equals the cold engine's")
        time.sleep(2)  # its saves land
        third = prompts(3)
        cold3 = c.call({"batch": third, "max_tokens": MAX_TOKENS})["outputs"]
        keys_third = [f"{prefix}@{h}" for toks in third for h, _ in k.call({"kv_blocks": toks})["blocks"]]
        rk = k.call({"batch": second, "max_tokens": MAX_TOKENS})
        ck.facts["K_cached"] = rk["cached"]
        ck.expect(rk["outputs"] == cold2 and min(rk["cached"]) >= 2 * BLOCK,
                  f"K (kv_consumer): loads P's blocks ({rk['cached']} cached), tokens equal the cold engine's")
        rk3 = k.call({"batch": third, "max_tokens": MAX_TOKENS})
        time.sleep(2)
        ck.expect(rk3["outputs"] == cold3 and not any(client.exists(keys_third)),
                  "K (kv_consumer) stores nothing of the prompts it computed")

        # Reset through the connector.
        chain = [f"{prefix}@{h}" for h, _ in w.call({"kv_blocks": first[0]})["blocks"]]
        held = client.lookup(chain)
        ok = r.call({"reset_prefix_cache": True})["ok"]
        after = client.lookup(chain)
        ck.facts["reset_before"], ck.facts["reset_after"] = held, after
        ck.expect(ok and held > 0 and after == 0,
                  f"reset_prefix_cache(reset_connector=True) on R: {held} -> {after} blocks of the prompt in the pool")
    finally:
        for e in engines:
            e.stop()
        pool.stop()
        alias(sys.executable, False)
    ck.facts["wall_s"] = time.monotonic() - t0
    ck.facts["failures"] = ck.failures
    print(json.dumps(ck.facts, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(ck.facts, indent=2))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.check and ck.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
