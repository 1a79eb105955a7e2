"""The connector when things go wrong or get slow, under vLLM 0.32's real scheduler (``vllm_sim``)
and a real server: a synchronous load that fails mid-step (nothing computed over it reaches the
pool, and the blocks computed again are saved), a FULL CUDA graph's replay (no
``wait_for_layer_load``), exceptions of types nobody expected in loads and saves (requests end,
blocks are freed), a slow pool (saves never pin more than their share of vLLM's cache; a slow load
delays only its own request; lookups take one request whatever the shards; releases never delay a
lookup), KV events a router can match (vLLM's own ZMQ publisher; removals on every shard).
Needs vLLM (run by ``.ci/vllm-e2e.sh``).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Iterator

import pytest
import vllm_sim
from conftest import Server
from test_vllm_connector import (  # noqa: F401  (the model fixture)
    _drop_loads,
    check_right,
    client_of,
    cold,
    extra_for,
    model,
    prefix_of,
    prompts,
    run,
    worker_counters,
)
from vllm_sim import SimEngine

pytestmark = pytest.mark.vllm


@pytest.fixture
def pool() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def full_keys(e: SimEngine, ps: dict[str, list[int]]) -> list[str]:
    """The pool keys of every full block of the prompts."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from vllm import SamplingParams

    init_none_hash(sha256)
    keys = []
    for i, toks in enumerate(ps.values()):
        r = Request(f"k-{i}", list(toks), SamplingParams(), None, block_hasher=get_request_block_hasher(vllm_sim.BLOCK, sha256))
        keys += [f"{prefix_of(e)}@{bytes(h).hex()}" for h in r.block_hashes]
    return keys


# ---- a failed synchronous load ---------------------------------------------------------------


def test_a_sync_load_failing_mid_step_never_poisons_the_pool(model: str, pool: Server) -> None:
    """``load_async=False``: the pool loses half of what a step loads. That step computes the
    rest of each prompt over blocks that never arrived: none of it may be stored, and once vLLM
    computed those blocks again, they are saved."""
    ps = prompts(4, seed=21)
    # The pool holds each prompt's first 4 blocks: the step that loads them computes the rest.
    run(SimEngine(model, extra_for(pool), num_blocks=400), {r: p[:70] for r, p in ps.items()}, 1)
    e = SimEngine(model, extra_for(pool, load_async=False), num_blocks=400)
    e.between, dropped = _drop_loads(client_of(pool), prefix_of(e))
    run(e, ps, 4)
    assert dropped and e.invalid_blocks > 0
    check_right(e, model, ps, 4, pool)  # includes: every block in the pool holds its own prefix's KV
    assert worker_counters(e)["save_dropped_after_load_failure"] > 0
    # The blocks computed again were saved again: the pool holds the whole prompts.
    keys = full_keys(e, ps)
    assert all(client_of(pool).exists(keys)), "blocks computed again after a failed load were never saved"


def test_a_save_waits_for_every_workers_word_on_its_steps_loads() -> None:
    """With tensor parallelism, one rank's failed load poisons every rank's KV: a worker whose own
    loads arrived holds its step's saves until the scheduler's verdict, then drops them when
    another rank's load failed (and says where to save again), or sends them."""
    from kvpool.vllm.config import ConnectorConfig
    from kvpool.vllm.keys import KeyLayout
    from kvpool.vllm.metadata import KVPoolConnectorMetadata, LoadJob, SaveJob
    from kvpool.vllm.worker import Worker

    class Mover:
        block_bytes = 8

        def __init__(self) -> None:
            self.saved: list[str] = []

        def fence(self) -> None:
            return None

        def load(self, keys: list[str], ids: list[int]) -> list[bool]:
            return [True] * len(keys)

        def save(self, keys: list[str], *a: Any) -> list[str]:
            self.saved += keys
            return ["ok"] * len(keys)

        def close(self) -> None:
            pass

    class NoClient:
        transport = "none"

        def close(self) -> None:
            pass

    w = Worker(ConnectorConfig(async_save=False), KeyLayout("m").writer(0, 0, 0, 0), 16, 32, "w", client=NoClient())
    w.mover = mover = Mover()  # type: ignore[assignment]
    for step, (verdict, sent) in enumerate([(True, []), (False, ["x2"])]):
        load = LoadJob(10 + step, "r", [0], ["a"], [3])
        save = SaveJob(20 + step, "r", [1], [f"x{step + 1}"], ["a"], [4])
        w.start_load_kv(KVPoolConnectorMetadata(loads=[load]))
        w.wait_for_save(KVPoolConnectorMetadata(loads=[load], saves=[save]))
        assert mover.saved == [] or step == 1, "saved before the step's loads had a verdict"
        assert w.build_worker_meta().done == {load.job: 1}
        w.start_load_kv(KVPoolConnectorMetadata(load_verdicts={load.job: verdict}))
        meta = w.build_worker_meta()
        assert meta is not None and meta.done == {save.job: 1}
        if verdict:
            assert meta.failed == {save.job: {1}} and meta.rewind == {save.job: 1}
        else:
            assert not meta.failed and not meta.rewind
        assert [k.rsplit("@", 1)[1] for k in mover.saved] == sent
    w.close()


