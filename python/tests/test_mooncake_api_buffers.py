"""kvpool's Mooncake API: values in handles, ranged reads and the session transfers (kvpool only;
``test_mooncake_parity.py`` compares the same calls with real Mooncake). Every test using
``store`` runs on both data paths (same-host shared memory and QUIC)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

import kvpool.mooncake._sessions as sessions
from kvpool.mooncake import (
    INVALID_PARAMS,
    LEASE_EXPIRED,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    BufferHandle,
    MooncakeDistributedStore,
)




class _Recorder:
    """The native client, with the names of the calls made through it."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if callable(attr):
            self.calls.append(name)
        return attr


def _registered(store: MooncakeDistributedStore, n: int, fill: bool = True) -> Any:
    a = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8) if fill else np.zeros(n, np.uint8)
    assert store.register_buffer(a.ctypes.data, n) == 0
    return a


def test_get_buffer_lands_once_in_memory_the_handle_owns(store: MooncakeDistributedStore) -> None:
    values = {"h/a": b"world!", "h/b": bytes(range(256)) * 4000}
    assert store.put_batch(list(values), list(values.values())) == 0
    rec = _Recorder(store._client)
    store._client = rec  # type: ignore[assignment]
    try:
        a, missing, b = store.batch_get_buffer(["h/a", "h/missing", "h/b"])
    finally:
        store._client = rec._client
    # Sizes, then one read straight into one shared buffer: never the bytes path (get_batch).
    assert rec.calls == ["get_size", "alloc_buffer", "register", "get_into", "unregister"], rec.calls
    assert missing is None and isinstance(a, BufferHandle) and isinstance(b, BufferHandle)
    assert (a.size(), len(a), bytes(a), bytes(memoryview(b))) == (6, 6, b"world!", values["h/b"])
    view = memoryview(a)
    assert (view.ndim, view.itemsize, view.readonly) == (1, 1, False)
    arr = np.array(b, copy=False)
    assert arr.dtype == np.int8 and arr.ctypes.data == b.ptr()
    assert ctypes.string_at(a.ptr(), 6) == b"world!"
    # The handles share one buffer and outlive the store.
    assert b.ptr() == a.ptr() + 6
    store.close()
    assert bytes(a) == b"world!"


def test_get_buffer_leases_and_misses(store: MooncakeDistributedStore) -> None:
    assert store.get_buffer("gb/missing") is None and store.batch_get_buffer([]) == []
    assert store.put("gb/a", b"x" * 10) == 0
    h = store.get_buffer("gb/a")
    assert h is not None and bytes(h) == b"x" * 10
    assert store.remove("gb/a") == OBJECT_HAS_LEASE  # a read's lease, as Mooncake's
    assert store.remove("gb/a", True) == 0 and store.get_buffer("gb/a") is None


def test_put_from_with_metadata(store: MooncakeDistributedStore) -> None:
    a = _registered(store, 1 << 16)
    base = a.ctypes.data
    assert store.put_from_with_metadata("pm/a", base + 100, base, 50, 10) == 0
    assert store.get("pm/a") == bytes(a[:10]) + bytes(a[100:150])
    assert store.put_from_with_metadata("pm/a", base, base, 20, 20) == 0 and store.get_size("pm/a") == 60  # kept
    assert store.put_from_with_metadata("pm/b", base + 5, base, 30, 0) == 0 and store.get("pm/b") == bytes(a[5:35])
    assert store.put_from_with_metadata("pm/z", base, base, 0, 10) == INVALID_PARAMS and store.is_exist("pm/z") == 0
    plain = np.ones(64, np.uint8)  # not registered: refused, never read
    assert store.put_from_with_metadata("pm/u", plain.ctypes.data, base, 64, 10) == INVALID_PARAMS
    assert store.unregister_buffer(base) == 0


def test_get_into_ranges(store: MooncakeDistributedStore) -> None:
    value = bytes(range(200))
    assert store.put("rg/r", value) == 0 and store.put("rg/s", b"s" * 5000) == 0
    d = _registered(store, 1 << 16, fill=False)
    base = d.ctypes.data
    got = store.get_into_ranges([base, base + 4096], [["rg/r", "rg/missing"], ["rg/r", "rg/s"]],
                                [[[0, 10, 20], [100]], [[0, 30], [100]]], [[[5, 50, 5], [0]], [[150, 150], [4990]]],
                                [[[3, 4, 6], [5]], [[20, 5], [10]]])
    assert got == [[[3, 4, 6], [OBJECT_NOT_FOUND]], [[20, 5], [10]]]
    assert bytes(d[:3]) == value[5:8] and bytes(d[10:14]) == value[50:54] and bytes(d[20:26]) == value[5:11]
    assert bytes(d[4096:4116]) == value[150:170] and bytes(d[4126:4131]) == value[150:155]
    assert bytes(d[4196:4206]) == b"s" * 10
    # A range past the end, lists of different lengths, a destination outside registered memory.
    assert store.get_into_ranges([base], [["rg/r"]], [[[0]]], [[[199]]], [[[5]]]) == [[[INVALID_PARAMS]]]
    assert store.get_into_ranges([base], [["rg/r"]], [[[0, 1]]], [[[0]]], [[[5]]]) == [[[INVALID_PARAMS] * 2]]
    plain = np.zeros(256, np.uint8)
    assert store.get_into_ranges([plain.ctypes.data], [["rg/r"]], [[[0]]], [[[0]]], [[[5]]]) == [[[INVALID_PARAMS]]]
    assert not plain.any() and store.get_into_ranges([], [], [], [], []) == []
    assert store.unregister_buffer(base) == 0


