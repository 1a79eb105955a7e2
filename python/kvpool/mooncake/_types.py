"""The value types of ``mooncake.store`` that consumers import, as kvpool answers them.

Names, fields, defaults and enum values are Mooncake's (``store_py.cpp``'s pybind11 module); what
kvpool fills in differently is said on each class.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import mmap
import os
import threading
from functools import lru_cache
from typing import Any, Optional

log = logging.getLogger("kvpool.mooncake")


class ObjectDataType(enum.IntEnum):
    """What an object holds (``ReplicateConfig.data_type``); kvpool accepts it as a label."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class SoftPinAction(enum.IntEnum):
    """``ReplicateConfig.soft_pin_action``: ``ENABLE`` soft-pins the block (kvpool's ``soft``
    pin), ``DISABLE`` and ``PRESERVE`` store it unpinned (kvpool keeps no pin across an upsert)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class ReplicateConfig:
    """Mooncake's put options, every field of Mooncake's current ``ReplicateConfig`` with its
    default. kvpool keeps one copy of a block in one pool:

    - ``with_hard_pin`` pins the block hard (never evicted); ``soft_pin_action = ENABLE`` (or the
      older ``with_soft_pin = True``) pins it soft (evicted last). ``soft_pin_ttl_ms`` is accepted
      and ignored (kvpool's soft pin lasts while the block does).
    - ``group_ids``: as Mooncake, a list with one entry per key of the write (else every key
      answers -600); accepted as Mooncake's "lifecycle hint" and not acted on (kvpool evicts
      prefix chains leaf first, not groups).
    - ``session_ids`` (newer Mooncake builds tag KV events with them; SGLang sets it when
      present): accepted and ignored, kvpool's events carry no session.
    - ``replica_num``, ``nof_replica_num``, ``dfs_replica_num``, ``preferred_segment(s)``,
      ``preferred_nof_segments``, ``prefer_alloc_in_same_node`` and ``data_type`` are accepted and
      ignored.
    """

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: Optional[int] = None
        self.with_hard_pin = False
        self.with_soft_pin = False  # Mooncake <= 0.3.x's name for soft_pin_action = ENABLE
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: Optional[list[str]] = None
        self.session_ids: Optional[list[str]] = None

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        action = getattr(self.soft_pin_action, "name", self.soft_pin_action)
        dtype = getattr(self.data_type, "name", self.data_type)
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: {self.nof_replica_num}, "
            f"dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: {action}, soft_pin_ttl_ms: {ttl}, "
            f"with_hard_pin: {int(bool(self.with_hard_pin))}, preferred_segments: {self.preferred_segments}, "
            f"preferred_nof_segments: {self.preferred_nof_segments}, "
            f"prefer_alloc_in_same_node: {int(bool(self.prefer_alloc_in_same_node))}, data_type: {dtype} }}"
        )


def pin_of(config: Any) -> Optional[str]:
    """A ``ReplicateConfig`` (or anything with its attributes) -> kvpool's pin."""
    if config is None:
        return None
    if getattr(config, "with_hard_pin", False):
        return "hard"
    if getattr(config, "with_soft_pin", False) or int(getattr(config, "soft_pin_action", 0) or 0) == SoftPinAction.ENABLE:
        return "soft"
    return None


def group_ids_fit(config: Any, n: int) -> bool:
    """Mooncake's rule: ``group_ids``, when set, has one entry per key of the write."""
    g = getattr(config, "group_ids", None) if config is not None else None
    return g is None or len(g) == n


class Descriptor:
    """Mooncake's ``AllocatedBuffer::Descriptor``. kvpool fills ``size`` (the value's bytes) and
    ``transport_endpoint`` (the server's address); ``buffer_address`` is 0: the server does not
    publish where a block lies in its memory (reads go through the server, not one-sided)."""

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = "") -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Optional[Descriptor] = None) -> None:
        self.buffer_descriptor = buffer_descriptor if buffer_descriptor is not None else Descriptor()


