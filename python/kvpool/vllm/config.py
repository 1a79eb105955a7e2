"""The connector's settings: ``kv_connector_extra_config``, then the environment, then Mooncake's
own configuration (``MOONCAKE_CONFIG_PATH`` or ``MOONCAKE_*``), so that a deployment set up for
vLLM's Mooncake store connector works unchanged where kvpool can honour it, and is refused with a
message where it cannot.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from kvpool import _mooncake_config as mooncake
from kvpool._native import Client

log = logging.getLogger("kvpool.vllm")

# Keys of kv_connector_extra_config this connector reads (kvpool's and Mooncake's).
KNOWN = {
    "kvpool_server", "kvpool_etcd", "kvpool_etcd_prefix", "kvpool_api_key", "kvpool_api_key_file", "kvpool_fingerprint", "kvpool_ca",
    "kvpool_data_dir", "kvpool_transport", "kvpool_bulk", "kvpool_trusted_networks", "kvpool_timeout_s", "kvpool_lookup_lease_s",
    "kvpool_lookup_deadline_ms", "kvpool_dead_after_s", "kvpool_node_answer_ms",
    "kvpool_staging", "kvpool_staging_bytes", "kvpool_load_failure_policy", "kvpool_full_backoff_s",
    "kvpool_key_format", "kvpool_load_threads", "kvpool_save_pin_limit", "kvpool_event_medium",
    "kv_load_failure_policy", "kvpool_device_staging_bytes",
    "store_threshold",
    "key_prefix", "model_name", "async_save", "stats_path",
    # vLLM's Mooncake store connector's names.
    "cache_prefix", "load_async", "lookup_async", "enable_lookup", "save_decode_cache",
    "preferred_segment", "tenant_id",
}


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    try:
        return mooncake.parse_bool(v)
    except ValueError:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a boolean, not {v!r}") from None


@dataclass
class ConnectorConfig:
    """Everything the scheduler and worker sides read from the configuration."""

    server: Optional[str] = None
    etcd: Optional[str] = None
    etcd_prefix: str = "/kvpool/"
    api_key: Optional[str] = None
    fingerprint: Optional[str] = None
    ca: Optional[str] = None
    data_dir: Optional[str] = None
    transport: str = "auto"
    bulk: str = "auto"
    trusted_networks: list[str] = field(default_factory=list)
    timeout_s: float = 30.0
    key_prefix: str = ""
    namespace: str = ""
    model_name: Optional[str] = None
    store_threshold: int = 0
    async_save: bool = True
    stats_path: Optional[str] = None
    lookup_lease_s: float = 10.0
    enable_lookup: bool = True
    lookup_async: bool = False
    load_async: bool = True
    save_decode_cache: bool = False
    staging: str = "auto"
    staging_bytes: int = 256 << 20
    device_staging_bytes: int = 64 << 20
    load_failure_policy: str = "recompute"
    policy_given: bool = False  # the policy was named in kv_connector_extra_config
    full_backoff_s: float = 1.0
    lookup_deadline_s: float = 0.05
    dead_after_s: float = 1.0
    node_answer_s: float = 0.06
    key_format: str = "kvpool"
    load_threads: int = 4
    save_pin_limit: Optional[int] = None  # None: a quarter of vLLM's KV blocks
    event_medium: Optional[str] = None  # None: vLLM's MEDIUM_CPU
    ignored: list[str] = field(default_factory=list)

    @staticmethod
    def from_extra(extra: dict[str, Any]) -> "ConnectorConfig":
        """Read ``kv_connector_extra_config``; raise ``ValueError`` for settings kvpool refuses."""
        c = ConnectorConfig()
        mc = mooncake.load()
        # kvpool's own fields in Mooncake's config file (as kvpool.mooncake reads them).
        mf = mooncake.load_file()
        env = os.environ.get
        c.server = (extra.get("kvpool_server") or env("KVPOOL_SERVER") or mf.get("kvpool_server")
                    or mc.get("master_server_address") or None)
        # A cluster's leading master found in etcd (then kvpool_server is not needed).
        c.server, c.etcd = mooncake.pool_address(
            c.server, mc.get("metadata_server"), extra.get("kvpool_etcd") or env("KVPOOL_ETCD") or mf.get("kvpool_etcd")
        )
        c.etcd_prefix = str(extra.get("kvpool_etcd_prefix") or env("KVPOOL_ETCD_PREFIX") or "/kvpool/")
        c.api_key = extra.get("kvpool_api_key") or env("KVPOOL_API_KEY") or mf.get("kvpool_api_key")
        key_file = extra.get("kvpool_api_key_file") or env("KVPOOL_API_KEY_FILE") or mf.get("kvpool_api_key_file")
        if c.api_key is None and key_file:
            with open(key_file, encoding="utf-8") as f:
                c.api_key = f.readline().strip()
        c.fingerprint = extra.get("kvpool_fingerprint") or env("KVPOOL_FINGERPRINT") or mf.get("kvpool_fingerprint")
        c.ca = extra.get("kvpool_ca") or env("KVPOOL_CA") or mf.get("kvpool_ca")
        c.data_dir = extra.get("kvpool_data_dir") or env("KVPOOL_DATA_DIR") or mf.get("kvpool_data_dir")
        c.transport = str(extra.get("kvpool_transport") or mooncake.transport(mc.get("protocol")))
        if c.transport not in ("auto", "quic", "shm"):
            raise ValueError(f"kvpool_transport must be auto, quic or shm, not {c.transport!r}")
        c.bulk = str(extra.get("kvpool_bulk") or env("KVPOOL_BULK") or "auto")
        if c.bulk not in ("auto", "quic", "tcp"):
            raise ValueError(f"kvpool_bulk must be auto, quic or tcp, not {c.bulk!r}")
        nets = extra.get("kvpool_trusted_networks") or env("KVPOOL_TRUSTED_NETWORKS") or []
        c.trusted_networks = [n.strip() for n in (nets.split(",") if isinstance(nets, str) else nets) if n.strip()]
        c.timeout_s = float(extra.get("kvpool_timeout_s", 30.0))
        if mc.get("device_name"):
            log.info("Mooncake device_name %r has no meaning in kvpool (no RDMA devices); ignored",
                     mc["device_name"])
        # Names: kvpool's key_prefix is Mooncake's cache_prefix.
        prefixes = {str(extra[k]) for k in ("key_prefix", "cache_prefix") if extra.get(k)}
        if len(prefixes) > 1:
            raise ValueError(f"key_prefix and cache_prefix name different prefixes: {sorted(prefixes)}")
        c.key_prefix = prefixes.pop() if prefixes else ""
        c.namespace = mooncake.tenant_namespace(extra.get("tenant_id") or mc.get("tenant_id"))
        c.model_name = extra.get("model_name")
        c.store_threshold = int(extra.get("store_threshold", 0))
        c.async_save = _flag(extra, "async_save", True)
        c.stats_path = extra.get("stats_path")
        c.lookup_lease_s = float(extra.get("kvpool_lookup_lease_s", 10.0))
        if not 0 < c.lookup_lease_s <= 60:
            raise ValueError("kvpool_lookup_lease_s must be in (0, 60] seconds")
        c.enable_lookup = _flag(extra, "enable_lookup", True)
        c.lookup_async = _flag(extra, "lookup_async", False)
        c.save_decode_cache = _flag(extra, "save_decode_cache", False)
        c.load_async = _flag(extra, "load_async", True)
        if extra.get("preferred_segment"):
            raise ValueError(
                "preferred_segment: kvpool has no per-engine segments to prefer; the server's "
                "placement policy chooses where blocks go (remove preferred_segment)"
            )
        c.staging = str(extra.get("kvpool_staging", "auto"))
        if c.staging not in ("auto", "always"):
            raise ValueError(f"kvpool_staging must be auto or always, not {c.staging!r}")
        c.staging_bytes = mooncake.parse_size(extra.get("kvpool_staging_bytes", 256 << 20))
        c.device_staging_bytes = mooncake.parse_size(extra.get("kvpool_device_staging_bytes", 64 << 20))
        policies = {str(extra[k]) for k in ("kvpool_load_failure_policy", "kv_load_failure_policy") if k in extra}
        if len(policies) > 1:
            raise ValueError(f"kvpool_load_failure_policy and kv_load_failure_policy disagree: {sorted(policies)}")
        c.policy_given = bool(policies)
        c.load_failure_policy = policies.pop() if policies else "recompute"
        if c.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kvpool_load_failure_policy must be recompute or fail")
        c.lookup_deadline_s = float(extra.get("kvpool_lookup_deadline_ms", 50)) / 1e3
        if not 0 < c.lookup_deadline_s <= 60:
            raise ValueError("kvpool_lookup_deadline_ms must be in (0, 60000]")
        c.dead_after_s = float(extra.get("kvpool_dead_after_s", 1.0))
        if not 0.1 <= c.dead_after_s <= 3600:
            raise ValueError("kvpool_dead_after_s must be in [0.1, 3600]")
        c.node_answer_s = float(extra.get("kvpool_node_answer_ms", 60)) / 1e3
        if not 0.01 <= c.node_answer_s <= 3600:
            raise ValueError("kvpool_node_answer_ms must be in [10, 3600000]")
        c.full_backoff_s = float(extra.get("kvpool_full_backoff_s", 1.0))
        if c.full_backoff_s < 0:
            raise ValueError("kvpool_full_backoff_s must not be negative")
        c.key_format = str(extra.get("kvpool_key_format", "kvpool"))
        if c.key_format not in ("kvpool", "mooncake"):
            raise ValueError(f"kvpool_key_format must be kvpool or mooncake, not {c.key_format!r}")
        c.load_threads = int(extra.get("kvpool_load_threads", 4))
        if not 1 <= c.load_threads <= 64:
            raise ValueError("kvpool_load_threads must be in [1, 64]")
        if extra.get("kvpool_save_pin_limit") is not None:
            c.save_pin_limit = int(extra["kvpool_save_pin_limit"])
            if c.save_pin_limit < 0:
                raise ValueError("kvpool_save_pin_limit must not be negative")
        c.event_medium = extra.get("kvpool_event_medium") or None
        c.ignored = sorted(set(extra) - KNOWN)
        if c.ignored:
            log.warning("kv_connector_extra_config keys kvpool does not know (ignored): %s", c.ignored)
        return c

    def client(self, name: str) -> Client:
        """A kvpool client for one side of the connector."""
        return Client(
            self.server,
            self.api_key,
            fingerprint=self.fingerprint,
            ca_file=self.ca,
            data_dir=self.data_dir,
            transport=self.transport,
            bulk=self.bulk,
            trusted_networks=self.trusted_networks,
            timeout=self.timeout_s,
            client_name=name,
            dead_after=self.dead_after_s,
            node_answer_within=self.node_answer_s,
            etcd=self.etcd,
            etcd_prefix=self.etcd_prefix,
        )


def command_line_failure_policy(argv: Optional[list[str]] = None) -> Optional[str]:
    """vLLM's ``kv_load_failure_policy`` as ``vllm serve``'s command line set it
    (``--kv-transfer-config '{..."kv_load_failure_policy": "fail"...}'`` or
    ``--kv-transfer-config.kv_load_failure_policy fail``), None when the command line does not
    say. vLLM keeps no record of whether a config field was given, and its default is ``fail``:
    the command line (which vLLM's engine processes inherit) is the one place a user's explicit
    choice can be seen."""
    args = list(sys.argv if argv is None else argv)
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name not in ("--kv-transfer-config", "--kv_transfer_config",
                        "--kv-transfer-config.kv_load_failure_policy", "--kv_transfer_config.kv_load_failure_policy"):
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if name.endswith("kv_load_failure_policy"):
            return value or None
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, dict) and parsed.get("kv_load_failure_policy"):
            return str(parsed["kv_load_failure_policy"])
    return None
