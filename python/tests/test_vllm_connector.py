"""The vLLM connector under vLLM 0.32's real scheduler: preemption and resume, chunked prefill,
requests that finish with saves pending, blocks lost between lookup and load, a full pool, roles,
resets, events and stats. Engines are ``vllm_sim.SimEngine``: vLLM's scheduler and both sides of
the connector against a real kvpool server, with a stand-in model whose KV cache says whether
every slot a request attends to holds that request's own prefix (see ``vllm_sim``).

Needs vLLM (``.ci/vllm-e2e.sh`` runs this file in its venv; ``conftest.py`` leaves it out of the
plain suite where vLLM is not installed).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import vllm_sim
from conftest import REPO, Cluster, Server
from vllm_sim import SimEngine, audit

from kvpool import Client

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    import sys

    sys.path.insert(0, str(REPO / "examples" / "vllm_prefix_reuse"))
    import tiny_llama

    return str(tiny_llama.build(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture
def pool() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def extra_for(s: Server, **more: Any) -> dict[str, Any]:
    return {"kvpool_server": s.addr, "kvpool_api_key": s.api_key, "kvpool_fingerprint": s.fingerprint, **more}


def client_of(s: Server) -> Client:
    return Client(s.addr, s.api_key, fingerprint=s.fingerprint)


def prompts(n: int, shared: int = 100, seed: int = 1) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    head = [rnd.randrange(3, 100) for _ in range(shared)]
    return {f"r{i}": head + [rnd.randrange(3, 100) for _ in range(40 + 7 * i)] for i in range(n)}


_cold: dict[tuple[Any, ...], dict[str, list[int]]] = {}


def cold(model: str, ps: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Outputs of an engine without the connector and with room for everything."""
    key = (tuple((r, tuple(p)) for r, p in ps.items()), max_tokens)
    if key not in _cold:
        e = SimEngine(model, {}, num_blocks=2000, connector=False)
        for r, p in ps.items():
            e.add(r, p, max_tokens)
        e.run()
        assert not e.violations
        _cold[key] = {r: e.output(r) for r in ps}
        e.close()
    return _cold[key]


def run(e: SimEngine, ps: dict[str, list[int]], max_tokens: int) -> SimEngine:
    for r, p in ps.items():
        e.add(r, p, max_tokens)
    e.run()
    return e


def finish_with_saves_held(e: SimEngine, ps: dict[str, list[int]]) -> threading.Event:
    """Run the requests to their end while every save waits for the returned gate."""
    gate = threading.Event()
    mover = e.worker._worker.mover
    inner = mover.save
    mover.save = lambda *a, **k: (gate.wait(30), inner(*a, **k))[1]
    for r, p in ps.items():
        e.add(r, p, 4)
    while e.scheduler.has_unfinished_requests():
        e.step()
    return gate


def prefix_of(e: SimEngine) -> str:
    return e.sched_connector._scheduler.prefixes[0]


def worker_counters(e: SimEngine) -> dict[str, Any]:
    return e.worker.connector_stats()


def check_right(e: SimEngine, model: str, ps: dict[str, list[int]], max_tokens: int, s: Server) -> None:
    """Every step attended to the right KV, every answer equals the cold engine's, no block is
    still referenced, and every block in the pool holds its own prefix's KV."""
    assert not e.violations, e.violations[:3]
    want = cold(model, ps, max_tokens)
    assert {r: e.output(r) for r in ps} == want
    assert e.block_refs() == 0
    checked, wrong = audit(client_of(s), prefix_of(e), [p + want[r] for r, p in ps.items()])
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("transport", ["shm", "quic"])
@pytest.mark.parametrize("load", ["sync", "async"])
def test_preempted_requests_resume_with_their_blocks_loaded(model: str, pool: Server, runner: str,
                                                            transport: str, load: str) -> None:
    ps = prompts(12)
    ex = extra_for(pool, kvpool_transport=transport, load_async=load == "async")
    # One engine stores the shared prefix; a second one, short of KV cache, runs everything.
    run(SimEngine(model, ex, num_blocks=400), dict(list(ps.items())[:2]), 40)
    e = SimEngine(model, ex, num_blocks=36, max_batched=64, v2_outputs=runner == "v2")
    resumed_as_new: list[str] = []
    modes: set[bool] = set()

    def watch(eng: SimEngine, out: Any) -> None:
        resumed_as_new.extend(n.req_id for n in out.scheduled_new_reqs
                              if n.prefill_token_ids is not None and len(n.prefill_token_ids) > len(ps[n.req_id]))
        modes.update(j.asynchronous for j in out.kv_connector_metadata.loads)

    e.between = watch
    run(e, ps, 40)
    assert modes == {load == "async"}, "loads ran in the other mode"
    assert e.preemptions > 0, "the cache was meant to be too small for every request at once"
    assert bool(resumed_as_new) == (runner == "v2")
    assert e.worker.connector_stats()["loaded_blocks"] > 0
    check_right(e, model, ps, 40, pool)