def test_get_sessions(store: MooncakeDistributedStore, monkeypatch: pytest.MonkeyPatch) -> None:
    value = bytes(range(256)) * 8
    assert store.put_batch(["gs/a", "gs/b"], [value, value[::-1]]) == 0
    d = _registered(store, 1 << 16, fill=False)
    base = d.ctypes.data
    assert store.batch_get_session_start(["gs/a", "gs/missing", "gs/b", "gs/a"]) == [0, OBJECT_NOT_FOUND, 0, 0]
    # Layer by layer: 4 ranges of 512 bytes per key, each into its own destination.
    for layer in range(4):
        got = store.batch_get_into_multi_buffer_ranges(
            ["gs/a", "gs/b"], [[base + layer * 512], [base + 8192 + layer * 512]], [[512], [512]],
            [[layer * 512], [layer * 512]])
        assert got == [512, 512]
    assert bytes(d[:2048]) == value and bytes(d[8192:10240]) == value[::-1]
    assert store.remove("gs/a") == OBJECT_HAS_LEASE  # the session holds it
    assert store.batch_get_into_multi_buffer_ranges(["gs/a"], [[base]], [[10]], [[2040]]) == [INVALID_PARAMS]
    assert store.batch_get_into_multi_buffer_ranges(["gs/missing"], [[base]], [[1]], [[0]]) == [INVALID_PARAMS]
    plain = np.zeros(64, np.uint8)
    assert store.batch_get_into_multi_buffer_ranges(["gs/a"], [[plain.ctypes.data]], [[8]], [[0]]) == [INVALID_PARAMS]
    assert store.batch_get_session_end(["gs/a", "gs/b", "gs/missing"]) == 0
    assert store.batch_get_into_multi_buffer_ranges(["gs/a"], [[base]], [[10]], [[0]]) == [INVALID_PARAMS]
    # A session whose lease ended answers LEASE_EXPIRED and is dropped.
    monkeypatch.setattr(sessions, "SESSION_LEASE_S", 0.2)
    assert store.batch_get_session_start(["gs/b"]) == [0]
    import time

    time.sleep(0.3)
    assert store.batch_get_into_multi_buffer_ranges(["gs/b"], [[base]], [[10]], [[0]]) == [LEASE_EXPIRED]
    assert store.batch_get_into_multi_buffer_ranges(["gs/b"], [[base]], [[10]], [[0]]) == [INVALID_PARAMS]
    assert store.unregister_buffer(base) == 0


def test_put_sessions(store: MooncakeDistributedStore) -> None:
    s = _registered(store, 1 << 16)
    base = s.ctypes.data
    assert store.put("ps/stored", b"x") == 0
    assert store.batch_put_session_start(["ps/a", "ps/b", "ps/stored", "ps/zero"], [300, 100, 10, 0]) == \
        [0, 0, OBJECT_ALREADY_EXISTS, INVALID_PARAMS]
    assert store.batch_put_session_start(["ps/a"], [300]) == [INVALID_PARAMS]  # already open
    assert store.is_exist("ps/a") == 0  # not stored before end, as Mooncake
    for layer in range(3):
        assert store.batch_put_from_multi_buffer_ranges(["ps/a"], [[base + 1000 * layer]], [[100]], [[100 * layer]]) \
            == [100]
    assert store.batch_put_from_multi_buffer_ranges(["ps/b"], [[base, base + 50]], [[50, 50]], [[50, 0]]) == [100]
    assert store.batch_put_from_multi_buffer_ranges(["ps/b"], [[base]], [[10]], [[95]]) == [INVALID_PARAMS]
    plain = np.ones(64, np.uint8)
    assert store.batch_put_from_multi_buffer_ranges(["ps/b"], [[plain.ctypes.data]], [[8]], [[0]]) == [INVALID_PARAMS]
    assert store.batch_put_from_multi_buffer_ranges(["ps/none"], [[base]], [[1]], [[0]]) == [INVALID_PARAMS]
    assert store.batch_put_session_end(["ps/a", "ps/none"]) == [0, INVALID_PARAMS]
    assert store.get("ps/a") == bytes(s[0:100]) + bytes(s[1000:1100]) + bytes(s[2000:2100])
    assert store.batch_put_from_multi_buffer_ranges(["ps/a"], [[base]], [[1]], [[0]]) == [INVALID_PARAMS]
    assert store.batch_put_session_revoke(["ps/b", "ps/a"]) == [0, INVALID_PARAMS] and store.is_exist("ps/b") == 0
    # A key stored by another writer while the session was open: end answers -705.
    assert store.batch_put_session_start(["ps/c"], [4]) == [0]
    assert store.put("ps/c", b"mine") == 0
    assert store.batch_put_session_end(["ps/c"]) == [OBJECT_ALREADY_EXISTS]
    assert store.batch_put_session_revoke(["ps/c"]) == [0] and store.get("ps/c") == b"mine"
    assert store.unregister_buffer(base) == 0


def test_sessions_end_with_close_and_need_setup() -> None:
    st = MooncakeDistributedStore()
    assert st.batch_get_session_start(["k"]) == [] and st.batch_put_session_start(["k"], [1]) == []
    assert st.batch_get_session_end(["k"]) == -1 and st.batch_put_session_revoke(["k"]) == []
    assert st.get_buffer("k") is None and st.get_into_ranges([1], [["k"]], [[[0]]], [[[0]]], [[[1]]]) == \
        [[[INVALID_PARAMS]]]
