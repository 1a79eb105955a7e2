"""``MooncakeDistributedStore`` itself: see :mod:`kvpool.mooncake` for the conventions."""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Sequence
from typing import Any, Optional, Union

from kvpool import _mooncake_config as mooncake_config
from kvpool.mooncake._tensor import TensorMethods
from kvpool._native import Client, KvpoolError, SharedBuffer

log = logging.getLogger("kvpool.mooncake")

Key = Union[str, bytes]

OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
INVALID_READ = -701
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900

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
    "timeout": RPC_FAIL,
    "unavailable": RPC_FAIL,
    "closed": RPC_FAIL,
    "shutting-down": RPC_FAIL,
    "unauthorized": RPC_FAIL,
}


def to_mooncake_code(code: str) -> int:
    """Mooncake's error code for a kvpool status name (see the module's table)."""
    return _CODES.get(code, INTERNAL_ERROR)


def _error_code(e: KvpoolError) -> int:
    return to_mooncake_code(e.code)  # type: ignore[attr-defined]


def _pin(config: Any) -> Optional[str]:
    """A Mooncake ``ReplicateConfig`` (or anything with its attributes) -> kvpool pin."""
    if config is None:
        return None
    if getattr(config, "with_hard_pin", False):
        return "hard"
    if getattr(config, "with_soft_pin", False):
        return "soft"
    return None


