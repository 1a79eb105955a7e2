"""Mooncake Store's Python API on kvpool.

Code written against ``mooncake.store.MooncakeDistributedStore`` switches to kvpool by changing
the import::

    from kvpool.mooncake import MooncakeDistributedStore   # was: from mooncake.store import ...

Method names, arguments and return conventions are Mooncake's: ``0`` or a count for success,
Mooncake's negative error codes for failures (table below), ``b''`` from ``get`` when a key is
missing, ``1/0/-1`` from ``is_exist``. Calls never raise for an outcome Mooncake reports as a
code; they raise ``TypeError`` for arguments of the wrong type, as pybind11 does.

Where kvpool differs on purpose, the method's docstring says so. The main differences:

- ``is_exist``/``batch_is_exist`` never grant or renew a lease (Mooncake's do, which starves
  eviction); ``get``/``get_into`` lease a block for the duration of the read only.
- A kvpool client does not contribute memory to the pool: ``global_segment_size`` and
  ``local_buffer_size`` given to ``setup`` are accepted and ignored; the server's ``dram.size``
  (mapped from the same field of ``mooncake_store_config.json``) is the pool's capacity.
- ``tenant_id`` (``setup``'s keyword, the config file's field, ``MOONCAKE_TENANT_ID``) keeps
  Mooncake's meaning, a key space of its own: keys of a tenant other than ``default`` are stored
  under ``tenant:<id>/`` within the kvpool tenant of the API key (the API key, not the
  ``tenant_id``, is what kvpool authorizes).
- ``lookup(keys)`` (kvpool's own) answers how many leading keys of a prefix chain are resident in
  one request, where Mooncake's connectors call ``batch_is_exist`` over the whole chain.
- Addresses given to ``put_from``/``get_into`` and their batch forms are checked against the
  registered buffers: an address range not entirely inside one ``register_buffer`` range answers
  ``-600`` (invalid params) and is never touched. Mooncake reads or writes it regardless.
- ``get_hostname`` answers the ``local_hostname`` given to ``setup`` without Mooncake's transfer
  port (a kvpool client listens on none); ``remove_by_regex`` takes Rust regex syntax (no
  look-around or backreferences, else as Mooncake's ECMAScript patterns).
- The tensor methods (``put_tensor``, ``get_tensor``, ``batch_put_tensor``, ``batch_get_tensor``,
  ``get_tensor_into``, ``batch_get_tensor_into``) store Mooncake's byte layout; they import torch
  when called (``ImportError`` without it), copy a GPU tensor to host memory before storing it,
  and return CPU tensors. The tensor-parallel and CUDA variants are not offered.
- ``put_from``/``upsert_from`` of 0 bytes answer ``-600`` and store nothing (as Mooncake's batch
  forms); so do ``put_parts``/``upsert_parts`` of no bytes. Mooncake's single-key forms answer 0
  for a value they do not store.

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
anything else     -1 INTERNAL_ERROR
================  ==========================================
"""

from kvpool.mooncake._store import (
    BUFFER_OVERFLOW,
    INTERNAL_ERROR,
    INVALID_KEY,
    INVALID_PARAMS,
    INVALID_READ,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    MooncakeDistributedStore,
    ReplicateConfig,
    to_mooncake_code,
)

# Where Mooncake code reports the class (``type(store).__module__``), name the public module.
MooncakeDistributedStore.__module__ = __name__
ReplicateConfig.__module__ = __name__

#: The same class under kvpool's name.
KVPoolStore = MooncakeDistributedStore

__all__ = [
    "MooncakeDistributedStore",
    "KVPoolStore",
    "ReplicateConfig",
    "to_mooncake_code",
    "OK",
    "INTERNAL_ERROR",
    "BUFFER_OVERFLOW",
    "NO_AVAILABLE_HANDLE",
    "INVALID_KEY",
    "INVALID_PARAMS",
    "INVALID_READ",
    "OBJECT_NOT_FOUND",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "RPC_FAIL",
]
