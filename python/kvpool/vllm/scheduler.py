"""The scheduler side: what the pool has (a lookup that holds what it counted), which blocks to load
and save each step, and the references that keep a saved block's memory from being reused.

A request's life as vLLM 0.32's scheduler drives it, and what this side does at each step:

1. ``get_num_new_matched_tokens`` (waiting, or preempted and waiting again): one
   ``lookup_lease`` per distinct shard of the request's block-hash chain. The resident leading
   blocks stay in the pool until the load is done (or the request ends, or the hold's time).
2. ``update_state_after_alloc``: the tokens vLLM counted as computed from the pool become a
   pending load into the blocks just allocated; a fresh record of the request starts (a resumed
   request's blocks are all new).
3. ``build_connector_meta``: a request scheduled this step, new or resumed (V1 runner:
   ``scheduled_cached_reqs.resumed_req_ids``; V2 runner: ``scheduled_new_reqs``), gets its load;
   every full block a step completes within the prefill (and the decode, with
   ``save_decode_cache``) is saved. Each save job takes a reference on its blocks in vLLM's block
   pool: preempted or finished, the request's blocks cannot be handed to another request until
   every worker reported the job done, so a save never reads another request's KV.
4. ``update_connector_output``: the workers' finished jobs drop their references and holds.
5. ``request_finished``: always False; the references, not the request, keep blocks alive.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

from kvpool._native import Client, KvpoolError
from kvpool.vllm.config import ConnectorConfig
from kvpool.vllm.events import KvEvents
from kvpool.vllm.health import Pool, PoolDown
from kvpool.vllm.keys import KeyLayout, hash_hex
from kvpool.vllm.metadata import KVPoolConnectorMetadata, KVPoolWorkerMetadata, LoadJob, SaveJob
from kvpool.vllm.stats import KVPoolConnectorStats, dump, take

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

# vLLM's null block (vllm.v1.attention.backends.utils.NULL_BLOCK_ID): never a request's own.
NULL_BLOCK = 0


@dataclass
class _Looked:
    """What a lookup found for a waiting request."""

    resident: int
    local: int  # tokens vLLM had computed locally when it asked
    leases: list[int]


@dataclass
class _Load:
    first: int
    end: int
    leases: list[int]


@dataclass
class _Req:
    """A scheduled request."""

    request: "Request"
    block_ids: list[int]
    saved: int  # leading blocks saved, being saved, or already there (loaded, computed locally)
    prefill_end: int  # tokens this prefill computes: the prompt, or all tokens of a resume
    # An asynchronous load was counted for it: vLLM calls update_state_after_alloc once more
    # when it is done, which must not start the record again.
    loading: bool = False


# How long a block whose load failed is not offered to vLLM again: long enough for a master to
# forget a dead node (its `node_timeout_ms`, 3 s by default), short enough that hits on a block
# that comes back resume soon.
UNLOADABLE_S = 5.0


class _Unloadable:
    """Block hashes whose load failed, each forgotten ``ttl`` seconds later."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.until: dict[str, float] = {}  # insertion order is expiry order

    def add(self, hashes: Iterable[str]) -> None:
        now = time.monotonic()
        for h in hashes:
            self.until.pop(h, None)
            self.until[h] = now + self.ttl

    def first(self, hashes: list[str]) -> Optional[int]:
        """Position of the first of ``hashes`` that failed lately, if any."""
        if not self.until:
            return None
        now = time.monotonic()
        while self.until:
            h, t = next(iter(self.until.items()))
            if t > now:
                break
            del self.until[h]
        return next((i for i, h in enumerate(hashes) if h in self.until), None)


@dataclass
class _Job:
    """A load or save the workers run; done when every worker reported it."""

    remaining: int
    refs: list[int] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    save: Optional[SaveJob] = None
    failed: set[int] = field(default_factory=set)
    loads: Optional[dict[int, str]] = None  # a load's block hashes, by position
    reset_after: bool = False  # a save in flight across reset_cache: its keys go again at the end
    req_id: str = ""
    rewind: Optional[int] = None  # a dropped save's first position to save again
    sync: bool = False  # a synchronous load: its verdict goes back to the workers


