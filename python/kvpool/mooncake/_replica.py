"""Replicas, segments, tasks and process-level calls: what Mooncake's placement model offers and
what a kvpool client answers for it (one copy of each block, in one pool the client lends no
memory to)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from kvpool import _mooncake_config as mooncake_config
from kvpool._native import KvpoolError
from kvpool.mooncake._codes import INVALID_PARAMS, NOT_SUPPORTED, OBJECT_NOT_FOUND, OK, TASK_NOT_FOUND, Key, error_code
from kvpool.mooncake._types import QueryTaskResponse, ReplicaDescriptor
from kvpool.mooncake._types import bind_to_numa_node as _bind_to_numa_node
from kvpool.mooncake._types import get_alloc_func_addr as _get_alloc_func_addr
from kvpool.mooncake._types import get_free_func_addr as _get_free_func_addr

log = logging.getLogger("kvpool.mooncake")

_NO_SEGMENTS = ("a kvpool client lends no memory to the pool (the server's dram.size is its capacity); "
                "there are no client segments to mount or unmount")


class ReplicaMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    _endpoint: str

    # ---- replicas -------------------------------------------------------------------------

    def get_replica_desc(self, key: Key) -> list[ReplicaDescriptor]:
        """The replicas of ``key``: one memory replica (kvpool keeps one copy of a block; see
        :class:`ReplicaDescriptor` for what is filled in), ``[]`` when the key is missing. Like
        Mooncake's query it leases the block (``remove`` right after answers -706)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Sequence[Key]) -> dict[Key, list[ReplicaDescriptor]]:
        """``{key: [ReplicaDescriptor]}`` for the keys that are stored, in one request; missing
        keys are left out, as Mooncake."""
        c = self._c()
        if c is None or not keys:
            return {}
        try:
            sizes = c.get_size(self._k(keys))
        except KvpoolError as e:
            log.error("batch_get_replica_desc: %s", e)
            return {}
        return {k: [ReplicaDescriptor(int(n), self._endpoint)] for k, (s, n) in zip(keys, sizes) if s == "ok"}

    def batch_replica_clear(self, keys: Sequence[Key], segment_name: str = "") -> list[Key]:
        """Clear the replicas of ``keys`` whose leases have ended; returns the keys cleared. With
        no ``segment_name`` (every segment), a key's one kvpool copy is removed unless leased,
        as Mooncake's clearing of all of an object's replicas removes it. A ``segment_name``
        names no kvpool segment: nothing is cleared (``[]``)."""
        c = self._c()
        if c is None or not keys:
            return []
        if segment_name:
            return []
        try:
            st = c.remove(self._k(keys), False)
        except KvpoolError as e:
            log.error("batch_replica_clear: %s", e)
            return []
        return [k for k, s in zip(keys, st) if s == "ok"]

    # ---- copy and move tasks --------------------------------------------------------------

    def create_copy_task(self, key: Key, targets: Sequence[str]) -> tuple[tuple[int, int], int]:
        """Mooncake copies an object to other segments in the background. kvpool keeps one copy
        of each block in one pool, so there is nothing to copy to: ``((0, 0), -704)`` for a
        missing key (as Mooncake), else ``((0, 0), -1012)`` (``NOT_SUPPORTED``)."""
        return self._no_task(key, "copy")

    def create_move_task(self, key: Key, source: str, target: str) -> tuple[tuple[int, int], int]:
        """As ``create_copy_task``: no segments to move between; -704 for a missing key, else
        -1012 (``NOT_SUPPORTED``)."""
        return self._no_task(key, "move")

    def _no_task(self, key: Key, what: str) -> tuple[tuple[int, int], int]:
        c = self._c()
        if c is None:
            return (0, 0), INVALID_PARAMS
        try:
            present = c.exists(self._k([key]))[0]
        except KvpoolError as e:
            return (0, 0), error_code(e)
        if not present:
            return (0, 0), OBJECT_NOT_FOUND
        log.warning("create_%s_task: not supported: kvpool keeps one copy of each block in one pool", what)
        return (0, 0), NOT_SUPPORTED

    def query_task(self, task_id: Any) -> tuple[Optional[QueryTaskResponse], int]:
        """``(None, -1400)`` (``TASK_NOT_FOUND``): a kvpool client never has a task, and this is
        Mooncake's answer for a task it does not know."""
        return None, TASK_NOT_FOUND

    # ---- segments -------------------------------------------------------------------------

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict[str, Any]:
        """Refused: ``{"ret": -1012, "segment_ids": []}`` (``NOT_SUPPORTED``), logged with the
        reason: a kvpool client lends no memory to the pool."""
        log.warning("mount_segment(%r): not supported: %s", path, _NO_SEGMENTS)
        return {"ret": NOT_SUPPORTED, "segment_ids": []}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> dict[str, Any]:
        """Refused: ``{"ret": -1012, "segment_ids": [], "allocated_size": 0}``, as
        ``mount_segment``."""
        log.warning("allocate_and_mount_segment(%d): not supported: %s", size, _NO_SEGMENTS)
        return {"ret": NOT_SUPPORTED, "segment_ids": [], "allocated_size": 0}

    def unmount_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        """0 for no ids; -1 for any id, Mooncake's answer for a segment id it did not mount (a
        kvpool client mounts none)."""
        return OK if not list(segment_ids) else -1

    def unmount_and_free_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        """As ``unmount_segment``: 0 for no ids, -1 for any id."""
        return OK if not list(segment_ids) else -1

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """0: there is no local disk segment to drain, Mooncake's answer without SSD offload (the
        server's SSD tier belongs to the server)."""
        return OK

    def get_offload_rpc_read_count(self) -> int:
        """0: this client reads no offloaded objects from other clients (Mooncake's count of such
        reads; the server's SSD tier is read by the server)."""
        return 0

    # ---- process-level ------------------------------------------------------------------

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 * 1024 * 1024) -> int:
        """Mooncake's all-defaults setup: -600 when already set up (as Mooncake), else connect as
        ``setup()`` without arguments does, with ``protocol``. ``device_name`` and
        ``mount_segment_size`` are accepted and ignored."""
        if self._c() is not None:
            log.error("init_all: the store is already set up")
            return INVALID_PARAMS
        try:
            cfg = mooncake_config.load()
        except (OSError, ValueError) as e:
            log.error("MooncakeDistributedStore.init_all failed: %s", e)
            return INVALID_PARAMS
        cfg["protocol"] = protocol or cfg.get("protocol", "tcp")
        return self._connect(cfg, {}, None, 30.0, None)

    def _get_pyclient_capsule(self) -> None:
        """None: there is no C++ ``PyClient`` behind kvpool's store for Mooncake's C++ extensions
        (EngramStore) to use; None is Mooncake's answer when it has none either."""
        return None

    bind_to_numa_node = staticmethod(_bind_to_numa_node)
    get_alloc_func_addr = staticmethod(_get_alloc_func_addr)
    get_free_func_addr = staticmethod(_get_free_func_addr)
