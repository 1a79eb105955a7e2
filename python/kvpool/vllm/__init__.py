"""vLLM KV connector backed by kvpool (``KVConnectorBase_V1``, vLLM 0.32).

Select it with::

    KVTransferConfig(
        kv_connector="KVPoolConnector",
        kv_connector_module_path="kvpool.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",   # the connector sets it too (see below)
        kv_connector_extra_config={"kvpool_data_dir": "/var/lib/kvpool"},   # or server + key + fingerprint
    )

``kv_connector_extra_config`` keys (all optional except a way to reach the server):

===========================  ==============================================================
``kvpool_server``            ``host:port`` of the pool (QUIC); else ``KVPOOL_SERVER``, else
                             Mooncake's ``master_server_address`` / ``MOONCAKE_MASTER``
``kvpool_api_key``           API key (or ``kvpool_api_key_file``, ``KVPOOL_API_KEY[_FILE]``)
``kvpool_fingerprint``       SHA-256 of the server certificate (or ``kvpool_ca`` PEM file)
``kvpool_data_dir``          a local server's data directory (address, fingerprint and key)
``kvpool_transport``         ``auto`` (shared memory on the same host, QUIC otherwise),
                             ``quic`` or ``shm``; else from Mooncake's ``protocol``
``kvpool_lookup_lease_s``    how long a lookup holds the blocks it counted (default 10 s, at
                             most 60); the load releases them at once
``kvpool_lookup_deadline_ms`` the scheduler's lookup gives up after this long (default 50): the
                             request is computed here and the pool counts as down until it
                             answers a ping again
``kvpool_dead_after_s``      a connection that hears nothing from the pool for this long is dead
                             (default 1 s; a killed server sends no close)
``kvpool_node_answer_ms``    on a cluster, a storage node that answers neither a load nor a
                             ping within this long is skipped until it answers again (default
                             60): its blocks are computed here
``kvpool_staging``           ``auto`` (device KV caches, and host layouts whose block image is
                             scattered, go through a host staging area; host caches whose image
                             lies in a few runs, as vLLM's CPU backend's, are registered
                             directly) or ``always`` (stage every cache)
``kvpool_staging_bytes``     size of the host staging area per worker (default 256 MiB, cut
                             into chunks that loads and saves share; at least four blocks)
``kvpool_device_staging_bytes``  for device caches: the staging area in device memory that the
                             client moves through its own pinned buffers (default 64 MiB)
``kvpool_key_format``        ``kvpool`` (default: keys carry the digest of what the bytes mean,
                             see :mod:`kvpool.vllm.layout`) or ``mooncake``: keys and objects
                             exactly as vLLM's ``MooncakeStoreConnector`` forms them, for a
                             fleet that mixes both connectors (refused where another engine
                             already stores another format under those keys)
``kvpool_load_threads``      asynchronous loads in flight at once (default 4)
``kvpool_save_pin_limit``    vLLM blocks that saves in flight may hold at once (default a
                             quarter of the KV cache); saves past it are dropped (counted)
``kvpool_event_medium``      the ``medium`` of KV events (default vLLM's ``CPU``)
``kvpool_load_failure_policy``  ``recompute`` (default: vLLM's ``kv_load_failure_policy`` is set
                             to ``recompute``, so a block that cannot be loaded is computed) or
                             ``fail`` (vLLM's setting stands); ``kv_load_failure_policy`` in
                             ``kv_connector_extra_config`` says the same (see below)
``kvpool_full_backoff_s``     after the pool answered no-space, drop saves for this long
                             (default 1 s) instead of holding vLLM's blocks through more waits
``store_threshold``          save only blocks whose prefix length (tokens) is at least this
``key_prefix``               namespace prepended to keys; Mooncake's ``cache_prefix`` too
``model_name``               model part of keys (default: the basename of the model path)
``async_save``               default True: saves run on a background thread
``stats_path``               each side writes counters to ``<stats_path>.scheduler.json`` /
                             ``<stats_path>.worker-tpT-ppP.json``
``enable_lookup``            default True; False: never load (Mooncake's name)
``lookup_async``             default False; True: lookups run on a background thread and the
                             scheduler asks again on a later step (Mooncake's name)
``save_decode_cache``        default False; True: save blocks completed while decoding too
``tenant_id``                Mooncake's tenant: a separate key space (else ``MOONCAKE_TENANT_ID``)
``load_async``               default True: loads run between steps (vLLM's asynchronous load), so
                             a slow load delays its own request, not the batch; False: within
                             the step that needs them
``preferred_segment``        refused: kvpool places blocks by its placement policy
===========================  ==============================================================

What the connector does, and what it refuses:

- Every KV cache layout vLLM 0.32 hands out (the strided per-layer views of FlashAttention,
  FlashInfer, Triton, FlexAttention, ROCm, the MLA backends, CPU; kernel-block splits, padded
  pages, fp8 and per-token-head quantised caches) and vllm-ascend's per-layer tuples: a block is
  stored as its *logical* KV (:mod:`kvpool.vllm.layout`), so engines whose bytes mean the same
  share it whatever their layout, and keys carry a digest of what the bytes mean, so engines
  whose bytes mean something else (another dtype, fp8 encoding, packing, heads per rank, block
  size) never load each other's blocks.
- Keys follow Mooncake's connector grammar (see :mod:`kvpool.vllm.keys`); with
  ``kvpool_key_format: mooncake`` they are upstream's exactly.
- A synchronous load (``load_async: false``) is complete when ``start_load_kv`` returns (FULL
  CUDA graphs skip ``wait_for_layer_load``). A step that read a block whose load failed, on any
  worker, saves nothing; its requests' blocks are saved once vLLM has computed them again.
- Every load and save ends in a report, whatever exception it meets: vLLM computes what did not
  arrive, and the blocks a save referenced are freed.
- ``kv_load_failure_policy``: vLLM's default is ``fail``, and vLLM 0.32 keeps no record of whether
  a user chose it. A ``fail`` given on ``vllm serve``'s command line (``--kv-transfer-config``'s
  JSON, or ``--kv-transfer-config.kv_load_failure_policy``) is kept; otherwise the connector turns
  ``fail`` into ``recompute`` (logged) unless ``kv_connector_extra_config`` says
  ``kvpool_load_failure_policy`` (or ``kv_load_failure_policy``) ``fail``. A ``fail`` set through
  the Python API (``LLM(kv_transfer_config=...)``) cannot be told from the default.
- ``kv_role``: a ``kv_consumer`` never saves, a ``kv_producer`` never loads.
- One KV cache group of attention layers (full attention; sliding-window layers when vLLM's
  hybrid KV cache manager is off, which it is for connectors without ``SupportsHMA``, as this
  one). A configuration with several groups (a hybrid model with HMA on) or a Mamba, cross
  attention or encoder-only group is refused at start-up.
- ``reset_cache`` (vLLM's ``/reset_prefix_cache``) drops this model's blocks from the pool.
- ``take_events``: ``BlockStored`` for blocks this engine saved, ``BlockRemoved`` when the pool
  lets one of them go, ``AllBlocksCleared`` after a reset (with ``--kv-events-config``).
- ``get_kv_connector_stats``: lookups, loads and saves with p50/p99 latencies, into vLLM's log
  line and Prometheus (``vllm:kvpool_*``).
- ``requires_kv_delivery`` is False: the pool is a best-effort cache, a dropped save is a miss.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpool.vllm.config import ConnectorConfig, command_line_failure_policy
from kvpool.vllm.keys import KeyLayout, model_name, replication_factor
from kvpool.vllm.layout import kv_format
from kvpool.vllm.metadata import KVPoolConnectorMetadata, KVPoolWorkerMetadata
from kvpool.vllm.scheduler import Scheduler
from kvpool.vllm.stats import KVPoolConnectorStats, KVPoolPromMetrics
from kvpool.vllm.worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "KVPoolWorkerMetadata", "KVPoolConnectorStats"]


def check_kv_cache_config(kv_cache_config: "Optional[KVCacheConfig]") -> None:
    """Refuse KV cache layouts the connector cannot store correctly, at start-up."""
    if kv_cache_config is None:
        return
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        raise ValueError(
            f"KVPoolConnector stores one KV cache group; this model has {len(groups)} "
            "(a hybrid model with vLLM's hybrid KV cache manager on). Start vLLM with "
            "--disable-hybrid-kv-cache-manager, or use a model with one kind of attention"
        )
    for g in groups:
        kind = type(g.kv_cache_spec).__name__
        if any(x in kind for x in ("Mamba", "CrossAttention", "EncoderOnly", "HiddenState")):
            raise ValueError(f"KVPoolConnector cannot store a {kind} KV cache group")


def block_size_of(vllm_config: "VllmConfig", kv_cache_config: "Optional[KVCacheConfig]") -> int:
    """The scheduler's block size (tokens per block hash), as vLLM resolves it."""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if bs != hash_bs:
            raise ValueError(f"KVPoolConnector needs block hashes per block ({hash_bs} != {bs} tokens)")
        return int(bs)
    return int(vllm_config.cache_config.block_size)


