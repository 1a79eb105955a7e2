"""Mooncake's return codes, kvpool's statuses mapped onto them, and helpers the mixins share."""

from __future__ import annotations

from typing import Callable, Union

from kvpool._native import Client, KvpoolError

Key = Union[str, bytes]

OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
INVALID_READ = -701
INVALID_REPLICA = -702
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
RPC_FAIL = -900
NOT_SUPPORTED = -1012
FILE_NOT_FOUND = -1100
TASK_NOT_FOUND = -1400

_CODES = {
    "ok": OK,
    "not-found": OBJECT_NOT_FOUND,
    "already-exists": OBJECT_ALREADY_EXISTS,
    "leased": OBJECT_HAS_LEASE,
    "no-space": NO_AVAILABLE_HANDLE,
    "rejected": NO_AVAILABLE_HANDLE,
    "value-too-large": BUFFER_OVERFLOW,
    "key-too-long": INVALID_KEY,
    "invalid-argument": INVALID_PARAMS,
    "batch-too-large": INVALID_PARAMS,
    "frame-too-large": INVALID_PARAMS,
    "corrupt": INVALID_READ,
    "expired": LEASE_EXPIRED,
    "timeout": RPC_FAIL,
    "unavailable": RPC_FAIL,
    "closed": RPC_FAIL,
    "shutting-down": RPC_FAIL,
    "unauthorized": RPC_FAIL,
}


def to_mooncake_code(code: str) -> int:
    """Mooncake's error code for a kvpool status name (see the module's table)."""
    return _CODES.get(code, INTERNAL_ERROR)


def error_code(e: KvpoolError) -> int:
    return to_mooncake_code(e.code)  # type: ignore[attr-defined]


def read_code(status: str) -> int:
    """A ``get_into``'s code: Mooncake answers -600 (not -10) for a destination too small."""
    return INVALID_PARAMS if status == "value-too-large" else to_mooncake_code(status)


def put_code(status: str) -> int:
    """A put's code. Mooncake's put of a key that exists succeeds and keeps the first value,
    which is what kvpool does; only the code differs."""
    return OK if status == "already-exists" else to_mooncake_code(status)


def first_error(codes: list[int]) -> int:
    return next((c for c in codes if c != OK), OK)


def held_elsewhere(c: Client, keys: list[Key], upsert: bool) -> list[bool]:
    """On a cluster, which keys of a put (not an upsert) are already stored. The master places a
    put on a node without asking whether another node holds the key, so a second put would store
    a second copy that reads may prefer; Mooncake keeps the first value, so these keys are not
    sent (answering 0). Not atomic: two puts racing can still both store. One server refuses
    the second put by itself (no extra request)."""
    if upsert or not c.cluster:
        return [False] * len(keys)
    return [bool(p) for p in c.exists(keys)]


def replace_leased(c: Client, keys: list[Key], st: list[str], idx: list[int],
                   retry: Callable[[list[Key]], list[str]]) -> list[str]:
    """Upsert of values that reads have leased: Mooncake replaces them, so drop the leased blocks
    (force) and store again. kvpool blocks are immutable, so this is not atomic: a read in between
    misses the key."""
    c.remove(keys, True)
    st = list(st)
    for i, s in zip(idx, retry(keys)):
        st[i] = s
    return st
