"""Mooncake Store's Python API on kvpool.

Code written against ``mooncake.store.MooncakeDistributedStore`` switches to kvpool by changing
the import::

    from kvpool.mooncake import MooncakeDistributedStore   # was: from mooncake.store import ...

Every method of Mooncake's current ``MooncakeDistributedStore`` is here, and the module-level
names consumers import (``ReplicateConfig``, ``ReplicaDescriptor``, ``ObjectDataType``,
``MooncakeHostMemAllocator``, ``BufferHandle``, ``ParallelAxis``, ``TensorParallelism``,
``ReadTarget``, ``bind_to_numa_node``, ...). Method names, arguments and return conventions are
Mooncake's: ``0`` or a count for success, Mooncake's negative error codes for failures (table
below), ``b''`` from ``get`` when a key is missing, ``1/0/-1`` from ``is_exist``. Calls never raise
for an outcome Mooncake reports as a code; they raise ``TypeError`` for arguments of the wrong
type, as pybind11 does, and ``ImportError`` from a tensor method without torch.

Leases, in Mooncake's terms: a read grants a lease on the blocks it reads, so that neither
eviction nor a ``remove`` without ``force`` (-706) frees them meanwhile. kvpool's reads (``get``,
``get_batch``, ``get_into`` and its batch forms, ``get_buffer``, ``get_size``,
``get_replica_desc``, the tensor reads) lease each block they find for the server's lease time,
``cache.lease_ttl_ms``, 5 s by default (Mooncake's master grants ``default_kv_lease_ttl``, 10 s by
default), counted from the read; a later read renews it. ``upsert`` replaces a leased value
anyway (as Mooncake). A get session (``batch_get_session_start``) holds its blocks for 10 s
(Mooncake's default), until ``batch_get_session_end``.

Where kvpool differs on purpose, the method's docstring says so. The main differences:

- ``is_exist``/``batch_is_exist`` never grant or renew a lease (Mooncake's do, which starves
  eviction).
- A kvpool client does not contribute memory to the pool: ``global_segment_size`` and
  ``local_buffer_size`` given to ``setup`` are accepted and ignored; the server's ``dram.size``
  (mapped from the same field of ``mooncake_store_config.json``) is the pool's capacity.
  ``mount_segment`` and ``allocate_and_mount_segment`` answer ``NOT_SUPPORTED`` (-1012),
  ``unmount_segment``/``unmount_and_free_segment`` -1 for any id (none was mounted), as Mooncake
  for an unknown id.
- One copy of each block in one pool: ``get_replica_desc`` answers one memory replica,
  ``create_copy_task``/``create_move_task`` answer ``NOT_SUPPORTED`` (-704 for a missing key),
  ``query_task`` ``TASK_NOT_FOUND`` (-1400); ``batch_replica_clear`` without a segment removes
  the unleased keys, with a segment name clears nothing.
- Credentials (API key, certificate fingerprint or CA, or a local server's data directory) come
  from ``setup``'s keywords, the ``KVPOOL_*`` environment or ``kvpool_*`` fields of the Mooncake
  config (see ``MooncakeDistributedStore``); ``setup`` logs exactly what is missing.
- ``tenant_id`` (``setup``'s keyword, the config file's field, ``MOONCAKE_TENANT_ID``) keeps
  Mooncake's meaning, a key space of its own: keys of a tenant other than ``default`` are stored
  under ``tenant:<id>/`` within the kvpool tenant of the API key (the API key, not the
  ``tenant_id``, is what kvpool authorizes).
- ``lookup(keys)`` (kvpool's own) answers how many leading keys of a prefix chain are resident in
  one request, where Mooncake's connectors call ``batch_is_exist`` over the whole chain.
- Addresses given to ``put_from``/``get_into``, their batch, ranged and session forms are checked
  against the registered buffers: an address range not entirely inside one ``register_buffer``
  range answers ``-600`` (invalid params) and is never touched. Mooncake reads or writes it
  regardless.
- Ranged reads (``get_into_ranges``, ``batch_get_into_multi_buffer_ranges``) move each value
  whole once per call (the server has no ranged read), the bytes outside the ranges landing in
  client scratch memory.
- ``get_hostname`` answers the ``local_hostname`` given to ``setup`` without Mooncake's transfer
  port (a kvpool client listens on none); ``remove_by_regex`` takes Rust regex syntax (no
  look-around or backreferences, else as Mooncake's ECMAScript patterns).
- The tensor methods store Mooncake's byte layout and key names (``_tp_<rank>``, parallelism
  suffixes, manifests), so tensors cross between Mooncake and kvpool; they import torch when
  called, copy a GPU tensor to host memory before storing it, and return CPU tensors
  (``get_tensor_into_cuda`` copies into a device tensor with torch, after ``setup`` too).
- ``put_from``/``upsert_from``/``put_from_with_metadata`` of 0 bytes answer ``-600`` and store
  nothing (as Mooncake's batch forms); so do ``put_parts``/``upsert_parts`` of no bytes.
  Mooncake's single-key forms answer 0 for a value they do not store.

Where kvpool's blocks work otherwise, the codes are still Mooncake's (``tests/
test_mooncake_parity.py`` compares them with real Mooncake): a second ``put`` of a key answers 0
and keeps the first value; ``upsert`` of a value that a read has leased replaces it (the leased
block is dropped, then the new one stored: a read in between misses the key).

Error codes (kvpool code -> Mooncake code):

================  ==========================================
kvpool            Mooncake
================  ==========================================
not-found         -704 OBJECT_NOT_FOUND
already-exists    -705 OBJECT_ALREADY_EXISTS
leased            -706 OBJECT_HAS_LEASE
expired           -707 LEASE_EXPIRED (a get session's lease ended)
no-space          -200 NO_AVAILABLE_HANDLE
rejected          -200 NO_AVAILABLE_HANDLE (the admission policy refused the block, e.g.
                  ``store_threshold``; Mooncake has no admission step)
value-too-large   -600 INVALID_PARAMS from ``get_into`` and its batch forms (a buffer smaller
                  than the value), as Mooncake; -10 BUFFER_OVERFLOW elsewhere
key-too-long      -400 INVALID_KEY
invalid-argument  -600 INVALID_PARAMS (also unregistered addresses, batch-too-large)
corrupt           -701 INVALID_READ (checksum mismatch; the server drops the block)
timeout, closed,  -900 RPC_FAIL (``unavailable``: the server cannot be reached or the
unavailable       connection died)
(no such thing)   -1012 NOT_SUPPORTED (segments, copy and move tasks), -1400 TASK_NOT_FOUND
anything else     -1 INTERNAL_ERROR (also ``setup`` that cannot reach the server, as Mooncake)
================  ==========================================
"""