def key_layout(vllm_config: "VllmConfig", kv_cache_config: "Optional[KVCacheConfig]", cfg: ConnectorConfig) -> KeyLayout:
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ValueError("KVPoolConnector needs vLLM's KV cache configuration (vLLM 0.32 passes it to connectors): "
                         "without it nothing says what a block's bytes mean")
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config and kv_cache_config.kv_cache_groups else None
    heads = int(vllm_config.model_config.get_total_num_kv_heads())
    return KeyLayout(
        model=str(cfg.model_name or model_name(vllm_config.model_config.model)),
        cache_prefix=cfg.key_prefix,
        namespace=cfg.namespace,
        tp_size=tp,
        pp_size=int(pc.pipeline_parallel_size),
        pcp_size=int(getattr(pc, "prefill_context_parallel_size", 1) or 1),
        dcp_size=dcp,
        replication=replication_factor(spec, tp, heads, dcp) if spec is not None else 1,
        format="" if cfg.key_format == "mooncake" else kv_format(vllm_config, kv_cache_config).digest,
    )


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by kvpool (see the module docs)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "Optional[KVCacheConfig]" = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        kvt = vllm_config.kv_transfer_config
        cfg = ConnectorConfig.from_extra(dict(kvt.kv_connector_extra_config or {}))
        check_kv_cache_config(kv_cache_config)
        kv_role = str(kvt.kv_role)
        if kv_role == "kv_consumer" and cfg.save_decode_cache:
            raise ValueError("save_decode_cache: a kv_consumer never saves; use kv_both")
        layout = key_layout(vllm_config, kv_cache_config, cfg)
        block_size = block_size_of(vllm_config, kv_cache_config)
        self._scheduler: Optional[Scheduler] = None
        self._worker: Optional[Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            explicit = command_line_failure_policy()
            if explicit == "fail" and not cfg.policy_given:
                log.info("kvpool: kv_load_failure_policy 'fail' from the command line is kept: a block the pool "
                         "loses between lookup and load fails its request")
            elif cfg.load_failure_policy == "recompute" and kvt.kv_load_failure_policy != "recompute":
                # The scheduler reads this right after building its connector. vLLM's default is
                # "fail", and nothing but the command line tells an explicit "fail" from it.
                log.warning("kvpool: kv_load_failure_policy %r -> 'recompute': a block the pool lost is computed "
                            "instead of failing its request (to keep 'fail', set kvpool_load_failure_policy='fail' "
                            "in kv_connector_extra_config)", kvt.kv_load_failure_policy)
                kvt.kv_load_failure_policy = "recompute"
            events = vllm_config.kv_events_config
            self._scheduler = Scheduler(
                cfg, layout, block_size, kv_role, int(vllm_config.parallel_config.world_size),
                bool(events and events.enable_kv_cache_events), num_blocks=int(kv_cache_config.num_blocks),
            )
        else:
            from vllm.distributed.parallel_state import (
                get_dcp_group,
                get_pcp_group,
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            tp, pp = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
            pcp = get_pcp_group().rank_in_group if layout.pcp_size > 1 else 0
            dcp = get_dcp_group().rank_in_group if layout.dcp_size > 1 else 0
            num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or vllm_config.cache_config.num_gpu_blocks)
            self._worker = Worker(cfg, layout.writer(tp, pcp, dcp, pp), block_size, num_blocks, f"worker-tp{tp}-pp{pp}",
                                  fmt=kv_format(vllm_config, kv_cache_config),
                                  order=list(kv_cache_config.kv_cache_groups[0].layer_names))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """None: blocks are addressed through the strides of whatever layout the attention
        backends choose (see :mod:`kvpool.vllm.layout`), so the connector never overrides the
        layout the kernels prefer."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: a synchronous load is complete when ``start_load_kv`` returns, so a FULL CUDA
        graph, whose replay skips ``wait_for_layer_load``, reads loaded blocks; saves read the KV
        after the step's forward pass (``wait_for_save``)."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is only a future miss."""
        return False

    # ---- scheduler side ----------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        """Keep vLLM's block pool: save jobs hold references on the blocks they read."""
        if self._scheduler is not None:
            self._scheduler.pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` the pool holds (and now holds for this request)."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Always False: save jobs hold their own block references."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def reset_cache(self) -> Optional[bool]:
        """Drop this model's blocks from the pool (``/reset_prefix_cache`` after a weight update)."""
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache()

    def take_events(self) -> Iterable[Any]:
        if self._scheduler is not None:
            yield from self._scheduler.take_events()

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's per-layer views (any layout), or vllm-ascend's per-layer tuples of tensors."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVPoolConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: the step's synchronous loads completed in ``start_load_kv``."""
        assert self._worker is not None
        self._worker.wait_for_layer_load()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing per layer: a block's object holds every layer, saved in ``wait_for_save``."""
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """No save defers a free (``request_finished`` answers False); requests whose
        asynchronous loads finished."""
        return None, (self._worker.take_received() if self._worker is not None else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return self._worker.build_worker_meta() if self._worker is not None else None

    # ---- telemetry ---------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Optional[KVPoolConnectorStats]:
        side = self._scheduler or self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> KVPoolConnectorStats:
        return KVPoolConnectorStats(data=data) if data is not None else KVPoolConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def connector_stats(self) -> dict[str, Any]:
        """Cumulative counters of this side (as ``stats_path`` writes them)."""
        side = self._scheduler or self._worker
        return side.counters() if side is not None else {}

    def shutdown(self) -> None:
        """Finish pending transfers and close the connections."""
        for side in (self._worker, self._scheduler):
            if side is not None:
                side.close()
        self._worker = self._scheduler = None
