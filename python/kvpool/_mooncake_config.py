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


def load_file() -> dict[str, Any]:
    """The fields of the JSON file ``MOONCAKE_CONFIG_PATH`` names (``{}`` when it is unset).
    ``OSError``/``ValueError`` name the file when it cannot be read or parsed."""
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise OSError(f"MOONCAKE_CONFIG_PATH={path}: {e.strerror or e}") from e
    except ValueError as e:
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path}: not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path}: not a JSON object")
    return cfg


def load() -> dict[str, Any]:
    """Mooncake's settings from ``MOONCAKE_CONFIG_PATH`` (a JSON file), else from the
    ``MOONCAKE_*`` environment variables when ``MOONCAKE_MASTER`` is set, else ``{}``.

    Keys as in the file: ``master_server_address``, ``protocol``, ``device_name``,
    ``tenant_id``, ``global_segment_size``, ``local_buffer_size``, ``metadata_server``,
    ``local_hostname`` (and kvpool's ``kvpool_*`` fields, see :data:`CLIENT_FIELDS`). Sizes are
    parsed (bytes)."""
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    cfg: dict[str, Any]
    if path:
        cfg = dict(load_file())
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


#: kvpool's own fields that a ``mooncake_store_config.json`` (or ``setup``'s dict) may carry for
#: the client, and the environment variable that overrides each. Mooncake ignores fields it does
#: not know; kvpool's server logs them as ignored.
CLIENT_FIELDS: dict[str, str] = {
    "kvpool_server": "KVPOOL_SERVER",
    "kvpool_api_key": "KVPOOL_API_KEY",
    "kvpool_api_key_file": "KVPOOL_API_KEY_FILE",
    "kvpool_fingerprint": "KVPOOL_FINGERPRINT",
    "kvpool_ca": "KVPOOL_CA",
    "kvpool_data_dir": "KVPOOL_DATA_DIR",
    "kvpool_etcd": "KVPOOL_ETCD",
}


class ClientSettings:
    """How a Mooncake-configured client reaches and trusts its kvpool server. Each value comes
    from the first of: ``setup``'s keyword argument, the ``KVPOOL_*`` environment variable, the
    ``kvpool_*`` field of ``setup``'s dict, the ``kvpool_*`` field of the ``MOONCAKE_CONFIG_PATH``
    file. The address falls back to Mooncake's ``master_server_addr[ess]`` (``MOONCAKE_MASTER``)
    and its ``metadata_server`` (``etcd://``). ``origin`` says where each value came from."""

    def __init__(self, explicit: dict[str, Any], cfg: dict[str, Any], file_cfg: dict[str, Any],
                 fallback_server: Optional[str] = None) -> None:
        self.origin: dict[str, str] = {}
        path = os.environ.get("MOONCAKE_CONFIG_PATH")

        def pick(field: str, kw: str) -> Optional[str]:
            env = CLIENT_FIELDS[field]
            for value, where in ((explicit.get(kw), f"setup({kw}=)"), (os.environ.get(env), env),
                                 (cfg.get(field), f"setup's {field}"), (file_cfg.get(field), f"{field} in {path}")):
                if value not in (None, ""):
                    self.origin[kw] = where
                    return str(value)
            return None

        self.data_dir = pick("kvpool_data_dir", "data_dir")
        self.api_key = pick("kvpool_api_key", "api_key")
        key_file = pick("kvpool_api_key_file", "api_key_file")
        if self.api_key is None and key_file:
            try:
                with open(key_file, encoding="utf-8") as f:
                    self.api_key = f.readline().strip() or None
            except OSError as e:
                raise OSError(f"API key file {key_file} (from {self.origin['api_key_file']}): {e.strerror or e}") from e
            self.origin["api_key"] = f"the file {key_file} (from {self.origin['api_key_file']})"
        self.fingerprint = pick("kvpool_fingerprint", "fingerprint")
        self.ca_file = pick("kvpool_ca", "ca_file")
        server = pick("kvpool_server", "server")
        if server is None:
            for value, where in ((cfg.get("master_server_addr"), "master_server_addr"),
                                 (cfg.get("master_server_address"), "master_server_address"),
                                 (fallback_server, "setup_dummy's server_address")):
                if value:
                    server, self.origin["server"] = str(value), where
                    break
        self.server, self.etcd = pool_address(server, cfg.get("metadata_server"), pick("kvpool_etcd", "etcd"))
        if self.etcd and "etcd" not in self.origin:
            self.origin["etcd"] = "master_server_address" if server and server.lower().startswith("etcd://") else "metadata_server"

    def missing(self) -> list[str]:
        """What is missing to connect, each with where it can be given (empty when complete)."""
        if self.data_dir:
            return []  # the data directory holds the address, the fingerprint and the key
        where = f"in {os.environ['MOONCAKE_CONFIG_PATH']}" if os.environ.get("MOONCAKE_CONFIG_PATH") else "in the Mooncake config"
        out = []
        if not self.server and not self.etcd:
            out.append("the kvpool server's address (master_server_address " + where + ", setup's "
                       "master_server_addr, MOONCAKE_MASTER, kvpool_server or KVPOOL_SERVER)")
        if not self.api_key:
            out.append("an API key (kvpool_api_key or kvpool_api_key_file " + where + ", or KVPOOL_API_KEY / "
                       "KVPOOL_API_KEY_FILE)")
        if not self.etcd and not self.fingerprint and not self.ca_file:
            out.append("the server certificate's SHA-256 fingerprint or a CA (kvpool_fingerprint or kvpool_ca "
                       + where + ", or KVPOOL_FINGERPRINT / KVPOOL_CA)")
        if out:
            out.append("or, on the server's host, its data directory (kvpool_data_dir " + where + " or KVPOOL_DATA_DIR) "
                       "instead of all of these")
        return out

    def describe(self) -> str:
        """The server this connects to, and where that came from (for error messages)."""
        if self.server:
            return f"{self.server} (from {self.origin.get('server', 'the data directory')})"
        if self.etcd:
            return f"the leader published in etcd {self.etcd} (from {self.origin.get('etcd')})"
        return f"the server of the data directory {self.data_dir} (from {self.origin.get('data_dir')})"


def client_from_settings(extra: dict[str, Any], client_name: str) -> Any:
    """A kvpool client for an integration configured by ``kvpool_*`` keys (``extra``), else the
    ``KVPOOL_*`` environment, else the ``kvpool_*`` fields of Mooncake's config file; raises
    ``ValueError`` naming what is missing."""
    from kvpool._native import Client

    explicit = {k.removeprefix("kvpool_"): v for k, v in extra.items() if k.startswith("kvpool_")}
    s = ClientSettings(
        {"data_dir": explicit.get("data_dir"), "api_key": explicit.get("api_key"),
         "api_key_file": explicit.get("api_key_file"), "fingerprint": explicit.get("fingerprint"),
         "ca_file": explicit.get("ca"), "server": explicit.get("server"), "etcd": explicit.get("etcd")},
        {}, load_file(),
    )
    missing = s.missing()
    if missing:
        raise ValueError(f"{client_name} cannot reach the pool; missing: " + "; ".join(missing))
    return Client(s.server, s.api_key, fingerprint=s.fingerprint, ca_file=s.ca_file, data_dir=s.data_dir,
                  transport=str(extra.get("kvpool_transport") or os.environ.get("KVPOOL_TRANSPORT") or "auto"),
                  client_name=client_name, etcd=s.etcd)
