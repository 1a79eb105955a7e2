"""Mooncake's session-based ranged transfers (SGLang's direct linker, layer-wise loads and saves):
``batch_get_session_start`` / ``batch_get_into_multi_buffer_ranges`` / ``batch_get_session_end``
and ``batch_put_session_start`` / ``batch_put_from_multi_buffer_ranges`` /
``batch_put_session_end`` / ``batch_put_session_revoke``."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvpool._native import KvpoolError, SharedBuffer
from kvpool.mooncake._codes import (
    INVALID_PARAMS,
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    Key,
    error_code,
    to_mooncake_code,
)
from kvpool.mooncake._types import group_ids_fit, pin_of

log = logging.getLogger("kvpool.mooncake")

#: How long a get session holds its blocks: Mooncake's default ``default_kv_lease_ttl`` (10 s).
SESSION_LEASE_S = 10.0


@dataclass
class _Lease:
    ids: list[int]  # none on a cluster, whose lookups hold nothing
    holders: int = 0


@dataclass
class _GetSession:
    pool_key: Key
    size: int
    lease: _Lease
    deadline: float


@dataclass
class _Staging:
    buf: SharedBuffer
    holders: int = 0


@dataclass
class _PutSession:
    pool_key: Key
    size: int
    staging: _Staging
    offset: int
    pin: Optional[str]
    writable: bool = True
    inflight: int = 0
    done: threading.Condition = field(default_factory=threading.Condition)


class SessionMethods:
    """Mixed into ``MooncakeDistributedStore``.

    A get session holds its blocks as Mooncake's holds its query's lease: ``start`` leases every
    found block for :data:`SESSION_LEASE_S` seconds (``remove`` answers -706 meanwhile), range
    reads after that answer -707 (``LEASE_EXPIRED``) as Mooncake's, ``end`` releases the lease.
    On a cluster the session holds nothing beyond the read lease ``start``'s size request grants
    (kvpool's cluster lookups hold nothing): a block evicted later is a miss of the range read.
    A range read moves the value's requested bytes into the caller's registered memory (device
    memory once the native client accepts it: addresses are passed through); kvpool's server
    reads whole values, so each range call reads each value once, the bytes outside the ranges
    landing in scratch memory.

    A put session stages the object in memory shared with a same-host server (as Mooncake
    reserves it in a segment): ``start`` answers -705 for a key that exists, range writes copy the
    caller's registered host memory into the staging memory, ``end`` stores the staged bytes in
    one request (the server reads them directly on the same host), ``revoke`` drops them. Until
    ``end`` the key is not stored (``is_exist`` answers 0, as Mooncake's)."""

    def _init_sessions(self) -> None:
        self._sessions_lock = threading.Lock()
        self._get_sessions: dict[Key, _GetSession] = {}
        self._put_sessions: dict[Key, _PutSession] = {}

    def _end_sessions(self) -> None:
        with self._sessions_lock:
            gets, self._get_sessions = self._get_sessions, {}
            puts, self._put_sessions = self._put_sessions, {}
        for g in gets.values():
            self._drop_lease(g.lease)
        for p in puts.values():
            self._drop_staging(p.staging)

    def _drop_lease(self, lease: _Lease) -> None:
        lease.holders -= 1
        c = self._c()
        if lease.holders <= 0 and c is not None:
            for lid in lease.ids:
                try:
                    c.release(lid)
                except KvpoolError:
                    pass  # ended already (expired or the connection closed)
            lease.ids = []

    def _drop_staging(self, st: _Staging) -> None:
        st.holders -= 1
        c = self._c()
        if st.holders <= 0 and c is not None:
            try:
                c.unregister(st.buf.address)
            except KvpoolError:
                pass

    # ---- get sessions ---------------------------------------------------------------------

    def batch_get_session_start(self, keys: Sequence[Key]) -> list[int]:
        """Open a get session per key: 0, or -704 for a missing key (any earlier session of the
        key is replaced). Leases the found blocks for :data:`SESSION_LEASE_S` seconds. ``[]``
        before ``setup`` (as Mooncake)."""
        c = self._c()
        if c is None or not keys:
            return []
        out = [INVALID_PARAMS] * len(keys)
        pool = self._k(keys)
        try:
            sizes = c.get_size(pool)
            found = list(dict.fromkeys(p for p, (s, _) in zip(pool, sizes) if s == "ok"))
            held: dict[Key, _Lease] = {}
            # One lease for every found key when they are still all there; one each otherwise.
            n, ids = c.lookup_lease(found, SESSION_LEASE_S) if found else (0, [])
            if n == len(found):
                shared = _Lease(list(ids))
                held = {k: shared for k in found}
            else:
                for lid in ids:
                    c.release(lid)
                for k in found:
                    m, one = c.lookup_lease([k], SESSION_LEASE_S)
                    if m == 1:
                        held[k] = _Lease(list(one))
        except KvpoolError as e:
            return [error_code(e)] * len(keys)
        deadline = time.monotonic() + SESSION_LEASE_S
        with self._sessions_lock:
            for i, (key, p, (status, size)) in enumerate(zip(keys, pool, sizes)):
                lease = held.get(p)
                if lease is not None:
                    lease.holders += 1  # before the old session's lease is let go: it may be this one
                old = self._get_sessions.pop(key, None)
                if old is not None:
                    self._drop_lease(old.lease)
                if lease is None:
                    out[i] = OBJECT_NOT_FOUND if status in ("ok", "not-found") else to_mooncake_code(status)
                    continue
                self._get_sessions[key] = _GetSession(p, int(size), lease, deadline)
                out[i] = OK
        for lease in {id(v): v for v in held.values()}.values():
            if lease.holders == 0:
                self._drop_lease(lease)
        return out

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[Key],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        all_src_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """For each key with an open get session, copy ``all_sizes[i][k]`` bytes from offset
        ``all_src_offsets[i][k]`` of its value to ``all_buffer_ptrs[i][k]`` (registered memory).
        Bytes copied per key, or -600 (no session, a range past the value's end, lists of
        different lengths, an unregistered destination), or -707 when the session's lease ended
        (the session is dropped), as Mooncake."""
        c = self._c()
        if c is None:
            return []
        out = [INVALID_PARAMS] * len(keys)
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets)):
            return out
        now = time.monotonic()
        reqs = []
        with self._sessions_lock:
            for i, key in enumerate(keys):
                ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_src_offsets[i]
                if not (len(ptrs) == len(sizes) == len(offs)):
                    continue
                sess = self._get_sessions.get(key)
                if sess is None:
                    continue
                if now >= sess.deadline:
                    del self._get_sessions[key]
                    self._drop_lease(sess.lease)
                    out[i] = LEASE_EXPIRED
                    continue
                reqs.append((i, sess.pool_key, sess.size, [(int(p), int(o), int(n)) for p, n, o in zip(ptrs, sizes, offs)]))
        for i, codes in self._read_ranges(reqs).items():
            bad = [x for x in codes if x < 0]
            out[i] = bad[0] if bad else sum(codes)
        now = time.monotonic()
        with self._sessions_lock:
            for i, _, _, _ in reqs:
                sess = self._get_sessions.get(keys[i])
                if out[i] >= 0 and sess is not None and now >= sess.deadline:
                    del self._get_sessions[keys[i]]
                    self._drop_lease(sess.lease)
                    out[i] = LEASE_EXPIRED
        return out

    def batch_get_session_end(self, keys: Sequence[Key]) -> int:
        """Close the get sessions of ``keys`` (releasing their leases); 0 (-1 before ``setup``)."""
        if self._c() is None:
            return -1
        with self._sessions_lock:
            for key in keys:
                sess = self._get_sessions.pop(key, None)
                if sess is not None:
                    self._drop_lease(sess.lease)
        return OK

    # ---- put sessions ---------------------------------------------------------------------

    def batch_put_session_start(self, keys: Sequence[Key], sizes: Sequence[int], config: Any = None) -> list[int]:
        """Open a put session per key for an object of ``sizes[i]`` bytes: 0, -705 for a key that
        is stored, -600 for a size of 0, a key with an open put session, or ``config.group_ids``
        of another length, -200 when no staging memory can be had. ``config``'s pin applies at
        ``end``. ``[]`` before ``setup`` (as Mooncake)."""
        c = self._c()
        if c is None:
            return []
        if len(keys) != len(sizes) or not group_ids_fit(config, len(keys)):
            return [INVALID_PARAMS] * len(keys)
        out = [INVALID_PARAMS] * len(keys)
        pool = self._k(keys)
        try:
            present = c.exists(pool) if keys else []
        except KvpoolError as e:
            return [error_code(e)] * len(keys)
        new: list[int] = []
        with self._sessions_lock:
            seen: set[Key] = set()
            for i, key in enumerate(keys):
                if key in self._put_sessions or key in seen or int(sizes[i]) <= 0:
                    continue
                seen.add(key)
                if present[i]:
                    out[i] = OBJECT_ALREADY_EXISTS
                    continue
                new.append(i)
        if not new:
            return out
        total = sum(int(sizes[i]) for i in new)
        try:
            buf = c.alloc_buffer(total)
            c.register(buf.address, total)
        except KvpoolError as e:
            log.warning("batch_put_session_start: no staging memory for %d bytes: %s", total, e)
            for i in new:
                out[i] = NO_AVAILABLE_HANDLE
            return out
        staging, at, pin = _Staging(buf), 0, pin_of(config)
        with self._sessions_lock:
            for i in new:
                if keys[i] in self._put_sessions:
                    continue  # opened by another thread meanwhile
                staging.holders += 1
                self._put_sessions[keys[i]] = _PutSession(pool[i], int(sizes[i]), staging, at, pin)
                at += int(sizes[i])
                out[i] = OK
        if staging.holders == 0:
            staging.holders = 1
            self._drop_staging(staging)
        return out

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[Key],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        all_dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """For each key with an open put session, copy ``all_sizes[i][k]`` bytes at
        ``all_buffer_ptrs[i][k]`` to offset ``all_dst_offsets[i][k]`` of the object. Bytes copied
        per key, or -600 (no session or one ended, a range past the object's end, lists of
        different lengths, a source outside the registered buffers: kvpool reads only registered
        memory, Mooncake reads any)."""
        c = self._c()
        if c is None:
            return []
        out = [INVALID_PARAMS] * len(keys)
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets)):
            return out
        try:
            regions = [(int(a), int(n)) for a, n, *_ in c.registered()]
        except KvpoolError as e:
            return [error_code(e)] * len(keys)

        def registered(p: int, n: int) -> bool:
            return any(a <= p and p + n <= a + size for a, size in regions)

        for i, key in enumerate(keys):
            ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_dst_offsets[i]
            if not (len(ptrs) == len(sizes) == len(offs)):
                continue
            with self._sessions_lock:
                sess = self._put_sessions.get(key)
                if sess is None or not sess.writable:
                    continue
                if any(int(o) < 0 or int(n) < 0 or int(o) + int(n) > sess.size for n, o in zip(sizes, offs)):
                    continue
                if any(int(n) and not registered(int(p), int(n)) for p, n in zip(ptrs, sizes)):
                    continue
                sess.inflight += 1
            try:
                base = sess.staging.buf.address + sess.offset
                for p, n, o in zip(ptrs, sizes, offs):
                    if int(n):
                        ctypes.memmove(base + int(o), int(p), int(n))
                out[i] = sum(int(n) for n in sizes)
            finally:
                with sess.done:
                    sess.inflight -= 1
                    sess.done.notify_all()
        return out

    def _seal(self, keys: Sequence[Key]) -> list[Optional[_PutSession]]:
        """The put sessions of ``keys``, sealed against new range writes, once none is running."""
        with self._sessions_lock:
            found = [self._put_sessions.get(k) for k in keys]
            for s in found:
                if s is not None:
                    s.writable = False
        for s in found:
            if s is not None:
                with s.done:
                    s.done.wait_for(lambda s=s: s.inflight == 0)
        return found

    def batch_put_session_end(self, keys: Sequence[Key]) -> list[int]:
        """Store the staged objects (one request): 0 per key, -600 without a session, or the
        put's code (the session is kept for another ``end`` or a ``revoke`` then, as Mooncake;
        -705 when the key was stored by another writer meanwhile)."""
        c = self._c()
        if c is None:
            return []
        out = [INVALID_PARAMS] * len(keys)
        sessions = self._seal(keys)
        live = [(i, s) for i, s in enumerate(sessions) if s is not None]
        by_pin: dict[Optional[str], list[tuple[int, _PutSession]]] = {}
        for i, s in live:
            by_pin.setdefault(s.pin, []).append((i, s))
        for pin, items in by_pin.items():
            try:
                st = c.put_from_multi([s.pool_key for _, s in items],
                                      [[s.staging.buf.address + s.offset] for _, s in items],
                                      [[s.size] for _, s in items], False, pin=pin)
            except KvpoolError as e:
                st = [e.code] * len(items)  # type: ignore[attr-defined]
            for (i, s), status in zip(items, st):
                out[i] = to_mooncake_code(status)
                with self._sessions_lock:
                    if status == "ok" and self._put_sessions.get(keys[i]) is s:
                        del self._put_sessions[keys[i]]
                        self._drop_staging(s.staging)
        return out

    def batch_put_session_revoke(self, keys: Sequence[Key]) -> list[int]:
        """Drop the staged objects: 0 per key, -600 without a session."""
        if self._c() is None:
            return []
        out = [INVALID_PARAMS] * len(keys)
        sessions = self._seal(keys)
        with self._sessions_lock:
            for i, (key, s) in enumerate(zip(keys, sessions)):
                if s is not None and self._put_sessions.get(key) is s:
                    del self._put_sessions[key]
                    self._drop_staging(s.staging)
                    out[i] = OK
        return out
