"""The registry of parity checks (see ``test_mooncake_parity.py``) and the helpers checks share.

A check is a small function of a store (Mooncake's ``MooncakeDistributedStore`` or kvpool's) and
a key maker; it returns what a caller observes (return codes, values, sizes, raw stored bytes).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

Key = Callable[[str], str]
Check = Callable[[Any, Key], Any]

CHECKS: dict[str, Check] = {}


def check(fn: Check) -> Check:
    CHECKS[fn.__name__] = fn
    return fn


#: check name -> why kvpool answers differently on purpose (README.md lists the same).
DELIBERATE: dict[str, str] = {
    "put_from_zero_bytes": "a put_from of 0 bytes answers -600 and stores nothing, as Mooncake's batch "
    "forms do; Mooncake's single put_from answers 0 for a value it does not store",
    "put_parts_of_no_bytes": "put_parts/upsert_parts of no bytes answer -600 (as put of b''); Mooncake "
    "answers 0 and stores nothing",
}


def impl(store: Any) -> Any:
    """The module of the store's own implementation (``mooncake.store`` or ``kvpool.mooncake``)."""
    store = getattr(store, "_store", store)  # through _Settled
    return importlib.import_module(type(store).__module__)


def _replicate_config(store: Any) -> Any:
    """A ``ReplicateConfig`` of the store's own implementation."""
    return impl(store).ReplicateConfig()


class _Buffer:
    """A registered numpy buffer, unregistered on exit."""

    def __init__(self, store: Any, size: int, fill: bool = True) -> None:
        self.store = store
        self.a = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8) if fill else np.zeros(size, np.uint8)
        self.addr = int(self.a.ctypes.data)
        self.rc = store.register_buffer(self.addr, size)

    def __enter__(self) -> _Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.unregister_buffer(self.addr)



TENSOR_CHECKS: dict[str, Check] = {}


def tensor_check(fn: Check) -> Check:
    TENSOR_CHECKS[fn.__name__] = fn
    return fn


def digest(b: Any) -> Any:
    """Stored bytes, shortened for reports: their length and SHA-256 prefix (None stays None)."""
    if b is None:
        return None
    b = bytes(b)
    return len(b), hashlib.sha256(b).hexdigest()[:16]