class ReplicateConfig:
    """Mooncake's put options. kvpool is single-node: ``replica_num`` and the segment preferences
    are accepted and ignored; ``with_soft_pin`` and ``with_hard_pin`` pin the block."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False


class MooncakeDistributedStore(TensorMethods):
    """``mooncake.store.MooncakeDistributedStore`` on kvpool (see the module docs).

    Besides Mooncake's ``setup`` arguments, kvpool needs to know how to authenticate and trust
    the server. ``setup`` takes them as keyword arguments (``api_key``, ``fingerprint``,
    ``ca_file``, ``data_dir``) or from the environment: ``KVPOOL_DATA_DIR`` (a local server's data
    directory: address, certificate fingerprint and API key), or ``KVPOOL_API_KEY`` /
    ``KVPOOL_API_KEY_FILE`` with ``KVPOOL_FINGERPRINT`` or ``KVPOOL_CA``; ``KVPOOL_SERVER``
    overrides the address.
    """

    def __init__(self) -> None:
        self._client: Optional[Client] = None
        self._ns = ""
        self._hostname = ""
        self._closed = False

    # ---- life cycle -------------------------------------------------------------------

    def setup(
        self,
        local_hostname: Union[str, dict[str, Any], None] = None,
        metadata_server: str = "",
        global_segment_size: int = 0,
        local_buffer_size: int = 0,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "",
        engine: Any = None,
        *,
        api_key: Optional[str] = None,
        fingerprint: Optional[str] = None,
        ca_file: Optional[str] = None,
        data_dir: Optional[str] = None,
        timeout: float = 30.0,
        tenant_id: Optional[str] = None,
        **unused: Any,
    ) -> int:
        """Connect. Accepts Mooncake's positional arguments, or one config dict (Mooncake's second
        overload), or nothing: then ``MOONCAKE_CONFIG_PATH`` names a ``mooncake_store_config.json``,
        or, without it, ``MOONCAKE_MASTER``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
        ``MOONCAKE_TENANT_ID`` (and Mooncake's other ``MOONCAKE_*`` variables) are read as Mooncake
        reads them. Sizes are binary as in Mooncake (``"4GB"`` is 4 GiB).

        Mapping (the server maps the same fields of that file the same way):
        ``master_server_addr``/``master_server_address`` -> the kvpool server address (QUIC);
        ``protocol`` ``tcp`` -> shared memory when the server is on this host, QUIC otherwise;
        ``quic``/``shm`` force one. ``local_hostname``, ``metadata_server``, ``rdma_devices``,
        ``engine``, ``global_segment_size`` and ``local_buffer_size`` are accepted and ignored (a
        kvpool client lends no memory to the pool). Returns 0, or -600 for unusable arguments,
        -900 when the server cannot be reached or refuses the key.
        """
        if isinstance(local_hostname, dict):
            cfg: dict[str, Any] = dict(local_hostname)
        elif local_hostname is None and not master_server_addr:
            try:
                cfg = mooncake_config.load()
            except (OSError, ValueError) as e:
                log.error("setup: %s", e)
                return INVALID_PARAMS
        else:
            cfg = {
                "local_hostname": local_hostname,
                "metadata_server": metadata_server,
                "global_segment_size": global_segment_size,
                "local_buffer_size": local_buffer_size,
                "protocol": protocol,
                "rdma_devices": rdma_devices,
                "master_server_addr": master_server_addr,
            }
        if unused:
            log.debug("setup: ignoring %s", sorted(unused))
        try:
            for k in ("global_segment_size", "local_buffer_size"):
                if cfg.get(k):
                    mooncake_config.parse_size(cfg[k])
            namespace = mooncake_config.tenant_namespace(tenant_id if tenant_id is not None else cfg.get("tenant_id"))
        except ValueError as e:
            log.error("setup: %s", e)
            return INVALID_PARAMS
        server = cfg.get("master_server_addr") or cfg.get("master_server_address") or None
        server = os.environ.get("KVPOOL_SERVER") or server
        try:
            server, etcd = mooncake_config.pool_address(server, cfg.get("metadata_server"), os.environ.get("KVPOOL_ETCD"))
        except ValueError as e:
            log.error("setup: %s", e)
            return INVALID_PARAMS
        data_dir = data_dir or os.environ.get("KVPOOL_DATA_DIR")
        api_key = api_key or os.environ.get("KVPOOL_API_KEY")
        key_file = os.environ.get("KVPOOL_API_KEY_FILE")
        if api_key is None and key_file:
            with open(key_file, encoding="utf-8") as f:
                api_key = f.readline().strip()
        fingerprint = fingerprint or os.environ.get("KVPOOL_FINGERPRINT")
        ca_file = ca_file or os.environ.get("KVPOOL_CA")
        try:
            client = Client(
                server,
                api_key,
                fingerprint=fingerprint,
                ca_file=ca_file,
                data_dir=data_dir,
                transport=mooncake_config.transport(cfg.get("protocol", "tcp")),
                timeout=timeout,
                client_name="kvpool-mooncake",
                etcd=etcd,
                etcd_prefix=os.environ.get("KVPOOL_ETCD_PREFIX") or "/kvpool/",
            )
        except KvpoolError as e:
            log.error("setup: %s", e)
            return INVALID_PARAMS if e.code == "invalid-argument" else RPC_FAIL  # type: ignore[attr-defined]
        if self._client is not None:
            self._client.close()
        self._client = client
        self._ns = namespace
        self._hostname = cfg.get("local_hostname") if isinstance(cfg.get("local_hostname"), str) else ""
        self._closed = False
        return OK

    def _k(self, keys: Sequence[Key]) -> list[Key]:
        """Keys as the pool names them: inside the namespace of a Mooncake ``tenant_id``."""
        if not self._ns:
            return list(keys)
        ns = self._ns
        return [ns.encode() + k if isinstance(k, bytes) else ns + k for k in keys]

    def close(self) -> int:
        """Close the connection. Returns 0."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._closed = True
        return OK

    def health_check(self) -> int:
        """0 when the server answers a ping, 1 when not set up or closed, 2 when unreachable."""
        if self._client is None:
            return 1
        try:
            self._client.ping()
            return 0
        except KvpoolError:
            return 2

    @property
    def client(self) -> Client:
        """The kvpool client underneath (kvpool's own API: ``stats``, ``lookup``, ...)."""
        if self._client is None:
            raise RuntimeError("MooncakeDistributedStore.setup() has not succeeded")
        return self._client

    def _c(self) -> Optional[Client]:
        return self._client

    # ---- bytes in, bytes out ----------------------------------------------------------

    def put(self, key: Key, value: Any, config: Any = None) -> int:
        """Store ``value`` (bytes or any buffer). As Mooncake: a key that exists answers 0 and keeps
        its first value (use ``upsert`` to replace); an empty value answers -600."""
        return self._put([key], [value], False, config)[0]

    def upsert(self, key: Key, value: Any, config: Any = None) -> int:
        """Insert or replace, also a value that a read has just leased (as Mooncake)."""
        return self._put([key], [value], True, config)[0]

    def put_batch(self, keys: Sequence[Key], values: Sequence[Any], config: Any = None) -> int:
        """Store many values in one request. Returns 0 when every item was stored (or existed),
        else the first item's error code (as Mooncake's ``put_batch``); an empty value fails the
        whole batch with -600 before anything is stored."""
        return _first_error(self._put(keys, values, False, config))

    def upsert_batch(self, keys: Sequence[Key], values: Sequence[Any], config: Any = None) -> int:
        """Insert or replace many values; 0 or the first item's error code."""
        return _first_error(self._put(keys, values, True, config))

    def _put(self, keys: Sequence[Key], values: Sequence[Any], upsert: bool, config: Any) -> list[int]:
        c = self._c()
        if c is None:
            return [INTERNAL_ERROR] * len(keys)
        if len(keys) != len(values) or any(_nbytes(v) == 0 for v in values):
            return [INVALID_PARAMS] * len(keys)
        values = list(values)
        pin = _pin(config)
        try:
            held = _held_elsewhere(c, self._k(keys), upsert)
            if any(held):
                live = [i for i, h in enumerate(held) if not h]
                codes = self._put([keys[i] for i in live], [values[i] for i in live], upsert, config) if live else []
                out = [OK] * len(keys)
                for i, code in zip(live, codes):
                    out[i] = code
                return out
            st = c.put_batch(self._k(keys), values, upsert, pin=pin)
            again = [i for i, s in enumerate(st) if upsert and s == "leased"]
            if again:
                st = _replace_leased(c, [self._k(keys)[i] for i in again], st, again,
                                     lambda ks: c.put_batch(ks, [values[i] for i in again], True, pin=pin))
        except KvpoolError as e:
            return [_error_code(e)] * len(keys)
        return [_put_code(s) for s in st]

    def put_parts(self, key: Key, *parts: Any, config: Any = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like objects) as one value, as
        Mooncake; a key that exists answers 0 and keeps its value. No bytes at all answer -600
        (Mooncake answers 0 and stores nothing)."""
        return self._put([key], [_join_parts(parts)], False, config)[0]

    def upsert_parts(self, key: Key, *parts: Any, config: Any = None) -> int:
        """``put_parts`` that replaces an existing value."""
        return self._put([key], [_join_parts(parts)], True, config)[0]

    def get(self, key: Key) -> bytes:
        """The value, or ``b''`` when the key is missing (or on any error, as Mooncake)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[Key]) -> list[bytes]:
        """Values of many keys in one request; ``b''`` for each missing one."""
        c = self._c()
        if c is None:
            return [b""] * len(keys)
        try:
            return [v if (s == "ok" and v is not None) else b"" for s, v in c.get_batch(self._k(keys))]
        except KvpoolError as e:
            log.warning("get_batch: %s", e)
            return [b""] * len(keys)

    def get_size(self, key: Key) -> int:
        """Size in bytes of the stored value, or -704. Like a read (and like Mooncake's, which asks
        for the replica list), it leases the block: a ``remove`` right after needs ``force``."""
        c = self._c()
        if c is None:
            return INTERNAL_ERROR
        try:
            status, size = c.get_size(self._k([key]))[0]
        except KvpoolError as e:
            return _error_code(e)
        return int(size) if status == "ok" else to_mooncake_code(status)

    # ---- presence and removal ---------------------------------------------------------

    def is_exist(self, key: Key) -> int:
        """1 if stored, 0 if not, -1 on error. Never grants or renews a lease (Mooncake's does)."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[Key]) -> list[int]:
        """1/0/-1 per key, in one request. Never grants or renews leases."""
        c = self._c()
        if c is None:
            return [-1] * len(keys)
        try:
            return [1 if p else 0 for p in c.exists(self._k(keys))]
        except KvpoolError:
            return [-1] * len(keys)

    def lookup(self, keys: Sequence[Key]) -> int:
        """kvpool's own: how many leading keys of the prefix chain ``keys`` (root first) are
        resident, in one request; no lease, no recency update. Negative code on error."""
        c = self._c()
        if c is None:
            return INTERNAL_ERROR
        try:
            return int(c.lookup(self._k(keys)))
        except KvpoolError as e:
            return _error_code(e)

    def remove(self, key: Key, force: bool = False) -> int:
        """0, -704 when missing, -706 when leased (unless ``force``)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[Key], force: bool = False) -> list[int]:
        """One code per key (0, -704, -706)."""
        c = self._c()
        if c is None:
            return [INTERNAL_ERROR] * len(keys)
        try:
            return [to_mooncake_code(s) for s in c.remove(self._k(keys), force)]
        except KvpoolError as e:
            return [_error_code(e)] * len(keys)

    def remove_all(self, force: bool = False) -> int:
        """Remove every block of this tenant (of the Mooncake ``tenant_id`` given to ``setup``,
        when not ``default``); returns how many were removed (leased blocks are kept unless
        ``force``), or a negative code."""
        c = self._c()
        if c is None:
            return INTERNAL_ERROR
        try:
            removed, _kept = c.remove_matching(self._ns, None, force) if self._ns else c.remove_all(force)
            return int(removed)
        except KvpoolError as e:
            return _error_code(e)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key that ``regex_pattern`` matches anywhere in (as Mooncake, a search, not
        a whole-key match); returns how many were removed (leased keys are kept unless
        ``force``), -600 for a pattern that does not compile. The pattern is Rust regex syntax,
        which shares Mooncake's ECMAScript syntax except look-around and backreferences (-600).
        Under a ``tenant_id``, ``^`` anchors at the start of the tenant's key."""
        if not isinstance(regex_pattern, str):
            raise TypeError(f"regex_pattern must be str, not {type(regex_pattern).__name__}")
        c = self._c()
        if c is None:
            return INTERNAL_ERROR
        pattern = regex_pattern
        if self._ns and pattern.startswith("^"):
            pattern = "^" + re.escape(self._ns) + pattern[1:]
        try:
            removed, _kept = c.remove_matching(self._ns or None, pattern, force)
            return int(removed)
        except KvpoolError as e:
            return _error_code(e)

    def get_hostname(self) -> str:
        """The ``local_hostname`` given to ``setup`` (this host's name without one). Mooncake
        appends its transfer engine's port; a kvpool client listens on no port."""
        return self._hostname or socket.gethostname()

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
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            return [INVALID_PARAMS] * len(keys)
        # As Mooncake's batch forms: an empty item answers -600, the others are stored.
        live = [i for i, sz in enumerate(sizes) if sum(sz) > 0]
        out = [INVALID_PARAMS] * len(keys)
        if not live:
            return out
        try:
            held = _held_elsewhere(c, self._k([keys[i] for i in live]), upsert)
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
        pin = _pin(config)
        try:
            st = c.put_from_multi(lkeys, ptrs, sizes, upsert, pin=pin)
            again = [j for j, s in enumerate(st) if upsert and s == "leased"]
            if again:
                st = _replace_leased(c, [lkeys[j] for j in again], st, again, lambda ks: c.put_from_multi(
                    ks, [ptrs[j] for j in again], [sizes[j] for j in again], True, pin=pin))
        except KvpoolError as e:
            return [_error_code(e) if i in live else INVALID_PARAMS for i in range(len(keys))]
        for i, s in zip(live, st):
            out[i] = _put_code(s)
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
        return [int(n) if s == "ok" else INVALID_PARAMS if s == "value-too-large" else to_mooncake_code(s)
                for s, n in got]