# ---- FULL CUDA graphs --------------------------------------------------------------------------


def test_a_full_cudagraph_replay_reads_loaded_blocks(model: str, pool: Server) -> None:
    """A FULL CUDA graph's replay never calls ``wait_for_layer_load``: a synchronous load must be
    complete when ``start_load_kv`` returns, even a slow one."""
    ps = prompts(3, seed=22)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    e = SimEngine(model, extra_for(pool, load_async=False), num_blocks=400, full_cudagraph=True)
    mover = e.worker._worker.mover
    inner = mover.load
    mover.load = lambda *a, **k: (time.sleep(0.2), inner(*a, **k))[1]
    run(e, ps, 4)
    assert worker_counters(e)["loaded_blocks"] > 0
    check_right(e, model, ps, 4, pool)


# ---- exceptions nobody expected -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["load-async", "load-sync", "save"])
def test_an_unexpected_exception_ends_the_request_normally(model: str, pool: Server, where: str) -> None:
    ps = prompts(3, seed=23)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    e = SimEngine(model, extra_for(pool, load_async=where == "load-async"), num_blocks=400)
    mover = e.worker._worker.mover

    def boom(*a: Any, **k: Any) -> Any:
        raise ZeroDivisionError("a bug nobody expected")

    if where == "save":
        mover.save = boom
        ps = prompts(3, seed=24)  # new prompts: something to save
    else:
        mover.load = boom
    run(e, ps, 4, )
    check_right(e, model, ps, 4, pool)
    assert not e.sched_connector.has_pending_push_work()
    w = worker_counters(e)
    assert (w["save_failed_blocks"] if where == "save" else w["load_failed_blocks"]) > 0


# ---- a slow pool -----------------------------------------------------------------------------


def test_saves_never_pin_more_of_vllms_cache_than_their_limit(model: str, pool: Server) -> None:
    ps = prompts(8, seed=25)
    e = SimEngine(model, extra_for(pool, kvpool_save_pin_limit=6), num_blocks=120)
    mover = e.worker._worker.mover
    inner = mover.save
    mover.save = lambda *a, **k: (time.sleep(0.05), inner(*a, **k))[1]
    most = [0]

    def watch(eng: SimEngine, out: Any) -> None:
        sched = eng.sched_connector._scheduler
        most[0] = max(most[0], sum(len(j.refs) for j in sched.jobs.values()))

    e.between = watch
    run(e, ps, 8)
    sched = e.sched_connector._scheduler
    assert 0 < most[0] <= 6
    assert sched.totals["save_dropped_pinned"] > 0
    check_right(e, model, ps, 8, pool)


def test_a_slow_load_delays_only_its_own_request(model: str, pool: Server) -> None:
    ps = prompts(4, shared=0, seed=26)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    e = SimEngine(model, extra_for(pool, load_async=True), num_blocks=400)
    mover = e.worker._worker.mover
    inner = mover.load
    slow_key = f"{prefix_of(e)}@"
    first = {}
    done: list[str] = []

    def load(keys: list[str], ids: list[int]) -> list[bool]:
        if not first:
            first["keys"] = keys[0]
            time.sleep(1.5)  # the first request's load is slow
        out = inner(keys, ids)
        done.append(keys[0])
        return out

    mover.load = load
    run(e, ps, 4)
    assert slow_key and len(done) == 4
    assert done[-1] == first["keys"], "a slow load held up the others"
    check_right(e, model, ps, 4, pool)


def test_a_lookup_is_one_request_whatever_the_shards() -> None:
    from kvpool.vllm.config import ConnectorConfig
    from kvpool.vllm.keys import KeyLayout
    from kvpool.vllm.scheduler import Scheduler

    calls: list[list[str]] = []

    class Client:
        def lookup_lease(self, chain: list[str], ttl: float) -> tuple[int, list[int]]:
            calls.append(chain)
            return 7, [1]  # 3 whole blocks of 2 shards, and one shard of the 4th

    s = Scheduler.__new__(Scheduler)
    s.cfg, s.prefixes, s.lock = ConnectorConfig(), KeyLayout("m", tp_size=2).lookup_prefixes(), threading.Lock()
    from kvpool.vllm.stats import KVPoolConnectorStats

    s.stats = KVPoolConnectorStats()
    resident, leases = s._lookup(Client(), ["a", "b", "c", "d"])  # type: ignore[arg-type]
    assert (resident, leases) == (3, [1]) and len(calls) == 1
    assert calls[0][:2] == [f"{p}@a" for p in s.prefixes]


