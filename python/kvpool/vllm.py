"""vLLM KV connector backed by kvpool (``KVConnectorBase_V1``, vLLM 0.32).

Select it with::

    KVTransferConfig(
        kv_connector="KVPoolConnector",
        kv_connector_module_path="kvpool.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvpool_data_dir": "/var/lib/kvpool"},   # or server + key + fingerprint
    )

``kv_connector_extra_config`` keys (all optional except a way to reach the server):

=====================  ====================================================================
``kvpool_server``      ``host:port`` of the pool (QUIC)
``kvpool_api_key``     API key (or ``kvpool_api_key_file``)
``kvpool_fingerprint`` SHA-256 of the server certificate (or ``kvpool_ca`` PEM file)
``kvpool_data_dir``    a local server's data directory (address, fingerprint and key in one)
``kvpool_transport``   ``auto`` (default: shared memory on the same host, QUIC otherwise),
                       ``quic`` or ``shm``
``store_threshold``    save only blocks whose prefix length (tokens) is at least this
                       (the server's admission policy applies the same rule)
``key_prefix``         namespace prepended to every key (separate deployments, one pool)
``model_name``         model part of the keys (default: the model path vLLM was given)
``async_save``         default True: saves run on a background thread and the request's blocks
                       are freed when the save is done; False saves inside ``wait_for_save``
``stats_path``         when set, each side writes its counters as JSON to
                       ``<stats_path>.scheduler.json`` / ``<stats_path>.worker-tpT-ppP.json`` (lookups,
                       hit blocks; blocks and bytes loaded and saved) after every change
=====================  ====================================================================

How it works:

- Keys are Mooncake's connector format: ``[prefix@]model@tp_rank:T@pcpP@dcpD@pp_rank:R@group:0@
  <block hash hex>``, one object per full block per rank holding that block's K and V slices of
  every layer (in layer order). vLLM's block hashes (sha256 by default) chain the whole prefix, so
  two engines serving the same model compute the same keys and share blocks.
- Scheduler: ``get_num_new_matched_tokens`` asks the pool once per rank, with ``lookup`` of the
  request's block-hash chain (the resident leading blocks; no lease, no recency update). A hit of
  the whole prompt is reported one token short, as vLLM requires a token to compute.
- Worker: the KV tensors are registered with the client once; loads and saves are batched
  multi-buffer transfers (``get_into_multi`` / ``put_from_multi``): a block's slices of all layers
  form one value. Loads start in ``start_load_kv`` on a background thread and are awaited by the
  first ``wait_for_layer_load``, so they overlap the work before the first attention layer; saves
  of a step are submitted in ``wait_for_save`` and overlap the next steps (``async_save``).

Where it differs from vLLM's Mooncake store connector on purpose:

- The scheduler asks ``lookup`` (the resident prefix, counted by the server in one request) where
  Mooncake's connector calls ``batch_is_exist`` over the whole chain and counts on the client;
  neither grants a lease here, so lookups never hold blocks against eviction.
- Saves do not ask ``batch_is_exist`` first: a put of a block that is already stored answers
  ``already-exists`` and keeps the stored value (counted as ``save_skipped``): one request
  instead of two.
- Each saved block carries its parent key and prefix length, so the server's prefix-aware
  policies (leaf-first eviction, ``store_threshold`` admission) see the chain.
- A full pool (``no-space``) leaves that step's blocks unsaved (logged, not retried); later steps
  still try theirs (vLLM's Mooncake connector skips saves after a -200).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool._native import Client, KvpoolError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")


@dataclass
class BlockTransfer:
    """Blocks of one request to move between the pool and the paged KV cache."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    # Saves only: prefix length in tokens each block completes, and its parent key.
    seq_tokens: list[int] = field(default_factory=list)
    parents: list[Optional[str]] = field(default_factory=list)


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the workers to do in one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def _dump(path: Optional[str], side: str, stats: dict[str, Any]) -> None:
    """Write a side's counters to ``<path>.<side>.json`` (atomically), when asked to."""
    if not path:
        return
    target = f"{path}.{side}.json"
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(stats, f)
    os.replace(tmp, target)