@pytest.mark.parametrize("load", ["sync", "async"])
def test_engines_share_a_cluster_pool_through_its_master(model: str, cluster: Cluster, load: str) -> None:
    """The connector pointed at a cluster master (nothing else set): one engine's saves land on
    the storage nodes, a second engine, preempted on a small cache, loads them back through the
    master, and every answer and every stored block is right."""
    ps = prompts(8, seed=21 if load == "sync" else 22)
    ex = extra_for(cluster.master, load_async=load == "async")
    first = run(SimEngine(model, ex, num_blocks=400), dict(list(ps.items())[:2]), 20)
    assert first.sched_connector._scheduler.store.client.cluster
    saved = worker_counters(first)["saved_blocks"]
    assert saved > 0
    c = client_of(cluster.master)
    chain = [f"{prefix_of(first)}@{bytes(h).hex()}" for h in first.requests["r0"].block_hashes]
    deadline = time.monotonic() + 10
    while c.lookup(chain) < len(ps["r0"]) // vllm_sim.BLOCK:  # the nodes report to the master
        assert time.monotonic() < deadline, "saved blocks never became visible through the master"
        time.sleep(0.02)
    e = SimEngine(model, ex, num_blocks=36, max_batched=64)
    run(e, ps, 20)
    assert e.preemptions > 0
    assert worker_counters(e)["loaded_blocks"] > 0
    check_right(e, model, ps, 20, cluster.master)
    # A reset drops this model's blocks on every node.
    assert e.sched_connector.reset_cache() is not False
    deadline = time.monotonic() + 10
    while c.lookup(chain) != 0:
        assert time.monotonic() < deadline, "the reset left blocks on the nodes"
        time.sleep(0.02)


