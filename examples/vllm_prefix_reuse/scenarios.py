"""The kvpool connector under the scheduler's real life, on real vLLM CPU engines.

Twelve requests at once (a shared 640-token system prompt, then 120-380 tokens of their own,
64 greedy tokens each), on engines that must:

1. **preempt and chunk** (engine A: a KV cache of 24 blocks for ~110 blocks of requests, a
   prefill budget of 256 tokens, shared memory): every token equals the cold engine's; the
   blocks A stored hold, byte for byte, the K and V the cold engine computed for the same
   tokens; after A's own prefix cache is dropped, the same batch loads from the pool and
   still answers the same;
2. **lose blocks between lookup and load, over QUIC, through the staging path** (engine B:
   ``lossy_pool.py`` removes half of every second load's blocks right after vLLM allocated
   them; the KV cache is staged through a host area as for a GPU or NPU): vLLM computes what
   could not be loaded, answers stay the same;
3. **meet a full pool** (engine D: a pool whose DRAM is held by hard-pinned blocks): every save
   is refused, answers stay the same;
4. **slide a window** (a Mistral whose every layer attends over 256 tokens, GQA): the pool engine
   answers as the cold one, first storing, then loading;
5. **reset** (``reset_prefix_cache(reset_connector=True)`` on A): this model's blocks leave the
   pool.

Prints a line per check and a JSON summary (``--json``); ``--check`` exits 1 unless every
expectation holds. Run it with the vLLM venv's Python (see ``run.py``).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Checks as _Checks  # noqa: E402
from run import Engine, Pool, server_binary  # noqa: E402
from tiny_llama import build, build_sliding  # noqa: E402

N_REQUESTS = 12
SHARED = 640
MAX_TOKENS = 64


def batch(seed: int) -> list[list[int]]:
    """Prompts of 6 to 8 blocks that end a token or a few short of a block: decoding needs a new
    block at once, which is when a small cache makes vLLM preempt."""
    rnd = random.Random(seed)
    head = [rnd.randrange(3, 400) for _ in range(SHARED)]
    lengths = [128 * (6 + i % 3) - 1 - i % 4 for i in range(N_REQUESTS)]
    return [head + [rnd.randrange(3, 400) for _ in range(n - SHARED)] for n in lengths]


def pool_client(pool: Pool) -> Any:
    from kvpool import Client

    return Client(data_dir=str(pool.dir))


def key_prefix(engine: Any) -> str:
    """The prefix of an engine's keys, as its connector forms them (model, format digest, ranks)."""
    return str(engine.call({"key_prefix": True})["prefix"])


def fill(pool: Pool) -> int:
    """Hold all of a pool's DRAM with hard-pinned blocks; returns their count."""
    c = pool_client(pool)
    n = 0
    while c.put_batch([f"filler-{n}"], [bytes(1 << 20)], pin="hard") == ["ok"]:
        n += 1
    return n