from kvpool.mooncake._codes import (
    BUFFER_OVERFLOW,
    FILE_NOT_FOUND,
    INTERNAL_ERROR,
    INVALID_KEY,
    INVALID_PARAMS,
    INVALID_READ,
    INVALID_REPLICA,
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    NOT_SUPPORTED,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    TASK_NOT_FOUND,
    to_mooncake_code,
)
from kvpool.mooncake._store import MooncakeDistributedStore
from kvpool.mooncake._tensor import _deserialize_tensor, _serialize_tensor, _tensor_metadata_size
from kvpool.mooncake._types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
)

# Where Mooncake code reports the class (``type(store).__module__``), name the public module.
for _cls in (MooncakeDistributedStore, ReplicateConfig, ReplicaDescriptor, MemoryDescriptor, DiskDescriptor, Descriptor,
             BufferHandle, MooncakeHostMemAllocator, ParallelAxis, TensorParallelism, ReadTarget, QueryTaskResponse,
             ObjectDataType, SoftPinAction, ReplicaStatus, TaskType, TaskStatus):
    _cls.__module__ = __name__
del _cls

# Mooncake's module exports its enums' values too (pybind11's ``export_values``).
UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE, ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, GENERAL = ObjectDataType
UNDEFINED, INITIALIZED, PROCESSING, COMPLETE, REMOVED, FAILED = ReplicaStatus
REPLICA_COPY, REPLICA_MOVE = TaskType
PENDING, PROCESSING, FAILED, SUCCESS = TaskStatus  # exported after ReplicaStatus: these win, as there

#: The same class under kvpool's name.
KVPoolStore = MooncakeDistributedStore

__all__ = [
    "MooncakeDistributedStore",
    "KVPoolStore",
    "ReplicateConfig",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "Descriptor",
    "BufferHandle",
    "MooncakeHostMemAllocator",
    "ObjectDataType",
    "SoftPinAction",
    "ReplicaStatus",
    "TaskType",
    "TaskStatus",
    "QueryTaskResponse",
    "ParallelAxis",
    "TensorParallelism",
    "ReadTarget",
    "bind_to_numa_node",
    "get_alloc_func_addr",
    "get_free_func_addr",
    "_serialize_tensor",
    "_deserialize_tensor",
    "_tensor_metadata_size",
    "to_mooncake_code",
    "OK",
    "INTERNAL_ERROR",
    "BUFFER_OVERFLOW",
    "NO_AVAILABLE_HANDLE",
    "INVALID_KEY",
    "INVALID_PARAMS",
    "INVALID_READ",
    "INVALID_REPLICA",
    "OBJECT_NOT_FOUND",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "LEASE_EXPIRED",
    "RPC_FAIL",
    "NOT_SUPPORTED",
    "FILE_NOT_FOUND",
    "TASK_NOT_FOUND",
]
