"""LMCache's L2 on kvpool: ``KVPoolL2Adapter`` implements LMCache's ``L2AdapterInterface`` on the
kvpool client, loaded by LMCache's plugin L2 adapter::

    {"type": "plugin", "module_path": "kvpool.lmcache", "class_name": "KVPoolL2Adapter",
     "adapter_params": {"kvpool_data_dir": "/var/lib/kvpool"}}

(LMCache's own ``mooncake_store`` L2 adapter is a C++ extension built against Mooncake's headers,
which no Python alias can serve; this adapter takes its place.)

How LMCache's three operations map onto the pool:

- **store** puts each chunk under its key (LMCache's encoded object key), straight from LMCache's
  L1 memory when LMCache hands the adapter its L1 region (registered with the client once: on the
  same host the server copies from it, nothing is copied here), else from the chunk's bytes.
- **lookup and lock** is one ``lookup_lease`` over the keys in order: the leading chunks that are
  in the pool are counted *and held* (kvpool's lease: not evicted, not removed without force) until
  ``submit_unlock`` names them, or the hold's time (``kvpool_lock_s``, default 30 s, at most 60)
  ends. LMCache loads prefixes, so the bitmap is the leading chunks.
- **load** gets each chunk into the L1 buffer LMCache provides, checked against its size.

Settings (``adapter_params``, else ``KVPOOL_*`` environment, else the ``kvpool_*`` fields of the
Mooncake config file ``MOONCAKE_CONFIG_PATH``): ``kvpool_server``, ``kvpool_api_key`` /
``kvpool_api_key_file``, ``kvpool_fingerprint`` / ``kvpool_ca``, ``kvpool_data_dir``,
``kvpool_key_prefix``, ``kvpool_lock_s``, ``kvpool_threads`` (default 4).

Tasks run on a thread pool of the adapter's; each signals its operation's event fd when done, as
LMCache's controllers expect. Every failure is reported (a failed store task; zeros in a
lookup or load bitmap), never raised into LMCache's controller threads.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvpool import _mooncake_config as mooncake_config
from kvpool._native import Client, KvpoolError

log = logging.getLogger("kvpool.lmcache")

__all__ = ["KVPoolL2Adapter"]

STORED = ("ok", "already-exists")


class KVPoolL2Adapter(L2AdapterInterface):
    def __init__(self, config: Optional[dict[str, Any]] = None, l1_memory_desc: Any = None,
                 client: Optional[Client] = None) -> None:
        super().__init__()
        params = dict(config or {}) if isinstance(config, dict) else dict(getattr(config, "adapter_params", {}) or {})
        self.prefix = str(params.get("kvpool_key_prefix") or "")
        self.lock_s = min(60.0, max(0.1, float(params.get("kvpool_lock_s", 30.0))))
        self.client = client if client is not None else mooncake_config.client_from_settings(params, "kvpool-lmcache")
        self._efd = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._pool = ThreadPoolExecutor(int(params.get("kvpool_threads", 4)), thread_name_prefix="kvpool-l2")
        self._lock = threading.Lock()
        self._next = 0
        self._stored: dict[int, L2StoreResult] = {}
        self._looked: dict[int, Bitmap] = {}
        self._loaded: dict[int, Bitmap] = {}
        # Holds of lookups: key -> the lookup that holds it; a lookup's leases and the keys it
        # still holds (its leases end when the last of them is unlocked).
        self._held: dict[str, int] = {}
        self._holds: dict[int, tuple[list[int], set[str]]] = {}
        self._l1: Optional[tuple[int, int]] = None
        if l1_memory_desc is not None and getattr(l1_memory_desc, "ptr", 0):
            # LMCache's L1 region, once: chunks then move straight from and into it.
            try:
                self.client.register(int(l1_memory_desc.ptr), int(l1_memory_desc.size))
                self._l1 = (int(l1_memory_desc.ptr), int(l1_memory_desc.size))
            except KvpoolError as e:
                log.warning("kvpool: LMCache's L1 memory not registered (%s); chunks are copied", e)

    # ---- event fds --------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    # ---- tasks ------------------------------------------------------------------------------

    def _task(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _key(self, key: Any) -> str:
        encoded = key.to_encoded_object_key() if hasattr(key, "to_encoded_object_key") else key
        if isinstance(encoded, (bytes, bytearray)):
            encoded = bytes(encoded).hex()
        return f"{self.prefix}{encoded}"

    def _ranges(self, objects: list[Any]) -> Optional[tuple[list[int], list[int]]]:
        """The chunks' addresses when all lie in the registered L1 region."""
        if self._l1 is None:
            return None
        lo, size = self._l1
        ptrs = [int(o.data_ptr) for o in objects]
        sizes = [int(o.get_size()) for o in objects]
        if all(lo <= p and p + n <= lo + size for p, n in zip(ptrs, sizes)):
            return ptrs, sizes
        return None

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = self._task()
        self._pool.submit(self._store, task, keys, objects)
        return task

    def _store(self, task: int, keys: list[Any], objects: list[Any]) -> None:
        ok, moved = False, 0
        try:
            ks = [self._key(k) for k in keys]
            ranges = self._ranges(objects)
            if ranges is not None:
                st = self.client.put_from(ks, ranges[0], ranges[1])
            else:
                st = self.client.put_batch(ks, [bytes(o.byte_array) for o in objects])
            ok = all(s in STORED for s in st)
            sizes = [int(o.get_size()) for o in objects]
            moved = sum(n for s, n in zip(st, sizes) if s == "ok")
            stored = [(k, n) for k, s, n in zip(keys, st, sizes) if s == "ok"]
            if stored:
                self._notify_keys_stored([k for k, _ in stored], [n for _, n in stored])
        except Exception as e:  # reported as a failed task, never raised into LMCache
            log.warning("kvpool store of %d chunks failed: %s", len(keys), e)
        with self._lock:
            self._stored[task] = L2StoreResult(ok, moved)
        self._efd["store"].notify()

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        task = self._task()
        self._pool.submit(self._lookup, task, keys)
        return task

    def _lookup(self, task: int, keys: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            ks = [self._key(k) for k in keys]
            n, leases = self.client.lookup_lease(ks, self.lock_s) if ks else (0, [])
            if n:
                bitmap.set_range(0, n)
            if leases:
                with self._lock:
                    self._holds[task] = (list(leases), set(ks[:n]))
                    for k in ks[:n]:
                        old = self._held.get(k)
                        self._held[k] = task
                        if old is not None and old in self._holds:
                            self._forget_key(old, k)
        except Exception as e:
            log.warning("kvpool lookup of %d chunks failed: %s", len(keys), e)
        with self._lock:
            self._looked[task] = bitmap
        self._efd["lookup"].notify()

    def query_lookup_and_lock_result(self, task_id: int) -> Optional[Bitmap]:
        with self._lock:
            return self._looked.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """End a lookup's holds once every key it held is unlocked (a hold that ended is fine)."""
        with self._lock:
            for k in (self._key(x) for x in keys):
                task = self._held.pop(k, None)
                if task is not None:
                    self._forget_key(task, k)

    def _forget_key(self, task: int, key: str) -> None:
        """(Under the lock.) ``key`` is no longer held by lookup ``task``."""
        leases, keys = self._holds[task]
        keys.discard(key)
        if not keys:
            del self._holds[task]
            for lease in leases:
                self._pool.submit(self._release, lease)

    def _release(self, lease: int) -> None:
        try:
            self.client.release(lease)
        except KvpoolError as e:  # the hold ended already: nothing to undo
            log.debug("kvpool release: %s", e)

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = self._task()
        self._pool.submit(self._load, task, keys, objects)
        return task

    def _load(self, task: int, keys: list[Any], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            ks = [self._key(k) for k in keys]
            ranges = self._ranges(objects)
            if ranges is not None:
                for i, (st, n) in enumerate(self.client.get_into(ks, ranges[0], ranges[1])):
                    if st == "ok" and n == ranges[1][i]:
                        bitmap.set(i)
            else:
                for i, ((st, val), o) in enumerate(zip(self.client.get_batch(ks), objects)):
                    if st == "ok" and val is not None and len(val) == int(o.get_size()):
                        o.byte_array[: len(val)] = val
                        bitmap.set(i)
            if bitmap.popcount():
                self._notify_keys_accessed([k for i, k in enumerate(keys) if bitmap.test(i)])
        except Exception as e:
            log.warning("kvpool load of %d chunks failed: %s", len(keys), e)
        with self._lock:
            self._loaded[task] = bitmap
        self._efd["load"].notify()

    def query_load_result(self, task_id: int) -> Optional[Bitmap]:
        with self._lock:
            return self._loaded.pop(task_id, None)

    def delete(self, keys: list[Any]) -> None:
        try:
            self.client.remove([self._key(k) for k in keys], force=True)
        except KvpoolError as e:
            log.warning("kvpool delete of %d chunks failed: %s", len(keys), e)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            leases = [lease for ls, _ in self._holds.values() for lease in ls]
            self._holds, self._held = {}, {}
        for lease in leases:
            self._release(lease)
        if self._l1 is not None:
            try:
                self.client.unregister(self._l1[0])
            except KvpoolError:
                pass
        self.client.close()
        for efd in self._efd.values():
            efd.close()