class Checks(_Checks):
    def same(self, name: str, got: dict[str, Any], want: list[list[int]]) -> None:
        outs = got["outputs"]
        n = sum(len(o) for o in outs)
        bad = [i for i, (a, b) in enumerate(zip(outs, want)) if a != b]
        self.expect(not bad and len(outs) == len(want) and all(len(o) == MAX_TOKENS for o in outs),
                    f"{name}: all {n} greedy tokens of {len(want)} requests equal the cold engine's"
                    + (f" (requests {bad} differ)" if bad else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="scratch directory (default: a new temporary one, removed after)")
    p.add_argument("--server-bin", help="kvpool-server binary (default: the workspace's build)")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--check", action="store_true", help="exit 1 unless every expectation holds")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpool-scenarios-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    llama = build(workdir / "tiny-llama")
    sliding = build_sliding(workdir / "tiny-mistral-sw")
    binary = server_binary(args.server_bin)
    ck = Checks()
    prompts = batch(1)
    engines: list[Engine] = []
    pools: list[Pool] = []

    def engine(name: str, model: Path, pool: Pool | None, *flags: str, transport: str = "auto") -> Engine:
        e = Engine(name, model, workdir, pool.dir if pool else None, transport,
                   extra_args=["--inproc", "--max-num-seqs", str(N_REQUESTS), *flags])
        engines.append(e)
        return e

    def stats(e: Engine) -> dict[str, Any]:
        return e.call({"connector": True})["stats"]

    try:
        pool = Pool(binary, workdir / "pool")
        full = Pool(binary, workdir / "full-pool", dram="64MiB")
        pools += [pool, full]
        ck.facts["filler_blocks"] = fill(full)
        # Every engine schedules alike (cache, prefill budget), as the cold one does: then K and V
        # are computed in the same shapes and compare byte for byte (chunked differently, float
        # sums differ in their last bits).
        tight = ("--num-gpu-blocks", "18", "--max-batched-tokens", "512", "--max-model-len", "2048")
        c = engine("C-cold", llama, None, *tight)
        a = engine("A", llama, pool, *tight, transport="shm")
        b = engine("B", llama, pool, *tight, "--connector-module", "lossy_pool", "--extra",
                   json.dumps({"kvpool_staging": "always", "kvpool_staging_bytes": "8MiB"}), transport="quic")
        d = engine("D", llama, full, *tight)
        for e in (c, a, b, d):
            e.wait_ready()
        print(f"kvpool + 4 engines ready in {time.monotonic() - t0:.0f} s", flush=True)

        cold = c.call({"batch": prompts, "max_tokens": MAX_TOKENS})["outputs"]
        # 1. Preemption and chunked prefill, then the same batch from the pool.
        r = a.call({"batch": prompts, "max_tokens": MAX_TOKENS})
        ck.facts["A_preemptions"] = r["preemptions"]
        ck.facts["A_seconds"] = r["seconds"]
        ck.expect(r["preemptions"] > 0, f"A: vLLM preempted {r['preemptions']} times (a cache of 18 blocks)")
        ck.same("A (preempting, chunked prefill, shm)", r, cold)
        _wait(lambda: stats(a).get("saved_blocks", 0) > 0, "A's saves")
        sa = stats(a)
        ck.expect(sa.get("saved_blocks", 0) > 0, f"A: stored {sa.get('saved_blocks')} blocks")
        client = pool_client(pool)
        compared = mismatched = 0
        worst = 0.0
        prefix = key_prefix(a)
        for toks in prompts:
            for h, raw in c.call({"kv_blocks": toks})["blocks"]:
                if raw is None:
                    continue
                st, val = client.get_batch([f"{prefix}@{h}"])[0]
                if st != "ok":
                    continue
                compared += 1
                want = base64.b64decode(raw)
                if val != want:
                    mismatched += 1
                    worst = max(worst, _rel_diff(val, want))
        ck.facts["blocks_compared_with_cold_kv"] = compared
        ck.facts["blocks_differing_in_rounding"] = mismatched
        ck.facts["worst_relative_difference"] = worst
        # A block computed in a step of another shape (A's saves hold blocks a little longer than
        # the cold engine's, so it may batch differently) differs in the last bits of its floats;
        # another prefix's KV would differ in all of them.
        ck.expect(compared > 0 and worst < 1e-4,
                  f"A: {compared} stored blocks hold the cold engine's K and V: {compared - mismatched} byte for "
                  f"byte, {mismatched} within float rounding (worst relative difference {worst:.1e})")
        _reset_local(a)
        r2 = a.call({"batch": prompts, "max_tokens": MAX_TOKENS})
        ck.same("A again, its prefix cache dropped (loads from the pool)", r2, cold)
        sa2 = stats(a)
        ck.facts["A_loaded_blocks"] = sa2.get("loaded_blocks", 0)
        ck.expect(sa2.get("loaded_blocks", 0) > 0, f"A: loaded {sa2.get('loaded_blocks')} blocks from the pool")

        # 2. Lost blocks, QUIC, staging.
        rb = b.call({"batch": prompts, "max_tokens": MAX_TOKENS})
        ck.same("B (blocks lost between lookup and load, QUIC, staged)", rb, cold)
        sb = stats(b)
        ck.facts["B_loaded_blocks"], ck.facts["B_load_failed_blocks"] = sb.get("loaded_blocks"), sb.get(
            "load_failed_blocks")
        ck.expect(sb.get("loaded_blocks", 0) > 0 and sb.get("load_failed_blocks", 0) > 0,
                  f"B: loaded {sb.get('loaded_blocks')} blocks, {sb.get('load_failed_blocks')} lost and computed")

        # 3. A full pool.
        rd = d.call({"batch": prompts, "max_tokens": MAX_TOKENS})
        ck.same("D (full pool)", rd, cold)
        _wait(lambda: stats(d).get("save_failed_blocks", 0) > 0, "D's refused saves")
        sd = stats(d)
        ck.facts["D_save_failed_blocks"] = sd.get("save_failed_blocks")
        ck.facts["D_save_dropped_blocks"] = sd.get("save_dropped_blocks")
        ck.expect(sd.get("save_failed_blocks", 0) > 0 and sd.get("saved_blocks", 0) == 0,
                  f"D: {sd.get('save_failed_blocks')} saves refused by the full pool "
                  f"({sd.get('save_dropped_blocks')} of them not even sent while it was full), none stored")

        # 5. Reset: this model's blocks leave the pool.
        chain = [h for h, _ in c.call({"kv_blocks": prompts[0]})["blocks"]]
        before = client.lookup([f"{prefix}@{h}" for h in chain])
        ok = a.call({"reset_prefix_cache": True})["ok"]
        after = client.lookup([f"{prefix}@{h}" for h in chain])
        ck.expect(ok and before > 0 and after == 0,
                  f"reset_prefix_cache(reset_connector=True): {before} -> {after} blocks of the model in the pool")
        for e in (c, a, b, d):
            e.stop()
        engines.clear()

        # 4. Sliding window.
        cs = engine("C-sw-cold", sliding, None, "--max-batched-tokens", "256")
        s_ = engine("S", sliding, pool, "--max-batched-tokens", "256")
        cs.wait_ready()
        s_.wait_ready()
        cold_sw = cs.call({"batch": prompts, "max_tokens": MAX_TOKENS})["outputs"]
        ck.same("S (sliding window, stores)", s_.call({"batch": prompts, "max_tokens": MAX_TOKENS}), cold_sw)
        _wait(lambda: stats(s_).get("saved_blocks", 0) > 0, "S's saves")
        _reset_local(s_)
        ck.same("S again (sliding window, loads)", s_.call({"batch": prompts, "max_tokens": MAX_TOKENS}), cold_sw)
        ss = stats(s_)
        ck.facts["S_loaded_blocks"] = ss.get("loaded_blocks", 0)
        ck.expect(ss.get("loaded_blocks", 0) > 0, f"S: loaded {ss.get('loaded_blocks')} blocks from the pool")
    finally:
        for e in engines:
            e.stop()
        for pl in pools:
            pl.stop()
    ck.facts["wall_s"] = time.monotonic() - t0
    summary = {"failures": ck.failures, **ck.facts}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if (ck.failures and args.check) else 0


def _reset_local(e: Engine) -> None:
    """Drop the engine's own prefix cache (vLLM refuses while a save still holds blocks)."""
    deadline = time.monotonic() + 30
    while not e.call({"reset_prefix_cache": False})["ok"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"engine {e.name} would not drop its prefix cache")
        time.sleep(0.02)


def _rel_diff(a: bytes, b: bytes) -> float:
    """Largest difference of two blocks of float32, relative to the largest value."""
    import numpy as np

    x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
    if x.shape != y.shape:
        return float("inf")
    return float(np.abs(x - y).max() / max(float(np.abs(y).max()), 1e-30))


def _wait(cond: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            print(f"(waited {timeout:.0f} s for {what})", flush=True)
            return
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
