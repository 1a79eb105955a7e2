"""Mooncake's configuration as Mooncake reads it: ``mooncake_store_config.json`` (named by
``MOONCAKE_CONFIG_PATH``), or the ``MOONCAKE_*`` environment variables, sizes with binary units.

Shared by :mod:`kvpool.mooncake` (``MooncakeDistributedStore.setup``) and the vLLM connector, so
that a deployment configured for Mooncake means the same on kvpool.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Optional

log = logging.getLogger("kvpool.mooncake")

DEFAULT_TENANT = "default"

# Mooncake's suffixes (mooncake_config.py): every unit is binary, "GB" and "G" are 2^30.
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """A size as Mooncake reads it: an integer of bytes, or a number with a unit among ``B``,
    ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` (any case; all binary: ``"4GB"`` is
    4 * 2^30). kvpool's own ``KiB``/``MiB``/``GiB``/``TiB`` are accepted too (also binary)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", str(value), re.IGNORECASE)
    if not m or m.group(3).lower() == "i" or ("i" in m.group(3).lower() and not m.group(2)):
        raise ValueError(f"not a size: {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(value: Any) -> bool:
    """A boolean as Mooncake reads it from files and the environment."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    s = str(value).strip().lower()
    if s in ("", "false", "0", "no", "off", "disable"):
        return False
    if s in ("true", "1", "yes", "on", "enable"):
        return True
    raise ValueError(f"not a boolean: {value!r}")


def load() -> dict[str, Any]:
    """Mooncake's settings from ``MOONCAKE_CONFIG_PATH`` (a JSON file), else from the
    ``MOONCAKE_*`` environment variables when ``MOONCAKE_MASTER`` is set, else ``{}``.

    Keys as in the file: ``master_server_address``, ``protocol``, ``device_name``,
    ``tenant_id``, ``global_segment_size``, ``local_buffer_size``, ``metadata_server``,
    ``local_hostname``. Sizes are parsed (bytes)."""
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    cfg: dict[str, Any]
    if path:
        with open(path, encoding="utf-8") as f:
            cfg = dict(json.load(f))
        te = cfg.get("transfer_engine") or {}
        if "backend" in te and "protocol" not in cfg:
            cfg["protocol"] = te["backend"]
    elif os.environ.get("MOONCAKE_MASTER"):
        env = {
            "master_server_address": "MOONCAKE_MASTER",
            "protocol": "MOONCAKE_PROTOCOL",
            "device_name": "MOONCAKE_DEVICE",
            "tenant_id": "MOONCAKE_TENANT_ID",
            "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
            "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
            "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
            "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
        }
        cfg = {k: os.environ[v] for k, v in env.items() if os.environ.get(v) is not None}
    else:
        return {}
    for k in ("global_segment_size", "local_buffer_size"):
        if cfg.get(k) not in (None, ""):
            cfg[k] = parse_size(cfg[k])
    return cfg


def etcd_endpoints(metadata_server: Optional[str]) -> Optional[str]:
    """An address of Mooncake's that names etcd (``etcd://host:port[,host:port]``) -> kvpool's
    etcd endpoints; None for ``P2PHANDSHAKE``, Mooncake's HTTP metadata server (``http://...``)
    and plain addresses."""
    m = (metadata_server or "").strip()
    if not m.lower().startswith("etcd://"):
        return None
    hosts = [h.strip() for h in m[len("etcd://") :].split(",") if h.strip()]
    if not hosts:
        raise ValueError(f"metadata_server {metadata_server!r} names no etcd endpoint")
    return ",".join(f"http://{h}" for h in hosts)


def transport(protocol: Optional[str]) -> str:
    """Mooncake ``protocol`` -> kvpool transport. ``tcp`` serves remote and same-host clients
    alike, which in kvpool is QUIC plus shared memory on the same host; kvpool has no RDMA or
    NVLink path, so those fall back to the same choice (logged)."""
    p = (protocol or "tcp").strip().lower()
    if p in ("tcp", "auto", ""):
        return "auto"
    if p in ("quic", "shm"):
        return p
    log.warning("protocol %r is not available in kvpool; using QUIC (shared memory on the same host)", protocol)
    return "auto"


def tenant_namespace(tenant_id: Optional[str]) -> str:
    """The key prefix standing for Mooncake's ``tenant_id``: Mooncake tenants are separate key
    spaces, so every key of a non-default tenant is prefixed with ``tenant:<id>/`` inside the
    kvpool tenant of the API key (which, unlike Mooncake's, is an access boundary)."""
    t = (tenant_id or "").strip()
    if not t or t == DEFAULT_TENANT:
        return ""
    if "/" in t:
        raise ValueError(f"tenant_id {tenant_id!r} may not contain '/'")
    return f"tenant:{t}/"


def pool_address(server: Optional[str], metadata_server: Optional[str], etcd: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(server, etcd endpoints) to connect to. ``etcd`` (kvpool's own setting) wins; a
    ``master_server_address`` of ``etcd://...`` (Mooncake's HA masters) is etcd; else a plain
    server address; and without one, a ``metadata_server`` of ``etcd://...`` names the etcd where
    the cluster's leading master is found."""
    if etcd:
        return (None if server and server.lower().startswith("etcd://") else server), etcd
    from_server = etcd_endpoints(server)
    if from_server:
        return None, from_server
    if server:
        return server, None
    return None, etcd_endpoints(metadata_server)