def _client_from_config(extra: dict[str, Any], name: str) -> Client:
    """A kvpool client from ``kv_connector_extra_config`` (environment variables as fallback)."""
    key = extra.get("kvpool_api_key") or os.environ.get("KVPOOL_API_KEY")
    key_file = extra.get("kvpool_api_key_file") or os.environ.get("KVPOOL_API_KEY_FILE")
    if key is None and key_file:
        with open(key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    return Client(
        extra.get("kvpool_server") or os.environ.get("KVPOOL_SERVER"),
        key,
        fingerprint=extra.get("kvpool_fingerprint") or os.environ.get("KVPOOL_FINGERPRINT"),
        ca_file=extra.get("kvpool_ca") or os.environ.get("KVPOOL_CA"),
        data_dir=extra.get("kvpool_data_dir") or os.environ.get("KVPOOL_DATA_DIR"),
        transport=str(extra.get("kvpool_transport", "auto")),
        client_name=name,
    )


class _Keys:
    """Pool keys of one rank (Mooncake's connector format)."""

    def __init__(self, vllm_config: "VllmConfig", extra: dict[str, Any]) -> None:
        pc = vllm_config.parallel_config
        self.model = str(extra.get("model_name") or vllm_config.model_config.model)
        self.prefix = str(extra.get("key_prefix", ""))
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        self.pcp_size = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
        self.dcp_size = int(getattr(pc, "decode_context_parallel_size", 1) or 1)

    def rank_prefix(self, tp: int, pp: int, pcp: int = 0, dcp: int = 0) -> str:
        head = f"{self.prefix}@" if self.prefix else ""
        return f"{head}{self.model}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:0"

    def all_rank_prefixes(self) -> list[str]:
        """Every rank's prefix: a block is usable only when every rank stored its part."""
        return [
            self.rank_prefix(tp, pp, pcp, dcp)
            for tp in range(self.tp_size)
            for pp in range(self.pp_size)
            for pcp in range(self.pcp_size)
            for dcp in range(self.dcp_size)
        ]

    @staticmethod
    def chain(prefix: str, block_hashes: Any) -> list[str]:
        return [f"{prefix}@{bytes(h).hex()}" for h in block_hashes]


@dataclass
class _Tracked:
    """Scheduler-side state of a running request."""

    request: "Request"
    block_ids: list[int]
    saved_blocks: int  # leading blocks already in the pool or scheduled for saving
    save_scheduled: bool = False


class _Scheduler:
    def __init__(self, vllm_config: "VllmConfig", extra: dict[str, Any]) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        self.keys = _Keys(vllm_config, extra)
        self.store_threshold = int(extra.get("store_threshold", 0))
        self.async_save = bool(extra.get("async_save", True))
        self.stats_path: Optional[str] = extra.get("stats_path")
        self.client = _client_from_config(extra, "kvpool-vllm-scheduler")
        self.prefixes = self.keys.all_rank_prefixes()
        # Keys are per rank; the scheduler hands the workers rank 0's and each worker rewrites the
        # rank part. The chain names blocks by hash only, so rank 0's list is enough to carry.
        self.key_prefix0 = self.prefixes[0]
        self.pending_loads: dict[str, tuple[int, int]] = {}  # req -> (first block, end block)
        self.local_computed: dict[str, int] = {}  # req -> tokens vLLM had locally when asked
        self.tracked: dict[str, _Tracked] = {}
        self.lookups = 0
        self.lookup_hit_blocks = 0
        self.lookup_blocks = 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        self.local_computed[request.request_id] = num_computed_tokens
        n_blocks = min(len(request.block_hashes), request.num_tokens // self.block_size)
        if n_blocks == 0:
            return 0, False
        try:
            resident = min(
                self.client.lookup(_Keys.chain(p, request.block_hashes[:n_blocks])) for p in self.prefixes
            )
        except KvpoolError as e:
            log.warning("kvpool lookup failed, computing request %s locally: %s", request.request_id, e)
            return 0, False
        self.lookups += 1
        self.lookup_blocks += n_blocks
        self.lookup_hit_blocks += resident
        _dump(self.stats_path, "scheduler", self.stats())
        hit_tokens = resident * self.block_size
        if hit_tokens >= request.num_tokens:
            # vLLM must compute at least one token to produce logits.
            hit_tokens = request.num_tokens - 1
        if hit_tokens <= num_computed_tokens:
            return 0, False
        self.pending_loads[request.request_id] = (num_computed_tokens // self.block_size, resident)
        return hit_tokens - num_computed_tokens, False

    def stats(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "lookup_blocks": self.lookup_blocks, "hit_blocks": self.lookup_hit_blocks}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens == 0:
            self.pending_loads.pop(request.request_id, None)
        local = self.local_computed.pop(request.request_id, request.num_computed_tokens)
        first_uncomputed = (local + num_external_tokens) // self.block_size
        # Blocks computed before (local prefix-cache hits, or loaded now) are not saved again.
        self.tracked[request.request_id] = _Tracked(request, block_ids, first_uncomputed)

    def build_connector_meta(self, out: "SchedulerOutput") -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata()
        for new in out.scheduled_new_reqs:
            t = self.tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            if new.req_id in self.pending_loads:
                first, end = self.pending_loads.pop(new.req_id)
                chain = _Keys.chain(self.key_prefix0, t.request.block_hashes[first:end])
                meta.loads.append(BlockTransfer(new.req_id, chain, t.block_ids[first:end]))
            self._schedule_save(meta, t, new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                t.block_ids = list(new_ids[0])
            elif new_ids is not None:
                t.block_ids.extend(new_ids[0])
            self._schedule_save(meta, t, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _schedule_save(self, meta: KVPoolConnectorMetadata, t: _Tracked, computed_after_step: int) -> None:
        """Save the prompt's full blocks that this step completes."""
        req = t.request
        prompt_len = len(req.prompt_token_ids or [])
        end = min(computed_after_step, prompt_len) // self.block_size
        end = min(end, len(req.block_hashes), len(t.block_ids))
        start = t.saved_blocks
        if end <= start:
            return
        idx = [b for b in range(start, end) if (b + 1) * self.block_size >= self.store_threshold]
        t.saved_blocks = end
        if not idx:
            return
        keys = _Keys.chain(self.key_prefix0, req.block_hashes[:end])
        meta.saves.append(
            BlockTransfer(
                req.request_id,
                [keys[b] for b in idx],
                [t.block_ids[b] for b in idx],
                [(b + 1) * self.block_size for b in idx],
                [keys[b - 1] if b > 0 else None for b in idx],
            )
        )
        t.save_scheduled = True

    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        t = self.tracked.pop(request.request_id, None)
        self.pending_loads.pop(request.request_id, None)
        self.local_computed.pop(request.request_id, None)
        # With async saves the blocks stay allocated until the worker reports the save done.
        return bool(self.async_save and t is not None and t.save_scheduled), None


@dataclass
class _Layout:
    """Where block ``b`` of every layer lies in the registered KV tensors."""

    bases: list[int]  # per piece: address of block 0
    strides: list[int]  # per piece: bytes between consecutive blocks
    piece_bytes: int  # bytes of one block in one piece

    def pieces(self, block_id: int) -> tuple[list[int], list[int]]:
        return (
            [base + block_id * stride for base, stride in zip(self.bases, self.strides)],
            [self.piece_bytes] * len(self.bases),
        )

    @property
    def block_bytes(self) -> int:
        return self.piece_bytes * len(self.bases)


class _Worker:
    def __init__(self, vllm_config: "VllmConfig", extra: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.keys = _Keys(vllm_config, extra)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = vllm_config.cache_config.num_gpu_blocks
        tp = get_tensor_model_parallel_rank()
        pp = get_pp_group().rank_in_group
        self.key_prefix = self.keys.rank_prefix(tp, pp)
        self.side = f"worker-tp{tp}-pp{pp}"
        self.key_prefix0 = self.keys.all_rank_prefixes()[0]
        self.async_save = bool(extra.get("async_save", True))
        self.stats_path: Optional[str] = extra.get("stats_path")
        self.client = _client_from_config(extra, f"kvpool-vllm-worker-tp{tp}-pp{pp}")
        self.layout: Optional[_Layout] = None
        self.registered: list[int] = []
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self.load_future: Optional[Future[None]] = None
        self.saves: dict[str, list[Future[None]]] = {}
        self.finished_waiting: set[str] = set()
        self.lock = threading.Lock()
        self.load_errors: set[int] = set()
        self.stats = {"loaded_blocks": 0, "loaded_bytes": 0, "saved_blocks": 0, "saved_bytes": 0,
                      "save_skipped": 0, "load_seconds": 0.0, "save_seconds": 0.0}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        bases: list[int] = []
        strides: list[int] = []
        piece = None
        seen: set[int] = set()
        for name, kv in kv_caches.items():
            if not isinstance(kv, torch.Tensor) or not kv.is_contiguous():
                raise ValueError(f"KVPoolConnector needs contiguous KV tensors; layer {name} is not")
            if kv.device.type != "cpu":
                raise ValueError(f"KVPoolConnector reads KV memory from the host; layer {name} is on {kv.device}")
            per_block = kv.element_size() * kv[0].numel()
            # Block-major (LBHNC, the CPU backend): block b is kv[b]. K/V-major: kv[0][b], kv[1][b].
            if kv.shape[0] == self.num_blocks:
                layer_pieces = [(kv.data_ptr(), per_block)]
            elif kv.shape[0] == 2 and kv.shape[1] == self.num_blocks:
                per_block = kv.element_size() * kv[0][0].numel()
                layer_pieces = [(kv[0].data_ptr(), per_block), (kv[1].data_ptr(), per_block)]
            else:
                raise ValueError(f"KV layout of layer {name} {tuple(kv.shape)} has no block dimension first")
            for base, size in layer_pieces:
                if piece is not None and size != piece:
                    raise ValueError("KVPoolConnector needs the same block size in bytes in every layer")
                piece = size
                bases.append(base)
                strides.append(size)
            storage = kv.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.client.register(storage.data_ptr(), storage.nbytes())
                self.registered.append(storage.data_ptr())
        assert piece is not None, "no KV caches to register"
        self.layout = _Layout(bases, strides, piece)
        log.info("kvpool connector: %d layers registered, %d bytes per block, transport %s",
                 len(kv_caches), self.layout.block_bytes, self.client.transport)

    def _rank_keys(self, keys: list[str]) -> list[str]:
        if self.key_prefix == self.key_prefix0:
            return keys
        return [self.key_prefix + k[len(self.key_prefix0):] for k in keys]

    def _ranges(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        assert self.layout is not None
        ptrs, sizes = [], []
        for b in block_ids:
            p, s = self.layout.pieces(b)
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    # ---- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        if not meta.loads:
            return
        loads = list(meta.loads)
        self.load_future = self.loader.submit(self._load, loads)

    def _load(self, loads: list[BlockTransfer]) -> None:
        t0 = time.perf_counter()
        keys = [k for l in loads for k in self._rank_keys(l.keys)]
        block_ids = [b for l in loads for b in l.block_ids]
        ptrs, sizes = self._ranges(block_ids)
        try:
            got = self.client.get_into_multi(keys, ptrs, sizes)
        except KvpoolError as e:
            log.error("kvpool load of %d blocks failed: %s", len(keys), e)
            got = [("internal", 0)] * len(keys)
        assert self.layout is not None
        failed = {b for b, (st, n) in zip(block_ids, got) if st != "ok" or n != self.layout.block_bytes}
        with self.lock:
            self.load_errors |= failed
            ok = len(block_ids) - len(failed)
            self.stats["loaded_blocks"] += ok
            self.stats["loaded_bytes"] += ok * self.layout.block_bytes
            self.stats["load_seconds"] += time.perf_counter() - t0
            _dump(self.stats_path, self.side, self.stats)
        if failed:
            log.warning("kvpool: %d of %d blocks could not be loaded; vLLM recomputes them", len(failed), len(keys))

    def wait_for_layer_load(self) -> None:
        f = self.load_future
        if f is not None:
            f.result()
            self.load_future = None

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errs, self.load_errors = self.load_errors, set()
        return errs

    # ---- saves -------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolConnectorMetadata) -> None:
        self.wait_for_layer_load()
        if not meta.saves:
            return
        saves = list(meta.saves)
        if not self.async_save:
            self._save(saves)
            return
        fut = self.saver.submit(self._save, saves)
        with self.lock:
            for s in saves:
                self.saves.setdefault(s.req_id, []).append(fut)

    def _save(self, saves: list[BlockTransfer]) -> None:
        assert self.layout is not None
        t0 = time.perf_counter()
        keys = [k for s in saves for k in self._rank_keys(s.keys)]
        parents = [None if p is None else self._rank_keys([p])[0] for s in saves for p in s.parents]
        seq = [n for s in saves for n in s.seq_tokens]
        ptrs, sizes = self._ranges([b for s in saves for b in s.block_ids])
        try:
            st = self.client.put_from_multi(keys, ptrs, sizes, parents=parents, seq_tokens=seq,
                                            tokens=[self.block_size] * len(keys))
        except KvpoolError as e:
            log.warning("kvpool save of %d blocks failed: %s", len(keys), e)
            return
        stored = sum(1 for s in st if s == "ok")
        with self.lock:
            self.stats["saved_blocks"] += stored
            self.stats["saved_bytes"] += stored * self.layout.block_bytes
            self.stats["save_skipped"] += sum(1 for s in st if s != "ok")
            self.stats["save_seconds"] += time.perf_counter() - t0
            _dump(self.stats_path, self.side, self.stats)
        if any(s == "no-space" for s in st):
            log.warning("kvpool: pool full, %d blocks not saved", st.count("no-space"))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        with self.lock:
            # Only requests with saves: for those alone the scheduler kept the blocks allocated
            # (request_finished answered True); vLLM has already dropped the others.
            self.finished_waiting |= {r for r in finished_req_ids if r in self.saves}
            done = {r for r in self.finished_waiting if all(f.done() for f in self.saves[r])}
            self.finished_waiting -= done
            for r in done:
                self.saves.pop(r, None)
        return (done or None), None

    def close(self) -> None:
        self.loader.shutdown(wait=True)
        self.saver.shutdown(wait=True)
        for p in self.registered:
            try:
                self.client.unregister(p)
            except KvpoolError:
                pass
        self.registered.clear()
        self.client.close()


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by kvpool (see the module docs)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "Optional[KVCacheConfig]" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._scheduler: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, extra)
        else:
            self._worker = _Worker(vllm_config, extra)

    # ---- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` the pool holds: one ``lookup`` of the request's
        block-hash chain per rank; a full hit is reported one token short."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Remember the request and where its blocks are."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Loads to start and full prompt blocks to save in this step."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """True while an asynchronous save still reads the request's blocks."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV tensors with the client (once)."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start this step's loads on a background thread (one batched multi-buffer get)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's loads are in the KV cache (the first layer waits)."""
        assert self._worker is not None
        self._worker.wait_for_layer_load()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing per layer: a block's object holds every layer, saved in ``wait_for_save``."""
        return

    def wait_for_save(self) -> None:
        """Submit this step's saves (one batched multi-buffer put)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Finished requests whose asynchronous saves are done (their blocks may be freed)."""
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that could not be loaded (vLLM recomputes them)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Finish pending transfers and close the connection."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def connector_stats(self) -> dict[str, Any]:
        """Counters of this side: lookups and hit blocks (scheduler), blocks and bytes moved
        (worker)."""
        if self._scheduler is not None:
            return self._scheduler.stats()
        if self._worker is not None:
            with self._worker.lock:
                return dict(self._worker.stats)
        return {}