class Scheduler:
    def __init__(
        self,
        cfg: ConnectorConfig,
        layout: KeyLayout,
        block_size: int,
        role: str,
        num_workers: int,
        kv_events: bool,
        num_blocks: int = 0,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.block_size = block_size
        self.loads_on = role != "kv_producer" and cfg.enable_lookup
        self.saves_on = role != "kv_consumer"
        self.num_workers = num_workers
        self.prefixes = layout.lookup_prefixes()
        self.store = Pool(lambda: cfg.client("kvpool-vllm-scheduler"), "scheduler")
        self.pool: Optional["BlockPool"] = None
        self.local: dict[str, int] = {}
        self.looked: dict[str, _Looked] = {}
        # What the pool had of a request's chain when nothing was to be loaded from it.
        self.resident: dict[str, int] = {}
        self.lookups: dict[str, Future[tuple[int, list[int]]]] = {}
        self.pending: dict[str, _Load] = {}
        self.reqs: dict[str, _Req] = {}
        self.jobs: dict[int, _Job] = {}
        self.next_job = 0
        # Blocks a load just failed on: not counted again for a while, or vLLM, which asks
        # again for the request it now recomputes, would be told to load them again.
        self.unloadable = _Unloadable(UNLOADABLE_S)
        # Async lookups, and the checks of what the pool still has of a request vLLM's own cache
        # covers, run here, never on the scheduler's thread.
        self.bg = ThreadPoolExecutor(2, thread_name_prefix="kvpool-sched")
        # One thread: a pool that stopped answering holds up these checks only, never a lookup.
        self.checks = ThreadPoolExecutor(1, thread_name_prefix="kvpool-sched-check")
        self.learning: dict[str, Future[int]] = {}
        # vLLM blocks that save jobs may hold at once: past it, saves are dropped (a slow pool
        # must not pin the engine's cache into preemptions).
        self.pin_limit = cfg.save_pin_limit if cfg.save_pin_limit is not None else max(16, num_blocks // 4)
        self.pinned = 0
        self.verdicts: dict[int, bool] = {}  # for the workers' next metadata
        self.stats = KVPoolConnectorStats()
        self.lock = threading.Lock()
        self.totals = {"lookups": 0, "lookup_blocks": 0, "hit_blocks": 0, "lookup_errors": 0,
                       "lookups_skipped": 0, "hits_dropped_unloadable": 0, "save_dropped_pinned": 0,
                       "resident_checks": 0}
        self.events = (
            KvEvents(lambda: self.cfg.client("kvpool-vllm-events"), self.prefixes, self.block_size,
                     cfg.event_medium)
            if kv_events
            else None
        )

    # ---- lookups ------------------------------------------------------------------------

    def _lookup(self, client: Client, hashes: list[str]) -> tuple[int, list[int]]:
        """Resident leading blocks in every shard, and the holds taken on them: one request
        whatever the shards, over the chain of every shard's key of each block in turn (a block
        counts when all its shards do)."""
        t0 = time.perf_counter()
        resident = 0
        try:
            chain = [f"{p}@{h}" for h in hashes for p in self.prefixes]
            n, leases = client.lookup_lease(chain, self.cfg.lookup_lease_s)
            resident = n // len(self.prefixes)
        finally:
            with self.lock:
                self.stats.record("lookup", time.perf_counter() - t0, len(hashes), hit=resident)
        return resident, leases

    def get_num_new_matched_tokens(self, request: "Request", num_computed: int) -> tuple[Optional[int], bool]:
        rid = request.request_id
        self.local[rid] = num_computed
        if not self.loads_on:
            return 0, False
        bs = self.block_size
        n_blocks = min(len(request.block_hashes), request.num_tokens // bs)
        # vLLM computes at least one token itself, so a whole-prompt hit counts one short.
        if min(n_blocks * bs, request.num_tokens - 1) <= num_computed:
            self._learn_resident(request, n_blocks)
            return 0, False
        old = self.looked.pop(rid, None)
        if old is not None:
            self._release(old.leases)
        hashes = [hash_hex(h) for h in request.block_hashes[:n_blocks]]
        try:
            if self.cfg.lookup_async:
                fut = self.lookups.get(rid)
                if fut is None:
                    client = self.store.client
                    if not self.store.up or client is None:
                        raise PoolDown("the pool is down")
                    self.lookups[rid] = self.bg.submit(self._lookup, client, hashes)
                    return None, False
                if not fut.done():
                    return None, False
                del self.lookups[rid]
                resident, leases = fut.result()
            else:
                # A deadline of its own: past it the request is computed here, and the pool is
                # marked down until it answers a ping again.
                resident, leases = self.store.call(lambda c: self._lookup(c, hashes), self.cfg.lookup_deadline_s)
        except PoolDown as e:
            self.totals["lookups_skipped"] += 1
            if e.late is not None:
                e.late.add_done_callback(self._release_late)
            return 0, False
        except KvpoolError as e:
            if e.code in ("unavailable", "timeout"):  # type: ignore[attr-defined]
                self.store.down(str(e))
            self.totals["lookup_errors"] += 1
            log.warning("kvpool lookup failed, computing request %s locally: %s", rid, e)
            return 0, False
        failed_at = self.unloadable.first(hashes[:resident])
        if failed_at is not None:
            resident = failed_at
            self.totals["hits_dropped_unloadable"] += 1
        self.totals["lookups"] += 1
        self.totals["lookup_blocks"] += n_blocks
        self.totals["hit_blocks"] += resident
        dump(self.cfg.stats_path, "scheduler", self.counters())
        hit = min(resident * bs, request.num_tokens - 1)
        if hit <= num_computed:
            self._release(leases)
            self.resident[rid] = resident
            return 0, False
        self.looked[rid] = _Looked(resident, num_computed, leases)
        return hit - num_computed, self.cfg.load_async

    def _learn_resident(self, request: "Request", n_blocks: int) -> None:
        """vLLM's own cache has everything the pool could give: ask (without a hold, off this
        thread) what the pool still has, so that blocks it lost since this engine stored them
        (evicted, or a restart) are stored again from this engine's copies while the request
        runs. At most a few such checks are in flight; the rest are skipped."""
        rid = request.request_id
        client = self.store.client
        if (not self.saves_on or n_blocks == 0 or not self.store.up or client is None
                or rid in self.learning or len(self.learning) >= 8):
            return
        hashes = [hash_hex(h) for h in request.block_hashes[:n_blocks]]
        chain = [f"{p}@{h}" for h in hashes for p in self.prefixes]
        shards = len(self.prefixes)
        self.totals["resident_checks"] += 1
        self.learning[rid] = self.checks.submit(lambda: client.lookup(chain) // shards)

    def _apply_resident(self, rid: str, t: "_Req") -> None:
        """A check of what the pool still has came back: save again what it lost."""
        fut = self.learning.get(rid)
        if fut is None or not fut.done():
            return
        del self.learning[rid]
        try:
            t.saved = min(t.saved, fut.result())
        except KvpoolError as e:
            log.debug("kvpool: %s", e)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external: int) -> None:
        rid = request.request_id
        bs = self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        t = self.reqs.get(rid)
        if t is not None and t.loading and num_external == 0 and rid not in self.local:
            # The second call of an asynchronous load, once its blocks are in: more blocks for
            # the rest of the prompt, nothing to start again.
            t.block_ids = block_ids
            t.loading = False
            return
        local = self.local.pop(rid, 0)
        looked = self.looked.pop(rid, None)
        # Blocks vLLM had computed before are saved again only where the pool lacks them.
        in_pool = self.resident.pop(rid, None)
        saved = local // bs if in_pool is None else min(local // bs, in_pool)
        old = self.pending.pop(rid, None)
        if old is not None:
            self._release(old.leases)
        if num_external > 0 and looked is not None:
            first, end = looked.local // bs, -(-(looked.local + num_external) // bs)
            if end > looked.resident or end > len(block_ids):
                # Never load more than the lookup found: compute the rest instead.
                log.error("kvpool: request %s counted %d blocks from the pool, %d found; loading those",
                          rid, end, looked.resident)
                end = min(looked.resident, len(block_ids))
            self.pending[rid] = _Load(first, end, looked.leases)
            saved = end
        elif looked is not None:
            self._release(looked.leases)
        self.reqs[rid] = _Req(request, block_ids, saved, request.num_tokens,
                              loading=self.cfg.load_async and rid in self.pending)

    # ---- each step ----------------------------------------------------------------------

    def build_connector_meta(self, out: "SchedulerOutput") -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata()
        for rid in out.finished_req_ids:
            self._forget(rid)
        cached = out.scheduled_cached_reqs
        scheduled_anew = {r.req_id for r in out.scheduled_new_reqs} | set(cached.resumed_req_ids)
        meta.preempted = set(out.preempted_req_ids or ())
        # A request preempted and scheduled again in the same step (a prefix-cache reset of
        # running requests) keeps the record its new allocation made.
        for rid in meta.preempted - scheduled_anew:
            self._forget(rid)
        state = getattr(out, "kv_connector_block_state", None)
        for new in out.scheduled_new_reqs:
            t = self.reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            if new.prefill_token_ids is not None:
                # V2 model runner: a resumed request re-prefills prompt and output.
                t.prefill_end = len(new.prefill_token_ids)
            self._current_blocks(t, new.req_id, state)
            self._issue_load(meta, new.req_id, t)
            self._apply_resident(new.req_id, t)
            self._schedule_save(meta, t, new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0))
        for i, rid in enumerate(cached.req_ids):
            t = self.reqs.get(rid)
            if t is None:
                continue
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                # V1 model runner: a resumed request's blocks are all new, given in full.
                if ids is not None:
                    t.block_ids = list(ids[0])
            elif ids is not None:
                t.block_ids.extend(ids[0])
            self._current_blocks(t, rid, state)
            if rid in cached.resumed_req_ids:
                self._issue_load(meta, rid, t)
            self._apply_resident(rid, t)
            self._schedule_save(meta, t, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        # Asynchronous loads: their requests wait (WAITING_FOR_REMOTE_KVS), not scheduled.
        for rid in [r for r, t in self.reqs.items() if t.loading and r in self.pending]:
            self._issue_load(meta, rid, self.reqs[rid], asynchronous=True)
        self._take_jobs(meta)
        meta.load_verdicts, self.verdicts = self.verdicts, {}
        return meta

    @staticmethod
    def _current_blocks(t: _Req, rid: str, state: Any) -> None:
        """vLLM 0.32 hands connectors the block tables as they are now: they win over the record
        built from this step's additions."""
        if state is not None:
            ids = state.get_block_ids(rid)
            if ids is not None:
                t.block_ids = list(ids[0])

    def _issue_load(self, meta: KVPoolConnectorMetadata, rid: str, t: _Req, asynchronous: bool = False) -> None:
        load = self.pending.pop(rid, None)
        if load is None:
            return
        # Null blocks stand for positions a sliding window no longer needs: nothing to load there.
        positions = [b for b in range(load.first, min(load.end, len(t.block_ids))) if t.block_ids[b] != NULL_BLOCK]
        hashes = [hash_hex(t.request.block_hashes[b]) for b in positions]
        job = LoadJob(self._job_id(), rid, positions, hashes, [t.block_ids[b] for b in positions], asynchronous)
        meta.loads.append(job)
        self.jobs[job.job] = _Job(self.num_workers, leases=load.leases, loads=dict(zip(positions, hashes)), req_id=rid,
                                  sync=not asynchronous)

    def _schedule_save(self, meta: KVPoolConnectorMetadata, t: _Req, computed_after: int) -> None:
        """Save the full blocks this step completes (within the prefill, unless
        ``save_decode_cache``)."""
        if not self.saves_on:
            return
        bs = self.block_size
        limit = computed_after if self.cfg.save_decode_cache else min(computed_after, t.prefill_end)
        hashes = t.request.block_hashes
        end = min(limit // bs, len(hashes), len(t.block_ids))
        start = t.saved
        if end <= start:
            return
        t.saved = end
        positions = [
            b for b in range(start, end) if (b + 1) * bs >= self.cfg.store_threshold and t.block_ids[b] != NULL_BLOCK
        ]
        if self.pool is not None and len(positions) > self.pin_limit - self.pinned:
            # Saves already hold as many of vLLM's blocks as they may: the leading blocks that
            # fit are saved (a chain is found from its root), the rest are dropped.
            keep = max(0, self.pin_limit - self.pinned)
            self.totals["save_dropped_pinned"] += len(positions) - keep
            positions = positions[:keep]
        if not positions:
            return
        if self.pool is not None:
            self.pinned += len(positions)  # referenced by _take_jobs, this step
        meta.saves.append(
            SaveJob(
                self._job_id(),
                t.request.request_id,
                positions,
                [hash_hex(hashes[b]) for b in positions],
                [hash_hex(hashes[b - 1]) if b > 0 else None for b in positions],
                [t.block_ids[b] for b in positions],
            )
        )
        if self.events is not None:
            self.events.remember(meta.saves[-1], t.request, bs)

    def _take_jobs(self, meta: KVPoolConnectorMetadata) -> None:
        """Reference the blocks of this step's saves until every worker has read them."""
        pool = self.pool
        for s in meta.saves:
            job = _Job(self.num_workers, save=s)
            if pool is None:
                meta.unreferenced = True
            else:
                pool.touch([pool.blocks[b] for b in s.block_ids])
                job.refs = list(s.block_ids)
            job.req_id = s.req_id
            self.jobs[s.job] = job

    def _job_id(self) -> int:
        self.next_job += 1
        return self.next_job

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        wm = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVPoolWorkerMetadata):
            return
        for job_id, n in wm.done.items():
            job = self.jobs.get(job_id)
            if job is None:
                continue
            job.failed |= wm.failed.get(job_id, set())
            if job_id in wm.rewind:
                job.rewind = min(wm.rewind[job_id], job.rewind if job.rewind is not None else wm.rewind[job_id])
            job.remaining -= n
            if job.remaining > 0:
                continue
            del self.jobs[job_id]
            if job.refs and self.pool is not None:
                # Tail first, as vLLM frees, so a shared prefix is reused last.
                self.pool.free_blocks(self.pool.blocks[b] for b in reversed(job.refs))
                self.pinned -= len(job.refs)
            self._release(job.leases)
            if job.sync:
                self.verdicts[job_id] = bool(job.failed)
            if job.loads and job.failed:
                self.unloadable.add(job.loads[p] for p in job.failed if p in job.loads)
                # vLLM computes the request again from its first failed block: those blocks
                # are saved once computed (whatever this side counted as saved before).
                t = self.reqs.get(job.req_id)
                if t is not None:
                    t.saved = min(t.saved, min(job.failed))
            if job.rewind is not None and job.req_id in self.reqs:
                # A save dropped because its step read a failed load: saved again once computed.
                t = self.reqs[job.req_id]
                t.saved = min(t.saved, job.rewind)
            if job.save is not None:
                if job.reset_after:
                    self._drop_keys(job.save.hashes)
                elif self.events is not None:
                    self.events.saved(job.save, job.failed)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a save job holds block references: completions reach
        this side only with a step's output."""
        return any(j.refs for j in self.jobs.values())

    # ---- request ends, resets -----------------------------------------------------------

    def _forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self.local.pop(rid, None)
        self.resident.pop(rid, None)
        for d in (self.looked, self.pending):
            x = d.pop(rid, None)
            if x is not None:
                self._release(x.leases)
        fut = self.lookups.pop(rid, None)
        if fut is not None:
            fut.add_done_callback(self._release_late)
        self.learning.pop(rid, None)

    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        self._forget(request.request_id)
        return False, None

    def reset_cache(self) -> bool:
        """Drop this model's blocks from the pool (vLLM's ``reset_prefix_cache`` after a weight
        update). Saves still in flight drop their keys again when they finish."""
        for rid in list(self.looked) + list(self.pending):
            for d in (self.looked, self.pending):
                x = d.pop(rid, None)
                if x is not None:
                    self._release(x.leases)
        for job in self.jobs.values():
            if job.save is not None:
                job.reset_after = True
        try:
            removed, kept = self.store.call(lambda c: c.remove_matching(self.layout.model_prefix, force=True))
        except (KvpoolError, PoolDown) as e:
            log.error("kvpool: reset of %s* failed: %s", self.layout.model_prefix, e)
            return False
        log.info("kvpool: reset dropped %d blocks of %s*", removed, self.layout.model_prefix)
        if self.events is not None:
            self.events.cleared()
        return True

    def _drop_keys(self, hashes: list[str]) -> None:
        keys = [k for p in self.prefixes for k in KeyLayout.chain(p, hashes)]
        self.store.background(lambda c: c.remove(keys, force=True))

    def _release(self, leases: Iterable[int]) -> None:
        """End holds, off the scheduler's thread. A hold that already ended answers `expired`;
        holds on a pool that went away went with its connection: nothing to undo either way."""
        leases = list(leases)
        if leases:
            self.store.background(lambda c: [self._quietly(c.release, x) for x in leases])

    def _release_late(self, fut: "Future[tuple[int, list[int]]]") -> None:
        if fut.exception() is None:
            self._release(fut.result()[1])

    @staticmethod
    def _quietly(f: Any, *args: Any) -> None:
        try:
            f(*args)
        except KvpoolError as e:
            log.debug("kvpool: %s", e)

    # ---- telemetry ----------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        return {**self.totals, **self.store.counters}

    def take_stats(self) -> Optional[KVPoolConnectorStats]:
        return take(self)

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.bg.shutdown(wait=True)
        self.checks.shutdown(wait=True)
        self.store.close()
