"""Registered memory: ``register_buffer``, the ``put_from``/``get_into`` families, ranged reads,
``get_buffer`` (a ``BufferHandle`` over memory the server wrote into) and the memory pool."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Optional

from kvpool._native import Client, KvpoolError, SharedBuffer
from kvpool.mooncake._codes import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    OK,
    Key,
    error_code as _error_code,
    held_elsewhere,
    put_code,
    read_code,
    replace_leased,
    to_mooncake_code,
)
from kvpool.mooncake._types import BufferHandle, buffer_handle, group_ids_fit, pin_of

log = logging.getLogger("kvpool.mooncake")

#: One ranged read: (destination address, offset in the value, bytes).
Range = tuple[int, int, int]


class BufferMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    _client: Optional[Client]
    _dummy: bool

    def _init_buffers(self) -> None:
        self._mem_pool: dict[int, SharedBuffer] = {}
        self._scratch: list[SharedBuffer] = []  # registered, free for a ranged read's skipped bytes
        self._scratch_lock = threading.Lock()

    def _drop_buffers(self) -> None:
        c = self._c()
        with self._scratch_lock:
            scratch, self._scratch = self._scratch, []
        for b in scratch:
            if c is not None:
                try:
                    c.unregister(b.address)
                except KvpoolError:
                    pass
        self._mem_pool.clear()

    # ---- registered memory ------------------------------------------------------------

    def alloc_buffer(self, size: int) -> SharedBuffer:
        """kvpool's own: memory shared with a same-host server (numpy-compatible through the buffer
        protocol: ``numpy.frombuffer(buf, dtype=...)``). Register it (``register_buffer(
        buf.address, buf.size)``) and ``put_from``/``get_into`` through it are zero-copy: the server
        copies between its DRAM segment and this memory, no byte crosses a socket. Over QUIC
        (another host) the same calls send the bytes in band."""
        return self.client.alloc_buffer(size)

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``[buffer_ptr, buffer_ptr + size)`` (a numpy ``ctypes.data``, torch
        ``data_ptr()`` or a ``SharedBuffer.address``) for ``put_from``/``get_into``. 0, or -600
        for an empty range or one that overlaps a registered range.

        Path: a range inside an ``alloc_buffer`` buffer moves zero-copy (the server copies
        directly); any other memory is copied once by the client into shared staging memory on
        the same host (or sent in band over QUIC elsewhere)."""
        c = self._c()
        if c is None:
            return INTERNAL_ERROR
        try:
            c.register(int(buffer_ptr), int(size))
            return OK
        except KvpoolError as e:
            log.warning("register_buffer: %s", e)
            return _error_code(e)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or -600 when nothing is registered at ``buffer_ptr``. Waits for transfers using it."""
        c = self._c()
        if c is None:
            return INTERNAL_ERROR
        try:
            c.unregister(int(buffer_ptr))
            return OK
        except KvpoolError as e:
            return _error_code(e)

    def put_from(self, key: Key, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (inside a registered buffer); 0 or a code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key: Key, buffer_ptr: int, size: int, config: Any = None) -> int:
        """``put_from`` that replaces an existing value."""
        return self._put_from([key], [[buffer_ptr]], [[size]], True, config)[0]

    def get_into(self, key: Key, buffer_ptr: int, size: int) -> int:
        """Read the value into ``[buffer_ptr, buffer_ptr + size)``; the number of bytes read, or a
        negative code (-704 missing, -10 value larger than ``size``, -600 unregistered range)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_put_from(
        self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int], config: Any = None
    ) -> list[int]:
        """``put_from`` for many keys in one request; one code per key."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._put_from(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes], False, config)

    def batch_upsert_from(
        self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int], config: Any = None
    ) -> list[int]:
        """``upsert_from`` for many keys; one code per key."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._put_from(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes], True, config)

    def batch_get_into(self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``get_into`` for many keys in one request; bytes read or a negative code per key.
        Destinations of one call may not overlap (-600 for all)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._get_into(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes])

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[Key],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: Any = None,
    ) -> list[int]:
        """Each value is the concatenation of several registered ranges (e.g. one KV block's slice
        of every layer). Ranges that follow each other in memory move as one; scattered pieces
        are gathered by the client into shared staging memory (one copy), which the server reads
        directly on the same host. One code per key."""
        return self._put_from(keys, all_buffer_ptrs, all_sizes, False, config)

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[Key],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Each value is split over several registered ranges, filled in order. Bytes read or a
        negative code per key. ``prefer_alloc_in_same_node`` is accepted and ignored."""
        return self._get_into(keys, all_buffer_ptrs, all_sizes)

    def _put_from(
        self,
        keys: Sequence[Key],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        upsert: bool,
        config: Any,
    ) -> list[int]:
        c = self._c()
        if c is None:
            return [INTERNAL_ERROR] * len(keys)
        if len(keys) != len(ptrs) or len(keys) != len(sizes) or not group_ids_fit(config, len(keys)):
            return [INVALID_PARAMS] * len(keys)
        # As Mooncake's batch forms: an empty item answers -600, the others are stored.
        live = [i for i, sz in enumerate(sizes) if sum(sz) > 0]
        out = [INVALID_PARAMS] * len(keys)
        if not live:
            return out
        try:
            held = held_elsewhere(c, self._k([keys[i] for i in live]), upsert)
        except KvpoolError as e:
            return [_error_code(e) if i in live else INVALID_PARAMS for i in range(len(keys))]
        for i in [i for i, h in zip(live, held) if h]:
            out[i] = OK
        live = [i for i, h in zip(live, held) if not h]
        if not live:
            return out
        lkeys = self._k([keys[i] for i in live])
        ptrs = [list(ptrs[i]) for i in live]
        sizes = [list(sizes[i]) for i in live]
        pin = pin_of(config)
        try:
            st = c.put_from_multi(lkeys, ptrs, sizes, upsert, pin=pin)
            again = [j for j, s in enumerate(st) if upsert and s == "leased"]
            if again:
                st = replace_leased(c, [lkeys[j] for j in again], st, again, lambda ks: c.put_from_multi(
                    ks, [ptrs[j] for j in again], [sizes[j] for j in again], True, pin=pin))
        except KvpoolError as e:
            return [_error_code(e) if i in live else INVALID_PARAMS for i in range(len(keys))]
        for i, s in zip(live, st):
            out[i] = put_code(s)
        return out

    def _get_into(self, keys: Sequence[Key], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        c = self._c()
        if c is None:
            return [INTERNAL_ERROR] * len(keys)
        try:
            got = c.get_into_multi(self._k(keys), [list(p) for p in ptrs], [list(s) for s in sizes])
        except KvpoolError as e:
            return [_error_code(e)] * len(keys)
        # Mooncake answers -600 (not -10) for a destination smaller than the value.
        return [int(n) if s == "ok" else read_code(s) for s, n in got]



    def put_from_with_metadata(self, key: Key, buffer_ptr: int, metadata_buffer_ptr: int, size: int,
                               metadata_size: int, config: Any = None) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes at
        ``buffer_ptr`` as one value (both inside registered buffers), as Mooncake: 0 or a
        negative code (Mooncake returns this method's failure codes negated, as positive
        numbers). A ``size`` of 0 answers -600 and stores nothing (Mooncake: 0, nothing stored),
        as ``put_from`` of 0 bytes."""
        if self._c() is None:
            return INVALID_PARAMS
        if int(size) == 0:
            return INVALID_PARAMS
        ptrs = ([int(metadata_buffer_ptr)] if metadata_size else []) + [int(buffer_ptr)]
        sizes = ([int(metadata_size)] if metadata_size else []) + [int(size)]
        return self._put_from([key], [ptrs], [sizes], False, config)[0]

    # ---- values in memory the handle owns ------------------------------------------------

    def get_buffer(self, key: Key) -> Optional[BufferHandle]:
        """The value as a :class:`BufferHandle`, or None when the key is missing (or on any
        error), as Mooncake. The server writes the value straight into memory it shares with
        this client (same host; in band over QUIC elsewhere), which the handle owns: no copy in
        Python. Leases the block like any read."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[Key]) -> list[Optional[BufferHandle]]:
        """``get_buffer`` of many keys: two requests (sizes, then one read into one shared buffer
        the handles split); None for each missing key."""
        c = self._c()
        out: list[Optional[BufferHandle]] = [None] * len(keys)
        if c is None or not keys:
            return out
        pool_keys = self._k(keys)
        try:
            sizes = c.get_size(pool_keys)
        except KvpoolError as e:
            log.warning("batch_get_buffer: %s", e)
            return out
        live = [i for i, (s, n) in enumerate(sizes) if s == "ok" and n > 0]
        if not live:
            return out
        total = sum(int(sizes[i][1]) for i in live)
        try:
            buf = c.alloc_buffer(total)
            c.register(buf.address, total)
        except KvpoolError as e:
            log.warning("batch_get_buffer: %s", e)
            return out
        offsets, at = [], 0
        for i in live:
            offsets.append(at)
            at += int(sizes[i][1])
        try:
            got = c.get_into([pool_keys[i] for i in live], [buf.address + o for o in offsets],
                             [int(sizes[i][1]) for i in live])
        except KvpoolError as e:
            log.warning("batch_get_buffer: %s", e)
            got = [("error", 0)] * len(live)
        finally:
            try:
                c.unregister(buf.address)
            except KvpoolError:
                pass
        retry = []
        for i, off, (s, n) in zip(live, offsets, got):
            if s == "ok":
                out[i] = buffer_handle(buf, off, int(n))
            elif s != "not-found":
                retry.append(i)  # e.g. replaced by a larger value in between: read it as bytes
        if retry:
            try:
                for i, (s, v) in zip(retry, c.get_batch([pool_keys[i] for i in retry])):
                    if s == "ok" and v:
                        out[i] = buffer_handle(bytearray(v), 0, len(v))
            except KvpoolError as e:
                log.warning("batch_get_buffer: %s", e)
        return out

    def alloc_from_mem_pool(self, size: int) -> int:
        """After ``setup_dummy`` (Mooncake's standalone mode): the address of ``size`` bytes of
        memory shared with a same-host server (kvpool's ``alloc_buffer``; register it to move
        bytes zero-copy), alive until ``close``; 0 on failure. After ``setup``, 0, as Mooncake's
        (a real client has no memory pool)."""
        c = self._c()
        if c is None or not self._dummy or size <= 0:
            return 0
        try:
            buf = c.alloc_buffer(int(size))
        except KvpoolError as e:
            log.error("alloc_from_mem_pool(%d): %s", size, e)
            return 0
        self._mem_pool[buf.address] = buf
        return int(buf.address)

    # ---- byte ranges of values ----------------------------------------------------------

    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        all_keys: Sequence[Sequence[Key]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:
        """Byte ranges of values into registered buffers: for buffer ``i`` and its key ``j``,
        range ``k`` copies ``all_sizes[i][j][k]`` bytes from offset ``all_src_offsets[i][j][k]``
        of the value to ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``. One result per range, as
        Mooncake: the bytes copied, -704 for a missing key, -600 for a range past the value's
        end, lists of different lengths, or a destination outside the registered buffers.

        kvpool's server reads whole values: each call asks the sizes (one request, leasing the
        blocks as Mooncake's query does) and reads every value once for each set of
        non-overlapping ranges (one request for all), the bytes outside the ranges landing in
        scratch memory of the client's."""
        c = self._c()
        shape = [[[INVALID_PARAMS] * len(d) for d in (all_dst_offsets[i] if i < len(all_dst_offsets) else [])]
                 for i in range(len(buffer_ptrs))]
        if c is None or not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets)
                             == len(all_sizes)):
            return shape
        wanted: list[tuple[int, int, Key, list[Range]]] = []
        for i, base in enumerate(buffer_ptrs):
            keys, dsts, srcs, lens = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            if not (len(keys) == len(dsts) == len(srcs) == len(lens)):
                continue
            for j, key in enumerate(keys):
                if len(dsts[j]) != len(srcs[j]) or len(dsts[j]) != len(lens[j]):
                    continue
                wanted.append((i, j, key, [(int(base) + int(d), int(s), int(n))
                                           for d, s, n in zip(dsts[j], srcs[j], lens[j])]))
        if not wanted:
            return shape
        unique = list(dict.fromkeys(w[2] for w in wanted))
        try:
            sizes = dict(zip(unique, c.get_size(self._k(unique))))
        except KvpoolError as e:
            for i, j, _, _ in wanted:
                shape[i][j] = [_error_code(e)] * len(shape[i][j])
            return shape
        reqs = []
        for i, j, key, ranges in wanted:
            status, size = sizes[key]
            if status != "ok":
                shape[i][j] = [to_mooncake_code(status)] * len(ranges)
            else:
                reqs.append(((i, j), self._k([key])[0], int(size), ranges))
        for (i, j), codes in self._read_ranges(reqs).items():
            shape[i][j] = codes
        return shape

    def _read_ranges(self, reqs: list[tuple[Any, Key, int, list[Range]]]) -> dict[Any, list[int]]:
        """Ranged reads of values of known size: ``reqs`` of (tag, pool key, value size, ranges)
        -> tag -> one code per range (bytes read, or a negative code). One ``get_into_multi`` for
        all: each value is read whole once per set of ranges that do not overlap in the value, the
        destinations in between being scratch memory."""
        c = self._c()
        out: dict[Any, list[int]] = {}
        reads: list[tuple[Key, list[int], list[int], Any, list[Range], list[int]]] = []
        scratch_need = 0
        plans = []
        for tag, key, size, ranges in reqs:
            codes = [INVALID_PARAMS] * len(ranges)
            out[tag] = codes
            if any(s < 0 or n < 0 or s + n > size for _, s, n in ranges):
                continue  # as Mooncake: a range past the end fails the key's whole request
            groups: list[list[int]] = []
            ends: list[int] = []
            for k in sorted(range(len(ranges)), key=lambda k: ranges[k][1]):
                dst, src, n = ranges[k]
                if n == 0:
                    codes[k] = 0
                    continue
                for g, end in enumerate(ends):
                    if end <= src:
                        groups[g].append(k)
                        ends[g] = src + n
                        break
                else:
                    groups.append([k])
                    ends.append(src + n)
            for g in groups:
                gaps = size - sum(ranges[k][2] for k in g)
                plans.append((tag, key, size, ranges, g, gaps))
                scratch_need += gaps
        if not plans or c is None:
            return out
        scratch = self._take_scratch(scratch_need) if scratch_need else None
        if scratch_need and scratch is None:
            for tag, _, _, ranges, g, _ in plans:
                for k in g:
                    out[tag][k] = INTERNAL_ERROR
            return out
        at = scratch.address if scratch is not None else 0
        for tag, key, size, ranges, g, _ in plans:
            ptrs, lens, pos = [], [], 0
            for k in g:
                dst, src, n = ranges[k]
                if src > pos:
                    ptrs.append(at)
                    lens.append(src - pos)
                    at += src - pos
                ptrs.append(dst)
                lens.append(n)
                pos = src + n
            if pos < size:
                ptrs.append(at)
                lens.append(size - pos)
                at += size - pos
            reads.append((key, ptrs, lens, tag, ranges, g))
        try:
            got = c.get_into_multi([r[0] for r in reads], [r[1] for r in reads], [r[2] for r in reads])
        except KvpoolError as e:
            got = [(e.code, 0)] * len(reads)  # type: ignore[attr-defined]
        finally:
            if scratch is not None:
                self._give_scratch(scratch)
        for (_, _, lens, tag, ranges, g), (status, n) in zip(reads, got):
            # A value that changed size since its size was asked fills the destinations otherwise.
            code = read_code(status) if status != "ok" else INVALID_PARAMS
            for k in g:
                out[tag][k] = ranges[k][2] if status == "ok" and int(n) == sum(lens) else code
        return out

    def _take_scratch(self, n: int) -> Optional[SharedBuffer]:
        """Registered memory of at least ``n`` bytes for bytes a ranged read skips (each call its
        own, so the destinations of one request never overlap)."""
        with self._scratch_lock:
            for k, b in enumerate(self._scratch):
                if b.size >= n:
                    return self._scratch.pop(k)
        c = self._c()
        if c is None:
            return None
        try:
            b = c.alloc_buffer(max(n, 1 << 20))
            c.register(b.address, b.size)
            return b
        except KvpoolError as e:
            log.warning("ranged read: no scratch memory: %s", e)
            return None

    def _give_scratch(self, b: SharedBuffer) -> None:
        with self._scratch_lock:
            self._scratch.append(b)
            if len(self._scratch) > 4:  # keep the largest few
                self._scratch.sort(key=lambda x: x.size, reverse=True)
                drop = self._scratch[4:]
                del self._scratch[4:]
            else:
                drop = []
        c = self._c()
        for d in drop:
            if c is not None:
                try:
                    c.unregister(d.address)
                except KvpoolError:
                    pass