def _join_parts(parts: Sequence[Any]) -> bytes:
    """The parts of ``put_parts`` as one value; Mooncake's error for parts that are not 1-D
    bytes-like (``RuntimeError``, as its binding raises)."""
    views = []
    for p in parts:
        v = memoryview(p)  # TypeError for a non-buffer, as pybind11
        if v.ndim != 1 or v.itemsize != 1:
            raise RuntimeError("parts must be 1-D bytes-like")
        views.append(v)
    return b"".join(views)


def _nbytes(value: Any) -> int:
    """Size of a bytes-like value; -1 (not empty) when it has no size, so the binding reports
    the type error."""
    try:
        return memoryview(value).nbytes
    except TypeError:
        return -1


def _held_elsewhere(c: Client, keys: list[Key], upsert: bool) -> list[bool]:
    """On a cluster, which keys of a put (not an upsert) are already stored. The master places a
    put on a node without asking whether another node holds the key, so a second put would store
    a second copy that reads may prefer; Mooncake keeps the first value, so these keys are not
    sent (answering 0). Not atomic: two puts racing can still both store. One server refuses
    the second put by itself (no extra request)."""
    if upsert or not c.cluster:
        return [False] * len(keys)
    return [bool(p) for p in c.exists(keys)]


def _put_code(status: str) -> int:
    """A put's code. Mooncake's put of a key that exists succeeds and keeps the first value,
    which is what kvpool does; only the code differs."""
    return OK if status == "already-exists" else to_mooncake_code(status)


def _replace_leased(c: Client, keys: list[Key], st: list[str], idx: list[int], retry: Any) -> list[str]:
    """Upsert of values that reads have leased: Mooncake replaces them, so drop the leased blocks
    (force) and store again. kvpool blocks are immutable, so this is not atomic: a read in between
    misses the key."""
    c.remove(keys, True)
    st = list(st)
    for i, s in zip(idx, retry(keys)):
        st[i] = s
    return st


def _first_error(codes: list[int]) -> int:
    return next((c for c in codes if c != OK), OK)