class DiskDescriptor:
    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object (``get_replica_desc``). kvpool holds one copy of each block, so a
    key has one descriptor, ``COMPLETE``, reported as a memory replica: the Python client is not
    told which tier (DRAM or the server's SSD) holds a block, and a read is served from the
    server's memory either way. ``is_disk_replica``/``is_local_disk_replica`` answer False;
    ``get_disk_descriptor`` raises ``RuntimeError`` as Mooncake's does for a memory replica."""

    def __init__(self, size: int, endpoint: str) -> None:
        self._memory = MemoryDescriptor(Descriptor(size, 0, endpoint))

    @property
    def status(self) -> ReplicaStatus:
        return ReplicaStatus.COMPLETE

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("Expected DiskDescriptor")


class QueryTaskResponse:
    """Mooncake's answer to ``query_task`` (kvpool never has a task to describe)."""

    def __init__(self) -> None:
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = (0, 0)
        self.message = ""


class ParallelAxis:
    """One axis of a tensor's parallel layout: ``kind`` ``tp``/``dp``/``ep``/``pp``."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: Optional[int] = None
        self.expert_id: Optional[int] = None
        self.stage_id: Optional[int] = None


class TensorParallelism:
    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []


class ReadTarget:
    """What ``get_tensor_with_parallelism`` reads: ``mode`` ``as_stored``, ``shard`` or ``full``."""

    _MODES = ("as_stored", "shard", "full")

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: Optional[TensorParallelism] = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        m = str(value).lower()
        if m not in self._MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = m


class BufferHandle:
    """A value read by ``get_buffer``/``batch_get_buffer``: ``ptr()``, ``size()``, ``len()`` and the
    buffer protocol (1-D signed bytes, as Mooncake's), e.g. ``numpy.array(h, copy=False)``.

    The bytes live in memory the handle owns: a buffer kvpool's client shares with a same-host
    server, which the server wrote the value into (one copy, none in Python). The memory stays
    valid while the handle (or a view of it) is alive."""

    __slots__ = ()

    def ptr(self) -> int:
        return ctypes.addressof(self)  # type: ignore[arg-type]

    def size(self) -> int:
        return len(self)  # type: ignore[arg-type]


@lru_cache(maxsize=512)
def _handle_type(n: int) -> type:
    # A ctypes array gives the buffer protocol on every Python version (3.11 has no __buffer__).
    return type("BufferHandle", (BufferHandle, ctypes.c_byte * n), {"__slots__": (), "__module__": "kvpool.mooncake"})


def buffer_handle(owner: Any, offset: int, n: int) -> BufferHandle:
    """A handle over ``n`` bytes of the writable buffer ``owner`` at ``offset`` (kept alive)."""
    return _handle_type(n).from_buffer(owner, offset)  # type: ignore[no-any-return]


# ---- host memory ----------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class MooncakeHostMemAllocator:
    """Mooncake's host memory allocator (SGLang's host KV pool in standalone mode): ``alloc(size)``
    returns the address of ``size`` bytes of zeroed, page-aligned anonymous memory (0 for a size
    of 0 or when mapping fails), ``free(ptr)`` unmaps it (0, or -1 for an address it did not
    allocate, as Mooncake). Mooncake maps shared memory of its standalone client process; a kvpool
    client has none before ``setup``: register this memory and the client stages it (one copy on
    the same host). ``store.alloc_buffer``/``alloc_from_mem_pool`` give memory the server reads
    directly."""

    _lock = threading.Lock()
    _sizes: dict[int, int] = {}

    def alloc(self, size: int) -> int:
        if size <= 0:
            return 0
        p = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if p is None or p == _MAP_FAILED:
            log.error("MooncakeHostMemAllocator.alloc(%d): mmap failed: %s", size, os.strerror(ctypes.get_errno()))
            return 0
        with self._lock:
            self._sizes[int(p)] = size
        return int(p)

    def free(self, ptr: int) -> int:
        with self._lock:
            size = self._sizes.pop(int(ptr), None)
        if size is None:
            log.error("MooncakeHostMemAllocator.free: unknown address %#x", ptr)
            return -1
        return 0 if _libc.munmap(ptr, size) == 0 else -1


def get_alloc_func_addr() -> int:
    """Address of a C allocation function ``void *(size_t)`` (page-aligned host memory, libc's
    ``valloc``; Mooncake's is its hugepage allocator), for C code that takes one."""
    return int(ctypes.cast(_libc.valloc, ctypes.c_void_p).value or 0)


def get_free_func_addr() -> int:
    """Address of the matching ``void (void *)`` (libc's ``free``)."""
    return int(ctypes.cast(_libc.free, ctypes.c_void_p).value or 0)


def _node_cpus(node: int) -> Optional[set[int]]:
    try:
        with open(f"/sys/devices/system/node/node{node}/cpulist", encoding="ascii") as f:
            spec = f.read().strip()
    except OSError:
        return None
    cpus: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_numa_node(node: int) -> None:
    """Run the calling thread on the CPUs of NUMA node ``node`` and prefer its memory (libnuma's
    ``numa_set_preferred`` when installed), as Mooncake's; a node that does not exist, or a host
    without NUMA, is logged and skipped (as Mooncake: nothing raised, nothing returned)."""
    node = int(node)
    cpus = _node_cpus(node)
    if not cpus:
        log.warning("bind_to_numa_node(%d): no such NUMA node on this host; binding skipped", node)
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("bind_to_numa_node(%d): %s", node, e)
    name = ctypes.util.find_library("numa")
    if name:
        try:
            numa = ctypes.CDLL(name)
            if numa.numa_available() >= 0:
                numa.numa_set_preferred(node)
        except OSError as e:
            log.debug("bind_to_numa_node: libnuma: %s", e)
