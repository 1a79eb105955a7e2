"""The worker side: each step's loads (synchronous ones complete before ``start_load_kv``
returns; asynchronous ones between steps, several at once) and saves (after the step's forward
pass, on a background thread), and the report of finished jobs the scheduler side needs to let go
of block references and pool holds.

Every job ends in a report, whatever goes wrong: a load or save that raises (any exception, not
only the pool's) counts its blocks as failed, so vLLM computes them and the scheduler side lets go
of their references. A step whose synchronous load failed drops the saves of that request: its
blocks were computed over KV that never arrived, and must never reach the pool.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

from kvpool._native import Client, KvpoolError
from kvpool.vllm.config import ConnectorConfig
from kvpool.vllm.health import Pool, PoolDown
from kvpool.vllm.keys import RankKeys
from kvpool.vllm.layout import BlockImage, KVFormat, RegionImage, mooncake_image
from kvpool.vllm.metadata import KVPoolConnectorMetadata, KVPoolWorkerMetadata, LoadJob, SaveJob
from kvpool.vllm.stats import KVPoolConnectorStats, dump, take
from kvpool.vllm.transfer import STORED, DirectMover, Mover, StagedMover

log = logging.getLogger("kvpool.vllm")

# The key (in this rank's prefix) of the record of what Mooncake-format keys hold.
FORMAT_RECORD = "kvpool-format"


class Worker:
    def __init__(
        self,
        cfg: ConnectorConfig,
        keys: RankKeys,
        block_size: int,
        num_blocks: int,
        side: str,
        client: Optional[Client] = None,
        fmt: Optional[KVFormat] = None,
        order: Optional[list[str]] = None,
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.side = side
        self.format = fmt
        self.order = order
        self.mover: Optional[Mover] = None
        self.image: Optional[Union[BlockImage, RegionImage]] = None
        self.store = Pool((lambda: client) if client is not None else (lambda: cfg.client(f"kvpool-vllm-{side}")),
                          side, on_connect=self._connected)
        # Asynchronous loads, one request each, several at once: a slow one delays its own request.
        self.async_loader = ThreadPoolExecutor(cfg.load_threads, thread_name_prefix="kvpool-load-async")
        self.received: set[str] = set()  # requests whose asynchronous loads finished
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self.saving: dict[int, tuple[str, Future[None]]] = {}
        self.lock = threading.Lock()
        self.done: dict[int, set[int]] = {}  # finished jobs since the last report: failed positions
        # Save jobs dropped because their step read a failed load: the first position to save again.
        self.rewind: dict[int, int] = {}
        self.load_errors: set[int] = set()
        # This step's synchronous loads that failed here: request -> failed chain positions; and
        # the step's synchronous load jobs.
        self.step_failed: dict[str, set[int]] = {}
        self.step_loads: set[int] = set()
        # Saves of steps with synchronous loads, waiting for every worker's word on those loads
        # (the scheduler's verdicts), and the verdicts that came.
        self.deferred: list[tuple[set[int], list[SaveJob], Any]] = []
        self.verdicts: dict[int, bool] = {}
        self.stats = KVPoolConnectorStats()
        # After the pool answered no-space, saves are dropped until then (monotonic seconds).
        self.full_until = 0.0
        self.totals = {"loaded_blocks": 0, "loaded_bytes": 0, "load_failed_blocks": 0, "saved_blocks": 0,
                       "saved_bytes": 0, "save_skipped": 0, "save_failed_blocks": 0, "save_dropped_blocks": 0,
                       "save_dropped_after_load_failure": 0, "load_seconds": 0.0, "save_seconds": 0.0}

    @property
    def client(self) -> Optional[Client]:
        return self.store.client

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.cfg.key_format == "mooncake":
            self.image = mooncake_image(kv_caches, self.num_blocks, self.format, self.order)
        else:
            self.image = BlockImage.from_kv_caches(kv_caches, self.num_blocks, self.format, self.order)
        if self.store.client is not None:
            self._connected(self.store.client)

    def _connected(self, client: Client) -> None:
        """Register the KV cache (or the staging area) with the client that reached the pool:
        at start, or later when the pool was down then."""
        image = self.image
        if image is None or self.mover is not None:
            return
        if self.cfg.key_format == "mooncake":
            self._check_format_record(client, image)
        if image.direct and image.device.type == "cpu" and self.cfg.staging != "always":
            self.mover = DirectMover(client, image)
        else:
            self.mover = StagedMover(client, image, self.cfg.staging_bytes,
                                     device_staging_bytes=self.cfg.device_staging_bytes)
        log.info("kvpool connector: %s, %d bytes per block, %s, transport %s, format %s", image.device,
                 self.mover.block_bytes, type(self.mover).__name__, client.transport,
                 self.format.describe() if self.format else "unknown")

    def _check_format_record(self, client: Client, image: Union[BlockImage, RegionImage]) -> None:
        """Mooncake's keys say nothing of what their bytes mean: the first engine to store under
        them records its format, and an engine whose blocks mean something else is refused."""
        mine = {"format": self.format.describe() if self.format else None,
                "digest": self.format.digest if self.format else None,
                "block_bytes": image.block_bytes,
                "regions": [int(s.shape[1]) for s in getattr(image, "slabs", [])]}
        key = f"{self.keys.prefix}@{FORMAT_RECORD}"
        value = json.dumps(mine, sort_keys=True).encode()
        (st,) = client.put_batch([key], [value])
        if st == "ok":
            return
        ((gst, theirs),) = client.get_batch([key])
        if gst == "ok" and theirs is not None and bytes(theirs) != value:
            raise ValueError(
                f"kvpool_key_format='mooncake': an engine already stores blocks under {self.keys.prefix}@... "
                f"in another format ({bytes(theirs).decode(errors='replace')}; this engine: "
                f"{value.decode()}). Mooncake's keys cannot tell them apart: use kvpool_key_format='kvpool' "
                "(the default), or give these engines another cache_prefix")

    def _finish(self, job: int, failed: set[int]) -> None:
        with self.lock:
            self.done[job] = failed

    # ---- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        """Synchronous loads are done (their device copies included) when this returns: vLLM
        does not call ``wait_for_layer_load`` when it replays a FULL CUDA graph, so the step's
        forward pass must find the blocks in place without it."""
        self._settle_deferred(meta.load_verdicts)
        self.step_failed = {}
        now = [j for j in meta.loads if not j.asynchronous]
        self.step_loads = {j.job for j in now}
        if now:
            failed = self._load(now)
            self.step_failed = {j.req_id: failed[j.job] for j in now if failed.get(j.job)}
        for j in meta.loads:
            if j.asynchronous:
                # One request per job: a slow load delays its own request only.
                self.async_loader.submit(self._load, [j])

    def _load(self, loads: list[LoadJob]) -> dict[int, set[int]]:
        """Load, and report every job's end: failed positions per job."""
        t0 = time.perf_counter()
        keys = [k for j in loads for k in self.keys.keys(j.hashes)]
        block_ids = [b for j in loads for b in j.block_ids]
        mover = self.mover
        ok = [False] * len(keys)
        try:
            if mover is None:
                raise PoolDown("not connected yet")
            ok = self.store.call(lambda c: mover.load(keys, block_ids))
        except (KvpoolError, PoolDown) as e:
            # Reported as load errors: vLLM computes these blocks instead.
            log.warning("kvpool load of %d blocks failed: %s", len(keys), e)
        except Exception:
            log.exception("kvpool load of %d blocks failed unexpectedly; vLLM computes them", len(keys))
        failed_ids: set[int] = set()
        job_failed: dict[int, set[int]] = {}
        at = 0
        for j in loads:
            bad = [i for i in range(len(j.hashes)) if not ok[at + i]]
            failed_ids.update(j.block_ids[i] for i in bad)
            job_failed[j.job] = {j.positions[i] for i in bad}
            at += len(j.hashes)
        seconds = time.perf_counter() - t0
        n_ok = len(keys) - sum(len(f) for f in job_failed.values())
        block_bytes = mover.block_bytes if mover is not None else 0
        with self.lock:
            # Failed blocks are reported no later than the request's end of loading, and in the
            # same step as the job's end: the scheduler side learns which blocks failed before
            # vLLM asks it again about the request it now recomputes.
            self.load_errors |= failed_ids
            self.received.update(j.req_id for j in loads if j.asynchronous)
            self.done.update(job_failed)
            self.stats.record("load", seconds, n_ok, n_ok * block_bytes, failed=len(failed_ids))
            self.totals["loaded_blocks"] += n_ok
            self.totals["loaded_bytes"] += n_ok * block_bytes
            self.totals["load_failed_blocks"] += len(failed_ids)
            self.totals["load_seconds"] += seconds
        self._dump()
        if failed_ids:
            log.warning("kvpool: %d of %d blocks could not be loaded (%.0f ms); vLLM recomputes them",
                        len(failed_ids), len(keys), seconds * 1e3)
        return job_failed

    def wait_for_layer_load(self) -> None:
        """Nothing to wait for: synchronous loads finish in ``start_load_kv``."""

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errs, self.load_errors = self.load_errors, set()
        return errs

    # ---- saves -------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolConnectorMetadata) -> None:
        saves = list(meta.saves)
        loads, self.step_loads = self.step_loads, set()
        if self.step_failed and saves:
            # This step's forward pass read blocks whose load failed (their requests', and any
            # other request's that shares them through vLLM's prefix cache): what it computed is
            # wrong KV, and vLLM computes it again. None of it reaches the pool; the scheduler
            # side saves those blocks once computed again.
            self._drop(saves, "their step read blocks whose load failed")
            saves = []
        self.step_failed = {}
        if not saves:
            return
        fence = self.mover.fence() if self.mover is not None else None
        if loads and not meta.unreferenced:
            # Another worker's load of this step may have failed: wait for the verdict (the
            # blocks stay referenced meanwhile).
            self.deferred.append((loads, saves, fence))
            return
        self._submit(saves, fence, meta.unreferenced)

    def _settle_deferred(self, verdicts: dict[int, bool]) -> None:
        """Saves whose step's loads all have a verdict: sent, or dropped when one failed."""
        if not self.deferred:
            return
        self.verdicts.update(verdicts)
        keep: list[tuple[set[int], list[SaveJob], Any]] = []
        for loads, saves, fence in self.deferred:
            if not loads <= self.verdicts.keys():
                keep.append((loads, saves, fence))
            elif any(self.verdicts[j] for j in loads):
                self._drop(saves, "another worker's load of their step failed")
            else:
                self._submit(saves, fence, False)
        self.deferred = keep
        waiting = {j for loads, _, _ in keep for j in loads}
        self.verdicts = {j: v for j, v in self.verdicts.items() if j in waiting}

    def _drop(self, saves: list[SaveJob], why: str) -> None:
        """Saves of a step that read blocks whose load failed: reported failed, to be saved again
        from their first position once vLLM has computed them again."""
        n = sum(len(s.positions) for s in saves)
        with self.lock:
            self.totals["save_dropped_after_load_failure"] += n
            self.totals["save_failed_blocks"] += n
            for s in saves:
                self.done[s.job] = set(s.positions)
                self.rewind[s.job] = min(s.positions)
        log.warning("kvpool: %d blocks not saved: %s", n, why)

    def _submit(self, saves: list[SaveJob], fence: Any, unreferenced: bool) -> None:
        # Without block references the blocks may be reused as soon as this step ends.
        if not self.cfg.async_save or unreferenced:
            self._save(saves, fence)
            return
        with self.lock:
            fut = self.saver.submit(self._save, saves, fence)
            for s in saves:
                self.saving[s.job] = (s.req_id, fut)

    def _save(self, saves: list[SaveJob], fence: Any) -> None:
        """Save, and report every job's end (all its blocks failed if anything raises)."""
        failed: dict[int, set[int]] = {s.job: set(s.positions) for s in saves}
        try:
            failed = self._save_jobs(saves, fence)
        except Exception:
            log.exception("kvpool save of %d jobs failed unexpectedly; their blocks are not stored", len(saves))
            with self.lock:
                n = sum(len(f) for f in failed.values())
                self.totals["save_failed_blocks"] += n
        finally:
            with self.lock:
                for s in saves:
                    self.saving.pop(s.job, None)
                    self.done[s.job] = failed.get(s.job, set())
            self._dump()

    def _save_jobs(self, saves: list[SaveJob], fence: Any) -> dict[int, set[int]]:
        t0 = time.perf_counter()
        # Replicas of one key split its blocks: this rank saves its share.
        mine = [(s, i) for s in saves for i, pos in enumerate(s.positions) if self.keys.saves(pos)]
        failed: dict[int, set[int]] = {s.job: set() for s in saves}
        mover = self.mover
        if time.monotonic() < self.full_until or mover is None or not self.store.up:
            # The pool is down, or was full a moment ago: a save now would wait (for the pool,
            # for room) while it holds vLLM's blocks. Dropped, it is only a later miss.
            with self.lock:
                self.totals["save_dropped_blocks"] += len(mine)
                self.totals["save_failed_blocks"] += len(mine)
            for s, i in mine:
                failed[s.job].add(s.positions[i])
            return failed
        keys = [f"{self.keys.prefix}@{s.hashes[i]}" for s, i in mine]
        parents = [None if s.parents[i] is None else f"{self.keys.prefix}@{s.parents[i]}" for s, i in mine]
        seq = [(s.positions[i] + 1) * self.block_size for s, i in mine]
        try:
            ids = [s.block_ids[i] for s, i in mine]
            st = self.store.call(lambda c: mover.save(keys, ids, parents, seq, self.block_size, fence)) if mine else []
        except (KvpoolError, PoolDown) as e:
            log.warning("kvpool save of %d blocks failed: %s", len(keys), e)
            st = ["internal"] * len(keys)
        for (s, i), status in zip(mine, st):
            if status not in STORED:
                failed[s.job].add(s.positions[i])
        seconds = time.perf_counter() - t0
        stored = sum(1 for x in st if x == "ok")
        n_failed = sum(1 for x in st if x not in STORED)
        with self.lock:
            self.stats.record("save", seconds, stored, stored * mover.block_bytes, failed=n_failed)
            self.totals["saved_blocks"] += stored
            self.totals["saved_bytes"] += stored * mover.block_bytes
            self.totals["save_skipped"] += sum(1 for x in st if x == "already-exists")
            self.totals["save_failed_blocks"] += n_failed
            self.totals["save_seconds"] += seconds
        if "no-space" in st:
            self.full_until = time.monotonic() + self.cfg.full_backoff_s
            log.warning("kvpool: pool full, %d blocks not saved; saves dropped for %.1f s", st.count("no-space"),
                        self.cfg.full_backoff_s)
        return failed

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
            rewind, self.rewind = self.rewind, {}
        if not done:
            return None
        return KVPoolWorkerMetadata(done={j: 1 for j in done}, failed={j: f for j, f in done.items() if f},
                                    rewind=rewind)

    def _dump(self) -> None:
        with self.lock:
            totals = dict(self.totals)
        dump(self.cfg.stats_path, self.side, totals)

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
        self.saver.shutdown(wait=True)
        if self.mover is not None:
            self.mover.close()
        self.store.close()