def test_releases_never_delay_a_lookup_past_its_deadline() -> None:
    from kvpool.vllm.health import Pool

    class Client:
        def ping(self) -> float:
            return 0.0

        def close(self) -> None:
            pass

    p = Pool(lambda: Client(), "t")  # type: ignore[arg-type, return-value]
    try:
        for _ in range(20):
            p.background(lambda c: time.sleep(0.2))  # a queue of slow releases
        assert p.call(lambda c: 42, deadline=0.05) == 42
        assert p.up
    finally:
        p.close()


def test_an_admission_vllm_covers_costs_the_scheduler_no_pool_round_trip(model: str, pool: Server) -> None:
    """vLLM's own cache holds the whole prompt: what the pool still has is asked off the
    scheduler's thread (a slow pool delays nothing, and is not marked down)."""
    ps = {"r": prompts(1, seed=27)["r0"]}
    e = SimEngine(model, extra_for(pool), num_blocks=400)
    run(e, ps, 2)
    sched = e.sched_connector._scheduler
    client = sched.store.client
    lookups = {"n": 0}

    class Slow:
        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def lookup(self, chain: list[str]) -> int:
            lookups["n"] += 1
            time.sleep(0.5)
            return client.lookup(chain)

    sched.store._client = Slow()
    e.add("again", ps["r"], 2)
    t0 = time.monotonic()
    e.step()
    assert time.monotonic() - t0 < 0.3, "the scheduler waited for the pool"
    e.run()
    assert sched.store.up and lookups["n"] == 1


# ---- KV events ------------------------------------------------------------------------------


def test_vllms_own_publisher_carries_pool_blocks_a_router_matches_to_gpu_blocks(model: str, pool: Server) -> None:
    """vLLM's ZMQ event publisher and a subscriber as a KV-aware router runs it: every block the
    pool announces is matched, by hash, to a block the engine's GPU cache announced."""
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = SimEngine(model, extra_for(pool), num_blocks=400, kv_events=True)
    e.scheduler.kv_event_publisher = EventPublisherFactory.create(
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kv"))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # the subscription reaches the publisher
    try:
        run(e, prompts(3, seed=28), 4)
        deadline = time.monotonic() + 5
        gpu, pool_blocks = set(), []
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while time.monotonic() < deadline:
            if not sub.poll(200):
                if pool_blocks:
                    break
                continue
            _, _, payload = sub.recv_multipart()
            for ev in decoder.decode(payload).events:
                if isinstance(ev, BlockStored):
                    (gpu.update(ev.block_hashes) if ev.medium == "GPU" else pool_blocks.append(ev))
        assert pool_blocks, "the pool announced nothing"
        assert all(isinstance(h, int) for ev in pool_blocks for h in ev.block_hashes)
        unmatched = [ev.block_hashes for ev in pool_blocks if not set(ev.block_hashes) <= gpu]
        assert not unmatched, f"{len(unmatched)} pool blocks match no GPU block"
    finally:
        sub.close(linger=0)
        e.scheduler.kv_event_publisher.shutdown()
        e.close()


def test_a_removal_on_any_shard_removes_the_block(pool: Server) -> None:
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvpool.vllm.events import KvEvents
    from kvpool.vllm.keys import KeyLayout
    from kvpool.vllm.metadata import SaveJob

    prefixes = KeyLayout("ev", tp_size=2).lookup_prefixes()
    c = client_of(pool)
    h = "ab" * 32
    c.put_batch([f"{p}@{h}" for p in prefixes], [b"x", b"y"])
    ev = KvEvents(lambda: client_of(pool), prefixes, 16)
    try:
        time.sleep(0.5)  # the follower subscribes
        ev.saved(SaveJob(1, "r", [0], [h], [None], [3]), set())
        deadline = time.monotonic() + 5
        while h in ev.pending:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        c.remove([f"{prefixes[1]}@{h}"], force=True)  # the second shard only
        while True:
            removed = [x for x in ev.take() if isinstance(x, BlockRemoved)]
            if removed:
                assert removed[0].block_hashes == [maybe_convert_block_hash(bytes.fromhex(h))]
                break
            assert time.monotonic() < deadline, "a block missing one shard was never reported removed"
            time.sleep(0.05)
    finally:
        ev.close()


def test_a_fail_policy_on_vllm_serves_command_line_is_kept(model: str, pool: Server,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default is "fail" and vLLM keeps no record of a user's choice: the connector turns
    it into "recompute" unless the user said "fail" where it can be seen, here vllm serve's
    command line (which vLLM's engine processes inherit)."""
    import sys

    e = SimEngine(model, extra_for(pool), num_blocks=64, load_failure_policy="fail")
    assert e.config.kv_transfer_config.kv_load_failure_policy == "recompute"
    e.close()
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", model, "--kv-transfer-config",
                                      '{"kv_connector": "KVPoolConnector", "kv_load_failure_policy": "fail"}'])
    e = SimEngine(model, extra_for(pool), num_blocks=64, load_failure_policy="fail")
    assert e.config.kv_transfer_config.kv_load_failure_policy == "fail"
    e.close()
