"""The worker side: each step's loads (before the step's first attention layer) and saves (after
its forward pass, on a background thread), and the report of finished jobs the scheduler side
needs to let go of block references and pool holds."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from kvpool._native import Client, KvpoolError
from kvpool.vllm.config import ConnectorConfig
from kvpool.vllm.health import Pool, PoolDown
from kvpool.vllm.keys import RankKeys
from kvpool.vllm.metadata import KVPoolConnectorMetadata, KVPoolWorkerMetadata, LoadJob, SaveJob
from kvpool.vllm.stats import KVPoolConnectorStats, dump, take
from kvpool.vllm.transfer import STORED, DirectMover, Mover, StagedMover, block_pieces

log = logging.getLogger("kvpool.vllm")


class Worker:
    def __init__(
        self,
        cfg: ConnectorConfig,
        keys: RankKeys,
        block_size: int,
        num_blocks: int,
        side: str,
        client: Optional[Client] = None,
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.side = side
        self.mover: Optional[Mover] = None
        self.pieces: Optional[list[torch.Tensor]] = None
        self.store = Pool((lambda: client) if client is not None else (lambda: cfg.client(f"kvpool-vllm-{side}")),
                          side, on_connect=self._connected)
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self.async_loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load-async")
        self.received: set[str] = set()  # requests whose asynchronous loads finished
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self.load_future: Optional[Future[None]] = None
        self.saving: dict[int, tuple[str, Future[None]]] = {}
        self.lock = threading.Lock()
        self.done: dict[int, set[int]] = {}  # finished jobs since the last report: failed positions
        self.load_errors: set[int] = set()
        self.stats = KVPoolConnectorStats()
        # After the pool answered no-space, saves are dropped until then (monotonic seconds).
        self.full_until = 0.0
        self.totals = {"loaded_blocks": 0, "loaded_bytes": 0, "load_failed_blocks": 0, "saved_blocks": 0,
                       "saved_bytes": 0, "save_skipped": 0, "save_failed_blocks": 0, "save_dropped_blocks": 0,
                       "load_seconds": 0.0, "save_seconds": 0.0}

    @property
    def client(self) -> Optional[Client]:
        return self.store.client

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pieces = block_pieces(kv_caches, self.num_blocks)
        if self.store.client is not None:
            self._connected(self.store.client)

    def _connected(self, client: Client) -> None:
        """Register the KV cache (or the staging area) with the client that reached the pool:
        at start, or later when the pool was down then."""
        pieces = self.pieces
        if pieces is None or self.mover is not None:
            return
        device = pieces[0].device
        if device.type == "cpu" and self.cfg.staging != "always":
            self.mover = DirectMover(client, pieces)
        else:
            self.mover = StagedMover(client, pieces, self.cfg.staging_bytes)
        log.info("kvpool connector: %d KV pieces (%s), %d bytes per block, %s, transport %s", len(pieces),
                 device, self.mover.block_bytes, type(self.mover).__name__, client.transport)

    def _finish(self, job: int, failed: set[int]) -> None:
        with self.lock:
            self.done[job] = failed

    # ---- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        now = [j for j in meta.loads if not j.asynchronous]
        if now:
            self.load_future = self.loader.submit(self._load, now)
        for j in meta.loads:
            if j.asynchronous:
                # One request at a time: a slow load delays its own request only.
                self.async_loader.submit(self._load, [j])

    def _load(self, loads: list[LoadJob]) -> None:
        t0 = time.perf_counter()
        keys = [k for j in loads for k in self.keys.keys(j.hashes)]
        block_ids = [b for j in loads for b in j.block_ids]
        mover = self.mover
        try:
            if mover is None:
                raise PoolDown("not connected yet")
            ok = self.store.call(lambda c: mover.load(keys, block_ids))
        except (KvpoolError, RuntimeError, PoolDown) as e:
            # Reported as load errors: vLLM computes these blocks instead.
            log.warning("kvpool load of %d blocks failed: %s", len(keys), e)
            ok = [False] * len(keys)
        at = 0
        failed_ids: set[int] = set()
        for j in loads:
            bad = [i for i in range(len(j.hashes)) if not ok[at + i]]
            failed_ids.update(j.block_ids[i] for i in bad)
            at += len(j.hashes)
        seconds = time.perf_counter() - t0
        n_ok = len(keys) - len(failed_ids)
        at = 0
        job_failed: dict[int, set[int]] = {}
        for j in loads:
            job_failed[j.job] = {j.positions[i] for i in range(len(j.hashes)) if not ok[at + i]}
            at += len(j.hashes)
        with self.lock:
            # Failed blocks are reported no later than the request's end of loading, and in the
            # same step as the job's end: the scheduler side learns which blocks failed before
            # vLLM asks it again about the request it now recomputes.
            self.load_errors |= failed_ids
            self.received.update(j.req_id for j in loads if j.asynchronous)
            self.done.update(job_failed)
            block_bytes = mover.block_bytes if mover is not None else 0
            self.stats.record("load", seconds, n_ok, n_ok * block_bytes, failed=len(failed_ids))
            self.totals["loaded_blocks"] += n_ok
            self.totals["loaded_bytes"] += n_ok * block_bytes
            self.totals["load_failed_blocks"] += len(failed_ids)
            self.totals["load_seconds"] += seconds
            dump(self.cfg.stats_path, self.side, self.totals)
        if failed_ids:
            log.warning("kvpool: %d of %d blocks could not be loaded (%.0f ms); vLLM recomputes them",
                        len(failed_ids), len(keys), seconds * 1e3)

    def wait_for_layer_load(self) -> None:
        f = self.load_future
        if f is not None:
            f.result()
            self.load_future = None

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errs, self.load_errors = self.load_errors, set()
        return errs

    # ---- saves -------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolConnectorMetadata) -> None:
        self.wait_for_layer_load()
        if not meta.saves:
            return
        saves = list(meta.saves)
        fence = self.mover.fence() if self.mover is not None else None
        # Without block references the blocks may be reused as soon as this step ends.
        if not self.cfg.async_save or meta.unreferenced:
            self._save(saves, fence)
            return
        fut = self.saver.submit(self._save, saves, fence)
        with self.lock:
            for s in saves:
                self.saving[s.job] = (s.req_id, fut)

    def _save(self, saves: list[SaveJob], fence: Any) -> None:
        t0 = time.perf_counter()
        # Replicas of one key split its blocks: this rank saves its share.
        mine = [(s, i) for s in saves for i, pos in enumerate(s.positions) if self.keys.saves(pos)]
        mover = self.mover
        if time.monotonic() < self.full_until or mover is None or not self.store.up:
            # The pool is down, or was full a moment ago: a save now would wait (for the pool,
            # for room) while it holds vLLM's blocks. Dropped, it is only a later miss.
            with self.lock:
                self.totals["save_dropped_blocks"] += len(mine)
                self.totals["save_failed_blocks"] += len(mine)
                for s in saves:
                    self.saving.pop(s.job, None)
                dump(self.cfg.stats_path, self.side, self.totals)
            for s in saves:
                self._finish(s.job, {s.positions[i] for t, i in mine if t is s})
            return
        keys = [f"{self.keys.prefix}@{s.hashes[i]}" for s, i in mine]
        parents = [None if s.parents[i] is None else f"{self.keys.prefix}@{s.parents[i]}" for s, i in mine]
        seq = [(s.positions[i] + 1) * self.block_size for s, i in mine]
        try:
            ids = [s.block_ids[i] for s, i in mine]
            st = self.store.call(lambda c: mover.save(keys, ids, parents, seq, self.block_size, fence)) if mine else []
        except (KvpoolError, RuntimeError, PoolDown) as e:
            log.warning("kvpool save of %d blocks failed: %s", len(keys), e)
            st = ["internal"] * len(keys)
        failed: dict[int, set[int]] = {s.job: set() for s in saves}
        for (s, i), status in zip(mine, st):
            if status not in STORED:
                failed[s.job].add(s.positions[i])
        for s in saves:
            self._finish(s.job, failed[s.job])
        seconds = time.perf_counter() - t0
        stored = sum(1 for x in st if x == "ok")
        with self.lock:
            for s in saves:
                self.saving.pop(s.job, None)
            n_failed = sum(1 for x in st if x not in STORED)
            self.stats.record("save", seconds, stored, stored * mover.block_bytes, failed=n_failed)
            self.totals["saved_blocks"] += stored
            self.totals["saved_bytes"] += stored * mover.block_bytes
            self.totals["save_skipped"] += sum(1 for x in st if x == "already-exists")
            self.totals["save_failed_blocks"] += n_failed
            self.totals["save_seconds"] += seconds
            dump(self.cfg.stats_path, self.side, self.totals)
        if "no-space" in st:
            self.full_until = time.monotonic() + self.cfg.full_backoff_s
            log.warning("kvpool: pool full, %d blocks not saved; saves dropped for %.1f s", st.count("no-space"),
                        self.cfg.full_backoff_s)

    def handle_preemptions(self, meta: KVPoolConnectorMetadata) -> None:
        """Without block references (no block pool bound to the scheduler side), a preempted
        request's blocks may be handed out again right after this step: its saves finish first."""
        if not meta.unreferenced or not meta.preempted:
            return
        with self.lock:
            waits = [f for rid, f in self.saving.values() if rid in meta.preempted]
        for f in waits:
            f.result()

    # ---- reports -----------------------------------------------------------------------

    def build_worker_meta(self) -> Optional[KVPoolWorkerMetadata]:
        with self.lock:
            done, self.done = self.done, {}
        if not done:
            return None
        return KVPoolWorkerMetadata(done={j: 1 for j in done}, failed={j: f for j, f in done.items() if f})

    def take_stats(self) -> Optional[KVPoolConnectorStats]:
        return take(self)

    def counters(self) -> dict[str, Any]:
        with self.lock:
            return {**self.totals, **self.store.counters}

    def take_received(self) -> Optional[set[str]]:
        """Requests whose asynchronous loads finished since the last call."""
        with self.lock:
            done, self.received = self.received, set()
        return done or None

    def close(self) -> None:
        self.async_loader.shutdown(wait=True)
        self.loader.shutdown(wait=True)
        self.saver.shutdown(wait=True)
        if self.mover is not None:
            self.mover.close()
        self.store.close()
