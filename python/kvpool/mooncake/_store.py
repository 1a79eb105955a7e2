"""``MooncakeDistributedStore`` itself: see :mod:`kvpool.mooncake` for the conventions."""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Sequence
from typing import Any, Optional, Union

from kvpool import _mooncake_config as mooncake_config
from kvpool._native import Client, KvpoolError
from kvpool.mooncake._buffers import BufferMethods
from kvpool.mooncake._codes import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    OK,
    error_code as _error_code,
    first_error,
    held_elsewhere,
    put_code,
    replace_leased,
    to_mooncake_code,
)
from kvpool.mooncake._replica import ReplicaMethods
from kvpool.mooncake._sessions import SessionMethods
from kvpool.mooncake._tensor import TensorMethods
from kvpool.mooncake._tensor_par import ParallelismMethods
from kvpool.mooncake._tensor_tp import TensorParallelMethods
from kvpool.mooncake._types import ReplicateConfig, group_ids_fit, pin_of

log = logging.getLogger("kvpool.mooncake")

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]

Key = Union[str, bytes]


class MooncakeDistributedStore(
    SessionMethods, BufferMethods, ReplicaMethods, ParallelismMethods, TensorParallelMethods, TensorMethods
):
    """``mooncake.store.MooncakeDistributedStore`` on kvpool (see the module docs).

    Besides Mooncake's ``setup`` arguments, kvpool needs to know how to authenticate and trust
    the server: ``setup``'s keyword arguments (``api_key``, ``fingerprint``, ``ca_file``,
    ``data_dir``), the environment (``KVPOOL_API_KEY`` / ``KVPOOL_API_KEY_FILE``,
    ``KVPOOL_FINGERPRINT`` / ``KVPOOL_CA``, ``KVPOOL_DATA_DIR``, ``KVPOOL_SERVER``), or the same
    settings as ``kvpool_*`` fields of the Mooncake config (``setup``'s dict, the
    ``MOONCAKE_CONFIG_PATH`` file): ``kvpool_api_key``, ``kvpool_api_key_file``,
    ``kvpool_fingerprint``, ``kvpool_ca``, ``kvpool_data_dir``, ``kvpool_server``,
    ``kvpool_etcd``. The first of keyword, environment, dict, file wins.
    """

    def __init__(self) -> None:
        self._client: Optional[Client] = None
        self._ns = ""
        self._hostname = ""
        self._closed = False
        self._dummy = False
        self._endpoint = ""
        self._init_buffers()
        self._init_sessions()

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
        reads them. Sizes are binary as in Mooncake (``"4GB"`` is 4 GiB). Credentials: see the
        class docs (the ``MOONCAKE_CONFIG_PATH`` file's ``kvpool_*`` fields are read however
        ``setup`` is called, so vLLM's connector, which passes the file's fields positionally,
        finds them).

        Mapping (the server maps the same fields of that file the same way):
        ``master_server_addr``/``master_server_address`` -> the kvpool server address (QUIC);
        ``protocol`` ``tcp`` -> shared memory when the server is on this host, QUIC otherwise;
        ``quic``/``shm`` force one. ``local_hostname``, ``metadata_server``, ``rdma_devices``,
        ``engine``, ``global_segment_size`` and ``local_buffer_size`` are accepted and ignored (a
        kvpool client lends no memory to the pool).

        Returns 0; -600 for unusable arguments or settings, and when a credential is missing (the
        log names each missing setting and where it can be given); -1 (Mooncake's code when its
        master cannot be reached) when the server cannot be reached or refuses the key. Every
        failure is logged at ERROR on the ``kvpool.mooncake`` logger with the reason."""
        if isinstance(local_hostname, dict):
            cfg: dict[str, Any] = dict(local_hostname)
        elif local_hostname is None and not master_server_addr:
            try:
                cfg = mooncake_config.load()
            except (OSError, ValueError) as e:
                log.error("MooncakeDistributedStore.setup failed: %s", e)
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
        explicit = {"api_key": api_key, "fingerprint": fingerprint, "ca_file": ca_file, "data_dir": data_dir}
        return self._connect(cfg, explicit, tenant_id, timeout, None)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's standalone mode (SGLang's ``standalone_storage``): Mooncake connects to a
        ``mooncake_client`` process at ``server_address`` and shares ``mem_pool_size`` bytes of
        memory with it. A kvpool client talks to the pool's server itself: this connects as
        ``setup()`` with no arguments does (``MOONCAKE_CONFIG_PATH``, ``MOONCAKE_*``, the
        ``KVPOOL_*`` environment), and, when none of them names a server, to ``server_address`` as
        the kvpool server. Sizes are accepted and ignored; ``alloc_from_mem_pool`` then gives
        memory the server reads directly. Returns 0 or a code as ``setup``."""
        try:
            cfg = mooncake_config.load()
        except (OSError, ValueError) as e:
            log.error("MooncakeDistributedStore.setup_dummy failed: %s", e)
            return INVALID_PARAMS
        rc = self._connect(cfg, {}, None, 30.0, str(server_address or "") or None)
        self._dummy = rc == OK
        return rc

    def _connect(self, cfg: dict[str, Any], explicit: dict[str, Any], tenant_id: Optional[str], timeout: float,
                 fallback_server: Optional[str]) -> int:
        try:
            for k in ("global_segment_size", "local_buffer_size"):
                if cfg.get(k):
                    mooncake_config.parse_size(cfg[k])
            namespace = mooncake_config.tenant_namespace(tenant_id if tenant_id is not None else cfg.get("tenant_id"))
            settings = mooncake_config.ClientSettings(explicit, cfg, mooncake_config.load_file(), fallback_server)
        except (OSError, ValueError) as e:
            log.error("MooncakeDistributedStore.setup failed: %s", e)
            return INVALID_PARAMS
        missing = settings.missing()
        if missing:
            log.error("MooncakeDistributedStore.setup failed: kvpool needs %s", "; ".join(missing))
            return INVALID_PARAMS
        try:
            client = Client(
                settings.server,
                settings.api_key,
                fingerprint=settings.fingerprint,
                ca_file=settings.ca_file,
                data_dir=settings.data_dir,
                transport=mooncake_config.transport(cfg.get("protocol", "tcp")),
                timeout=timeout,
                client_name="kvpool-mooncake",
                etcd=settings.etcd,
                etcd_prefix=os.environ.get("KVPOOL_ETCD_PREFIX") or "/kvpool/",
            )
        except KvpoolError as e:
            code = e.code  # type: ignore[attr-defined]
            log.error("MooncakeDistributedStore.setup failed: cannot connect to the kvpool server %s: %s",
                      settings.describe(), e.args[0] if e.args else e)
            return INVALID_PARAMS if code == "invalid-argument" else INTERNAL_ERROR
        if self._client is not None:
            self._client.close()
        self._client = client
        self._ns = namespace
        self._hostname = cfg.get("local_hostname") if isinstance(cfg.get("local_hostname"), str) else ""
        self._endpoint = settings.server or settings.etcd or settings.data_dir or ""
        self._closed = False
        self._dummy = False
        return OK

    def _k(self, keys: Sequence[Key]) -> list[Key]:
        """Keys as the pool names them: inside the namespace of a Mooncake ``tenant_id``."""
        if not self._ns:
            return list(keys)
        ns = self._ns
        return [ns.encode() + k if isinstance(k, bytes) else ns + k for k in keys]

    def close(self) -> int:
        """Close the connection (ending open sessions and releasing their leases). Returns 0."""
        self._end_sessions()
        self._drop_buffers()
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
        return first_error(self._put(keys, values, False, config))

    def upsert_batch(self, keys: Sequence[Key], values: Sequence[Any], config: Any = None) -> int:
        """Insert or replace many values; 0 or the first item's error code."""
        return first_error(self._put(keys, values, True, config))

    def _put(self, keys: Sequence[Key], values: Sequence[Any], upsert: bool, config: Any) -> list[int]:
        c = self._c()
        if c is None:
            return [INTERNAL_ERROR] * len(keys)
        if len(keys) != len(values) or not group_ids_fit(config, len(keys)) or any(_nbytes(v) == 0 for v in values):
            return [INVALID_PARAMS] * len(keys)
        values = list(values)
        pin = pin_of(config)
        out = [OK] * len(keys)
        try:
            held = held_elsewhere(c, self._k(keys), upsert)
            live = [i for i, h in enumerate(held) if not h]
            if not live:
                return out
            lkeys = self._k([keys[i] for i in live])
            lvalues = [values[i] for i in live]
            st = c.put_batch(lkeys, lvalues, upsert, pin=pin)
            again = [j for j, s in enumerate(st) if upsert and s == "leased"]
            if again:
                st = replace_leased(c, [lkeys[j] for j in again], st, again,
                                    lambda ks: c.put_batch(ks, [lvalues[j] for j in again], True, pin=pin))
        except KvpoolError as e:
            return [_error_code(e)] * len(keys)
        for i, s in zip(live, st):
            out[i] = put_code(s)
        return out

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
