"""SGLang's HiCache storage on kvpool, natively: ``KVPoolHiCacheStorage`` implements SGLang's
``HiCacheStorage`` on the kvpool client, loaded by SGLang's ``dynamic`` backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
            "module_path": "kvpool.sglang", "class_name": "KVPoolHiCacheStorage",
            "kvpool_data_dir": "/var/lib/kvpool"}'

What it does beyond SGLang's Mooncake backend (which runs on kvpool too, through
``kvpool.mooncake_alias``):

- ``batch_exists`` (how many leading pages of a prefix are stored) is **one** request: kvpool's
  ``lookup`` of the chain, where Mooncake's backend asks ``batch_is_exist`` of every key of every
  rank and counts in Python.
- Pages are stored with their prefix links (each page names the one before it in its batch), so
  kvpool's prefix-aware eviction drops the leaves of a chain before its root.
- Page bytes move straight between SGLang's host pool and the pool (the host pool is registered
  with the client once: zero-copy through shared memory on the same host).

Keys: ``[kvpool_key_prefix][model@]<page key>@tp<rank>[@pp<rank>]`` for MHA (each rank holds its
own heads), ``[kvpool_key_prefix][model@]<page key>[@pp<rank>]`` for MLA (the latent cache is the
same on every rank: rank 0 writes it, every rank reads it). One object per page holds its K and V
of every layer of the rank (the host pool's ``get_page_buffer_meta`` pieces, in order).

Settings (``--hicache-storage-backend-extra-config``, else ``KVPOOL_*`` environment, else
``kvpool_*`` fields of the Mooncake config file ``MOONCAKE_CONFIG_PATH``): ``kvpool_server``,
``kvpool_api_key`` / ``kvpool_api_key_file``, ``kvpool_fingerprint`` / ``kvpool_ca``,
``kvpool_data_dir``, ``kvpool_key_prefix``, ``kvpool_transport``.

Layouts: SGLang's ``page_first`` and ``page_first_direct`` host pools (the page is contiguous per
rank); hybrid models' v2 pools (``batch_*_v2``) are not offered (SGLang then falls back or refuses,
as for any backend without them).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvpool import _mooncake_config as mooncake_config
from kvpool._native import Client, KvpoolError

log = logging.getLogger("kvpool.sglang")

__all__ = ["KVPoolHiCacheStorage"]

STORED = ("ok", "already-exists")


class KVPoolHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: Optional[HiCacheStorageConfig] = None, kwargs: Optional[dict[str, Any]] = None,
                 client: Optional[Client] = None) -> None:
        cfg = storage_config
        extra = dict(getattr(cfg, "extra_config", None) or {})
        self.tp_rank = int(getattr(cfg, "tp_rank", 0) or 0)
        self.pp_rank = int(getattr(cfg, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(cfg, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(cfg, "is_mla_model", False))
        model = getattr(cfg, "model_name", None)
        head = str(extra.get("kvpool_key_prefix") or "")
        self.prefix = head + (f"{'-'.join(str(model).split('/'))}@" if model else "")
        suffix = "" if self.is_mla else f"@tp{self.tp_rank}"
        self.suffix = suffix + (f"@pp{self.pp_rank}" if self.pp_size > 1 else "")
        # MLA: the latent cache is the same on every rank; one writer.
        self.writer = not self.is_mla or self.tp_rank == 0
        self.client = client if client is not None else mooncake_config.client_from_settings(extra, "kvpool-sglang")
        self.mem_pool_host: Any = None
        self._registered: Optional[int] = None

    # ---- host pool ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "layout", "page_first") not in ("page_first", "page_first_direct"):
            raise ValueError(f"KVPoolHiCacheStorage needs a page_first host pool, not {mem_pool_host.layout!r}")
        buf = mem_pool_host.kv_buffer
        if buf is not None:
            # Once: every page transfer then names ranges inside it (zero-copy on the same host).
            storage = buf.untyped_storage()
            self.client.register(storage.data_ptr(), storage.nbytes())
            self._registered = storage.data_ptr()

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}{self.suffix}"

    def _pieces(self, host_indices: torch.Tensor, n: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each page's pieces (K and V, or the MLA latent) as the host pool lays them out."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n if n else 0
        return ([list(ptrs[i * per : (i + 1) * per]) for i in range(n)],
                [list(sizes[i * per : (i + 1) * per]) for i in range(n)])

    # ---- v1: pages of the host pool ----------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages stored: one ``lookup`` of the chain."""
        if not keys:
            return 0
        try:
            return int(self.client.lookup([self._key(k) for k in keys]))
        except KvpoolError as e:
            log.warning("kvpool lookup of %d pages failed: %s", len(keys), e)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # rank 0 writes the MLA cache every rank shares
        ptrs, sizes = self._pieces(host_indices, len(keys))
        ks = [self._key(k) for k in keys]
        parents = [None, *ks[:-1]]
        page_tokens = int(getattr(self.mem_pool_host, "page_size", 0) or 0)
        try:
            st = self.client.put_from_multi(ks, ptrs, sizes, parents=parents,
                                            tokens=[page_tokens] * len(ks) if page_tokens else None)
        except KvpoolError as e:
            log.warning("kvpool put of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        return [s in STORED for s in st]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        if not keys:
            return []
        ptrs, sizes = self._pieces(host_indices, len(keys))
        try:
            got = self.client.get_into_multi([self._key(k) for k in keys], ptrs, sizes)
        except KvpoolError as e:
            log.warning("kvpool get of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        want = [sum(s) for s in sizes]
        ok = [st == "ok" and n == w for (st, n), w in zip(got, want)]
        # A page is used only when every page before it arrived (HiCache loads prefixes).
        first_bad = next((i for i, x in enumerate(ok) if not x), len(ok))
        return [i < first_bad for i in range(len(ok))]

    # ---- the tensor API (deprecated in SGLang, still abstract) -------------------------------

    def exists(self, key: str) -> bool:
        try:
            return bool(self.client.exists([self._key(key)])[0])
        except KvpoolError:
            return False

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0] if isinstance(out, list) else None

    def batch_get(self, keys: list[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> Any:
        try:
            got = self.client.get_batch([self._key(k) for k in keys])
        except KvpoolError as e:
            log.warning("kvpool get of %d keys failed: %s", len(keys), e)
            return [None] * len(keys)
        out: list[Optional[torch.Tensor]] = []
        for i, (st, val) in enumerate(got):
            if st != "ok" or val is None:
                out.append(None)
                continue
            raw = torch.frombuffer(bytearray(val), dtype=torch.uint8)
            dst = target_locations[i] if target_locations is not None else None
            if isinstance(dst, torch.Tensor) and dst.numel() * dst.element_size() == raw.numel():
                dst.view(-1).view(torch.uint8).copy_(raw)
                out.append(dst)
            else:
                out.append(raw)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or not self.writer:
            return values is not None
        data = [v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                else bytes(v) for v in values]
        try:
            st = self.client.put_batch([self._key(k) for k in keys], data)
        except KvpoolError as e:
            log.warning("kvpool put of %d keys failed: %s", len(keys), e)
            return False
        return all(s in STORED for s in st)

    def clear(self) -> None:
        """Drop this model's (and prefix's) pages of every rank."""
        try:
            self.client.remove_matching(self.prefix or None, force=True)
        except KvpoolError as e:
            log.warning("kvpool clear failed: %s", e)

    def close(self) -> None:
        if self._registered is not None:
            try:
                self.client.unregister(self._registered)
            except KvpoolError:
                pass
        self.client.close()