def test_a_killed_storage_node_costs_only_its_blocks(model: str) -> None:
    """A storage node is killed (no close) under a two-node cluster: its blocks become misses that
    vLLM computes, the other node's blocks still load, and the pool is never marked down."""
    c = Cluster(nodes=2)
    try:
        ps = prompts(6, seed=23)
        ex = extra_for(c.master, kvpool_dead_after_s=0.5)
        run(SimEngine(model, ex, num_blocks=400), ps, 4)
        probe = client_of(c.master)
        per_node = []
        for n in c.nodes:
            nc = Client(n.addr, c.api_key, fingerprint=n.fingerprint, transport="quic")
            per_node.append(int(nc.stats()["blocks"]))
            nc.close()
        # The node holding more of them dies.
        dead = per_node.index(max(per_node))
        assert per_node[dead] > 0
        c.nodes[dead].kill()
        e = SimEngine(model, ex, num_blocks=400)
        run(e, ps, 4)
        check_right(e, model, ps, 4, c.master)
        w = worker_counters(e)
        sched = e.sched_connector._scheduler
        assert sched.store.up and sched.store.counters["pool_down_events"] == 0
        # vLLM asks again for a request whose load failed: a block that failed is not offered
        # again (the master routes to the dead node until it times it out), so no block fails
        # twice and no request loops on loads that cannot succeed.
        full_blocks = sum(len(p) // vllm_sim.BLOCK for p in ps.values())
        assert w["load_failed_blocks"] + w["loaded_blocks"] <= full_blocks, w
        if per_node[1 - dead]:
            assert w["loaded_blocks"] > 0, "the live node's blocks were not loaded"
        probe.close()
    finally:
        c.stop()


def test_saves_slower_than_steps_never_store_another_requests_kv(model: str, pool: Server) -> None:
    """Saves that take longer than steps, while preemption frees and reuses blocks: each save
    still reads the blocks it was given (the scheduler side references them)."""
    ps = prompts(10, seed=2)
    e = SimEngine(model, extra_for(pool), num_blocks=30, max_batched=48)
    mover = e.worker._worker.mover
    slow = mover.save

    def save(*a: Any, **k: Any) -> Any:
        time.sleep(0.03)
        return slow(*a, **k)

    mover.save = save
    held: list[int] = []

    def check_refs(eng: SimEngine, out: Any) -> None:
        sched = eng.sched_connector._scheduler
        blocks = eng.scheduler.kv_cache_manager.block_pool.blocks
        for job in sched.jobs.values():
            held.extend(job.refs)
            assert all(blocks[b].ref_cnt > 0 for b in job.refs), "a block of a save in flight was freed"

    e.between = check_refs
    run(e, ps, 30)
    assert e.preemptions > 0 and held
    assert worker_counters(e)["saved_blocks"] > 0
    check_right(e, model, ps, 30, pool)


def test_a_request_that_finishes_with_saves_pending(model: str, pool: Server) -> None:
    ps = prompts(1, shared=64, seed=3)
    e = SimEngine(model, extra_for(pool), num_blocks=100)
    gate = finish_with_saves_held(e, ps)
    # The request is gone from vLLM; its save is not done and still holds its blocks.
    sched = e.sched_connector._scheduler
    assert sched.jobs and e.sched_connector.has_pending_push_work()
    assert e.block_refs() > 0
    gate.set()
    e.run()
    assert not e.sched_connector.has_pending_push_work()
    check_right(e, model, ps, 4, pool)
    assert worker_counters(e)["saved_blocks"] == (len(ps["r0"])) // vllm_sim.BLOCK


def test_chunked_prefill_saves_every_chunk(model: str, pool: Server) -> None:
    ps = {"long": [random.Random(4).randrange(3, 100) for _ in range(300)]}
    a = run(SimEngine(model, extra_for(pool), num_blocks=200, max_batched=64), ps, 8)
    assert a.steps > 5, "the prompt should take several chunks"
    full = 300 // vllm_sim.BLOCK
    assert worker_counters(a)["saved_blocks"] == full
    b = run(SimEngine(model, extra_for(pool), num_blocks=200, max_batched=64), ps, 8)
    assert worker_counters(b)["loaded_blocks"] == full
    check_right(b, model, ps, 8, pool)


def _drop_loads(client: Client, layout_prefix: str) -> Any:
    """Between lookup and load, the pool loses the blocks the scheduler counted on."""
    dropped: list[str] = []

    def hook(e: SimEngine, out: Any) -> None:
        for job in out.kv_connector_metadata.loads:
            keys = [f"{layout_prefix}@{h}" for h in job.hashes[len(job.hashes) // 2 :]]
            client.remove(keys, force=True)
            dropped.extend(keys)

    return hook, dropped


@pytest.mark.parametrize("load", ["sync", "async"])
def test_a_block_lost_between_lookup_and_load_is_computed(model: str, pool: Server, load: str) -> None:
    ps = prompts(4, seed=5)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 8)
    # vLLM's own default is "fail": the connector turns it to "recompute".
    e = SimEngine(model, extra_for(pool, load_async=load == "async"), num_blocks=400, load_failure_policy="fail")
    assert e.config.kv_transfer_config.kv_load_failure_policy == "recompute"
    e.between, dropped = _drop_loads(client_of(pool), prefix_of(e))
    run(e, ps, 8)
    assert dropped and e.invalid_blocks > 0
    assert worker_counters(e)["load_failed_blocks"] > 0
    check_right(e, model, ps, 8, pool)


def test_failing_a_request_on_a_lost_block_stays_possible(model: str, pool: Server) -> None:
    from vllm.v1.request import RequestStatus

    ps = prompts(2, seed=6)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    e = SimEngine(model, extra_for(pool, kvpool_load_failure_policy="fail"), num_blocks=400)
    assert e.config.kv_transfer_config.kv_load_failure_policy == "fail"
    e.between, dropped = _drop_loads(client_of(pool), prefix_of(e))
    run(e, ps, 4)
    assert dropped
    assert all(e.requests[r].status == RequestStatus.FINISHED_ERROR for r in ps)


def test_the_lookup_holds_its_blocks_until_the_load_is_done(model: str, pool: Server) -> None:
    ps = prompts(3, seed=7)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    c = client_of(pool)
    seen: list[str] = []

    def hook(e: SimEngine, out: Any) -> None:
        for job in out.kv_connector_metadata.loads:
            key = f"{prefix_of(e)}@{job.hashes[-1]}"
            assert c.remove([key]) == ["leased"], "a block the scheduler counted on was not held"
            seen.append(key)

    e = SimEngine(model, extra_for(pool), num_blocks=400)
    e.between = hook
    run(e, ps, 4)
    assert seen
    # Loaded: the holds went with the loads (released in the background).
    deadline = time.monotonic() + 5
    while c.remove([seen[0]]) == ["leased"]:
        assert time.monotonic() < deadline, "a hold outlived its load"
        time.sleep(0.05)
    check_right(e, model, ps, 4, pool)


def test_a_full_pool_leaves_answers_right(model: str) -> None:
    s = Server(dram="1MiB")
    try:
        # Hard-pinned filler takes all the room there is: every save meets a full pool.
        c = client_of(s)
        i = 0
        while c.put_batch([f"filler-{i}"], [bytes(8192)], pin="hard") == ["ok"]:
            i += 1
        ps = prompts(8, seed=8)
        e = run(SimEngine(model, extra_for(s), num_blocks=40, max_batched=64), ps, 30)
        assert worker_counters(e)["save_failed_blocks"] > 0, "the pool was meant to be full"
        assert not e.violations
        assert {r: e.output(r) for r in ps} == cold(model, ps, 30)
        assert e.block_refs() == 0
    finally:
        s.stop()


def test_a_consumer_never_saves_and_a_producer_never_loads(model: str, pool: Server) -> None:
    ps = prompts(3, seed=9)
    c = client_of(pool)
    cons = run(SimEngine(model, extra_for(pool), num_blocks=400, kv_role="kv_consumer"), ps, 4)
    assert worker_counters(cons)["saved_blocks"] == 0
    assert c.stats()["blocks"] == 0
    prod = run(SimEngine(model, extra_for(pool), num_blocks=400, kv_role="kv_producer"), ps, 4)
    assert worker_counters(prod)["saved_blocks"] > 0
    prod2 = run(SimEngine(model, extra_for(pool), num_blocks=400, kv_role="kv_producer"), ps, 4)
    assert prod2.sched_connector.connector_stats()["lookups"] == 0
    assert worker_counters(prod2)["loaded_blocks"] == 0
    cons2 = run(SimEngine(model, extra_for(pool), num_blocks=400, kv_role="kv_consumer"), ps, 4)
    assert worker_counters(cons2)["loaded_blocks"] > 0
    for e in (cons, prod, prod2, cons2):
        assert {r: e.output(r) for r in ps} == cold(model, ps, 4)


def test_engines_loading_one_model_from_different_paths_share_blocks(model: str, pool: Server, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / Path(model).name
    other.parent.mkdir()
    other.symlink_to(model, target_is_directory=True)
    ps = prompts(2, seed=10)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    b = run(SimEngine(str(other), extra_for(pool), num_blocks=400), ps, 4)
    assert prefix_of(b).startswith(Path(model).name + "@")
    assert worker_counters(b)["loaded_blocks"] > 0
    check_right(b, model, ps, 4, pool)


def test_reset_cache_drops_this_models_blocks_even_those_saved_meanwhile(model: str, pool: Server) -> None:
    ps = prompts(2, seed=11)
    c = client_of(pool)
    m2 = run(SimEngine(model, extra_for(pool, model_name="other-model"), num_blocks=400), ps, 4)
    e = SimEngine(model, extra_for(pool), num_blocks=400, kv_events=True)
    gate = finish_with_saves_held(e, ps)
    # A save is in flight when vLLM resets its prefix cache.
    assert e.sched_connector.has_pending_push_work()
    assert e.sched_connector.reset_cache() is True
    gate.set()
    e.run()
    mine = prefix_of(e)
    theirs = prefix_of(m2)
    chain = [bytes(h).hex() for h in e.requests["r0"].block_hashes]
    # A save that was in flight drops its keys again once done (in the background).
    deadline = time.monotonic() + 5
    while c.lookup([f"{mine}@{h}" for h in chain]) != 0:
        assert time.monotonic() < deadline, "blocks saved across the reset came back"
        time.sleep(0.05)
    assert c.lookup([f"{theirs}@{h}" for h in chain]) > 0, "another model's blocks went too"
    assert any(type(ev).__name__ == "AllBlocksCleared" for ev in e.published)


def test_kv_events_tell_vllm_what_the_pool_holds(model: str, pool: Server) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    ps = prompts(1, shared=32, seed=12)
    e = run(SimEngine(model, extra_for(pool), num_blocks=400, kv_events=True), ps, 4)
    stored = [ev for ev in e.published if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    req = e.requests["r0"]
    full = len(ps["r0"]) // vllm_sim.BLOCK
    # Hashes as vLLM sends them (64-bit ints by default), so a router matches them to GPU blocks.
    assert [ev.block_hashes[0] for ev in stored] == [maybe_convert_block_hash(h) for h in req.block_hashes[:full]]
    gpu = {h for ev in e.published if isinstance(ev, BlockStored) and ev.medium == "GPU" for h in ev.block_hashes}
    assert {ev.block_hashes[0] for ev in stored} <= gpu
    for b, ev in enumerate(stored):
        assert ev.token_ids == ps["r0"][b * vllm_sim.BLOCK : (b + 1) * vllm_sim.BLOCK]
        assert ev.parent_block_hash == (maybe_convert_block_hash(req.block_hashes[b - 1]) if b else None)
        assert ev.group_idx == 0 and ev.extra_keys == [None]
    # The pool lets one go: vLLM hears of it.
    gone = bytes(req.block_hashes[full - 1])
    client_of(pool).remove([f"{prefix_of(e)}@{gone.hex()}"], force=True)
    deadline = time.monotonic() + 5
    while True:
        e.step()
        removed = [ev for ev in e.published if isinstance(ev, BlockRemoved) and ev.medium == "CPU"]
        if removed:
            assert removed[0].block_hashes == [maybe_convert_block_hash(gone)] and removed[0].group_idx == 0
            break
        assert time.monotonic() < deadline, "no BlockRemoved for a block the pool dropped"
        time.sleep(0.05)


def test_kv_events_after_a_pool_restart_remove_what_the_pool_lost(model: str) -> None:
    """The pool restarts empty (a new event log, nothing recovered): the follower cannot resume
    its cursor, asks the pool what it still holds and tells vLLM every lost block is gone."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    s = Server()
    try:
        ps = prompts(1, shared=32, seed=13)
        e = run(SimEngine(model, extra_for(s), num_blocks=400, kv_events=True), ps, 4)
        stored = {ev.block_hashes[0] for ev in e.published if isinstance(ev, BlockStored) and ev.medium == "CPU"}
        assert stored, "nothing announced"
        s.kill()
        s.start_again()
        deadline = time.monotonic() + 10
        while True:
            e.step()
            removed = {
                h for ev in e.published if isinstance(ev, BlockRemoved) and ev.medium == "CPU" for h in ev.block_hashes
            }
            if removed == stored:
                break
            assert removed <= stored, "BlockRemoved for a block never announced"
            assert time.monotonic() < deadline, f"{len(removed)} of {len(stored)} lost blocks reported"
            time.sleep(0.05)
    finally:
        s.stop()


def test_connector_stats_reach_vllms_metrics(model: str, pool: Server) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvpool.vllm import KVPoolConnector

    ps = prompts(3, seed=13)
    run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    e = run(SimEngine(model, extra_for(pool), num_blocks=400), ps, 4)
    assert e.connector_stats, "vLLM's scheduler stats carried no connector stats"
    merged = KVPoolConnector.build_kv_connector_stats()
    for d in e.connector_stats:
        merged.aggregate(KVPoolConnector.build_kv_connector_stats(d))
    red = merged.reduce()
    assert red["kvpool_lookup_count"] == 3 and red["kvpool_lookup_hit_blocks"] > 0
    assert red["kvpool_load_blocks"] == worker_counters(e)["loaded_blocks"] > 0
    assert red["kvpool_load_p99_ms"] >= red["kvpool_load_p50_ms"] > 0
    reg = CollectorRegistry()

    def bound(cls: Any) -> Any:
        return type(cls.__name__, (cls,), {"__init__": lambda s, *a, **k: cls.__init__(s, *a, registry=reg, **k)})

    prom = KVPoolConnector.build_prom_metrics(
        e.config, {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}, ["engine"], {0: ["0"]}
    )
    for d in e.connector_stats:
        prom.observe(d, 0)
    loaded = reg.get_sample_value("vllm:kvpool_blocks_total", {"engine": "0", "operation": "load"})
    assert loaded == worker_counters(e)["loaded_blocks"]
    assert reg.get_sample_value("vllm:kvpool_lookup_hit_blocks_total", {"engine": "0"}) == red["kvpool_lookup_hit_blocks"]


def test_staged_transfers_never_register_the_kv_cache(model: str, pool: Server) -> None:
    """The device path on CPU: blocks move through a staging area of four blocks (one per half
    of the loads' part and of the saves' part, so a batch takes several rounds, and loads run
    while saves do); the KV tensors are never registered, and no stored block holds another's
    KV."""
    ps = prompts(10, seed=14)
    ex = extra_for(pool, kvpool_staging="always", kvpool_staging_bytes=4 * 2 * vllm_sim.BLOCK * vllm_sim.DIM * 4)
    run(SimEngine(model, ex, num_blocks=400), dict(list(ps.items())[:3]), 20)
    e = SimEngine(model, ex, num_blocks=36, max_batched=64)
    w = e.worker._worker
    kv_ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in e.kv.values()]
    regs = w.client.registered()
    assert len(regs) == 1 and regs[0][1] == 4 * w.mover.block_bytes
    assert not any(lo <= regs[0][0] < hi for lo, hi in kv_ranges)
    run(e, ps, 20)
    assert e.preemptions > 0
    assert worker_counters(e)["loaded_blocks"] > 0 and worker_counters(e)["saved_blocks"] > 0
    check_right(e, model, ps, 20, pool)


@pytest.mark.parametrize("load", ["sync", "async"])
def test_a_dead_pool_costs_each_request_no_more_than_the_lookup_deadline(model: str, load: str) -> None:
    """The pool is killed (no close reaches the engine) while an engine runs: lookups give up at
    their deadline and then are skipped, saves are dropped and counted, answers stay right; the
    pool comes back and the engine uses it again, without a restart."""
    s = Server()
    try:
        ps = prompts(6, seed=15)
        ex = extra_for(s, kvpool_lookup_deadline_ms=50, load_async=load == "async")
        e = SimEngine(model, ex, num_blocks=400)
        run(e, ps, 4)
        sched = e.sched_connector._scheduler
        assert sched.store.up and worker_counters(e)["saved_blocks"] > 0
        s.kill()
        # The same prompts again, with the engine's own prefix cache dropped: every lookup would
        # hit the pool, which is gone.
        assert e.scheduler.reset_prefix_cache()
        again = {f"{r}-again": p for r, p in ps.items()}
        lookups: list[float] = []
        inner = sched.get_num_new_matched_tokens

        def timed(req: Any, n: int) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(req, n)
            finally:
                lookups.append(time.perf_counter() - t0)

        sched.get_num_new_matched_tokens = timed  # type: ignore[method-assign]
        t0 = time.monotonic()
        run(e, again, 4)
        took = time.monotonic() - t0
        assert not sched.store.up
        c = sched.counters()
        assert c["pool_down_events"] == 1 and c["lookups_skipped"] == len(again)
        assert max(lookups) < 0.2, f"a lookup waited {max(lookups) * 1e3:.0f} ms on a dead pool"
        assert sorted(lookups)[-2] < 0.01, "after the first, lookups should not touch the network"
        assert took < 5, f"{took:.1f} s for {len(again)} short requests on a dead pool"
        assert {r: e.output(r) for r in again} == {f"{r}-again": o for r, o in cold(model, ps, 4).items()}
        assert not e.violations
        # Back: the same address, a pool emptied by the restart (DRAM only).
        s.start_again()
        deadline = time.monotonic() + 5
        while not (sched.store.up and e.worker._worker.store.up):
            assert time.monotonic() < deadline, "the pool answered again, but the engine did not use it within 5 s"
            e.step()
            time.sleep(0.05)
        third = {f"{r}-third": p for r, p in ps.items()}
        run(e, third, 4)
        assert worker_counters(e)["pool_reconnects"] == 1
        assert e.scheduler.reset_prefix_cache()
        fourth = {f"{r}-fourth": p for r, p in ps.items()}
        before = worker_counters(e)["loaded_blocks"]
        run(e, fourth, 4)
        assert worker_counters(e)["loaded_blocks"] > before, "no hits after the pool came back"
        assert not e.violations
        e.close()
    finally:
        s.stop()
