"""A vLLM engine with a stand-in model, for driving the connector through vLLM 0.32's real
scheduler step by step (preemption, chunked prefill, resumes, load failures) in seconds.

What is real: vLLM's ``Scheduler`` (block allocation, prefix caching, preemption, chunked prefill,
the connector calls in their order, ``SchedulerOutput`` objects), the connector's scheduler and
worker sides, the kvpool client and a kvpool server process.

What stands in: the model runner. Its KV cache (allocated by vLLM's own ``allocate_kv_cache`` in
the layout asked for, LBHNC as on vLLM's CPU backend by default) has, in every token slot of every
head, a digest of the token prefix that ends there (what a real model's K and V are: a function of
the prefix). Each step, before "computing" a request's new tokens, it checks that every slot the
request attends to holds the digest of the request's own prefix: a block loaded from the wrong
key, a load that never ran, or a block overwritten by another request reads as a wrong answer, as
it would in a real engine, except that here it is caught. KV computed over a wrong slot is wrong
too (``POISON``), as a real model's would be. The next token is a function of the prefix too, so
two engines answer alike exactly when their KV is right. ``audit`` checks the pool itself: every
block stored under a key must hold the digests of that key's prefix.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

BLOCK = 16  # tokens per block
DIM = 4  # floats per slot, head and layer: K (2) then V (2)
LAYERS = 2
MOD = (1 << 61) - 1
# What a slot holds when it was computed over KV that was not its prefix's.
POISON = -1.0


def slot_value(digest: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """What layer ``layer``, head ``head`` holds for a position whose prefix digest is ``digest``."""
    return digest + layer + 1000 * head


def digests(tokens: list[int]) -> torch.Tensor:
    """Per position, the digest of the prefix ending there: shape (len, DIM) float32 (exact)."""
    out = torch.empty(len(tokens), DIM, dtype=torch.float32)
    h = 7
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + t + 1) % MOD
        out[i] = torch.tensor([(h >> (16 * k)) & 0xFFFF for k in range(DIM)], dtype=torch.float32)
    return out


def next_token(tokens: list[int]) -> int:
    h = 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % MOD
    return 3 + h % 97


_dist_lock = threading.Lock()
_dist_ready = False


def init_parallel_state() -> None:
    """A one-process distributed environment (the worker side asks for its ranks)."""
    global _dist_ready
    with _dist_lock:
        if _dist_ready:
            return
        from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
        _dist_ready = True


@dataclass
class Violation:
    step: int
    req_id: str
    position: int
    what: str


@dataclass
class SimEngine:
    """One engine: a scheduler, the connector's two sides, a KV cache of digests."""

    model_dir: str
    extra: dict[str, Any]
    num_blocks: int = 64
    max_num_seqs: int = 16
    max_batched: int = 256
    kv_role: str = "kv_both"
    connector: bool = True
    # The connector's module (tests of earlier versions point elsewhere).
    module: str = "kvpool.vllm"
    load_failure_policy: str = "fail"
    kv_events: bool = False
    # Shape the scheduler's outputs as for vLLM's V2 model runner (resumed requests come back
    # as new ones, with all their tokens to prefill). The V2 runner itself needs Triton on GPU.
    v2_outputs: bool = False
    # Called after schedule() and before the worker runs the step (tests inject faults here).
    between: Optional[Callable[["SimEngine", Any], None]] = None
    # The KV cache's layout (vLLM's KVCacheLayout name) and KV heads.
    layout: str = "LBHNC"
    heads: int = 1
    # A FULL CUDA graph's replay: vLLM never calls wait_for_layer_load.
    full_cudagraph: bool = False
    violations: list[Violation] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model = ModelConfig(model=self.model_dir, dtype="float32", seed=0, max_model_len=4096)
        kvt = None
        if self.connector:
            kvt = KVTransferConfig(
                kv_connector="KVPoolConnector",
                kv_connector_module_path=self.module,
                kv_role=self.kv_role,
                kv_connector_extra_config=self.extra,
                kv_load_failure_policy=self.load_failure_policy,  # type: ignore[arg-type]
            )
        self.config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_batched,
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=kvt,
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if self.kv_events else None,
        )
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.config.cache_config.kv_cache_layout = self.layout
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=DIM // 2, dtype=torch.float32)
        groups = [KVCacheGroupSpec([f"layer{i}" for i in range(LAYERS)], spec)]
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, groups, self.num_blocks * LAYERS * spec.page_size_bytes
        )
        assert self.kv_cache_config.num_blocks == self.num_blocks
        self.kv_cache_config.kv_cache_layout = self.layout
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.config):
            init_parallel_state()
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.scheduler.use_v2_model_runner = self.v2_outputs
        self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[self.layout])
        assert set(self.kv) == {f"layer{i}" for i in range(LAYERS)}
        self.worker = None
        if self.connector:
            import importlib

            cls = importlib.import_module(self.module).KVPoolConnector
            self.worker = cls(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker.register_kv_caches(self.kv)
        # KV events the scheduler publishes, and the connector stats it reports.
        self.published: list[Any] = []
        self.scheduler.kv_event_publisher = _Collect(self.published)  # type: ignore[assignment]
        self.connector_stats: list[dict[str, Any]] = []
        self.requests: dict[str, Any] = {}
        self.preemptions = 0
        self.invalid_blocks = 0

    @property
    def sched_connector(self) -> Any:
        return self.scheduler.connector

    # ---- requests -------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.requests[req_id] = req
        self.scheduler.add_request(req)

    def output(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    # ---- one step -------------------------------------------------------------------------

    def _slots(self, req_id: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks and token indices of a request's positions."""
        (table,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        t = torch.tensor(table, dtype=torch.long)
        return t[positions // BLOCK], positions % BLOCK

    def read_slots(self, layer: int, blocks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[positions, heads, DIM]`` through vLLM's logical ``[B, H, N, C]`` view."""
        return self.kv[f"layer{layer}"][blocks, :, tokens, :]

    def write_slots(self, layer: int, blocks: torch.Tensor, tokens: torch.Tensor, value: torch.Tensor) -> None:
        self.kv[f"layer{layer}"][blocks, :, tokens, :] = value

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        self.steps += 1
        self.preemptions += len(out.preempted_req_ids or ())
        if self.between is not None:
            self.between(self, out)
        w = self.worker
        if w is not None:
            meta = out.kv_connector_metadata
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            if not self.full_cudagraph:
                w.wait_for_layer_load("layer0")
        # Blocks whose load failed this step: vLLM discards what the step computes for their
        # requests and computes them again, so the step's KV check skips those requests.
        lost = set(w._worker.load_errors) if w is not None else set()
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        heads = torch.arange(self.heads, dtype=torch.float32)[None, :, None] * 1000
        for rid in req_ids:
            req = self.requests[rid]
            start, n = starts[rid], out.num_scheduled_tokens[rid]
            tokens = list(req.all_token_ids)
            want = digests(tokens[: start + n])
            (table,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
            right = True
            if start > 0:
                blocks, toks = self._slots(rid, torch.arange(start))
                for i in range(LAYERS):
                    got = self.read_slots(i, blocks, toks)
                    bad = (got != want[:start, None, :] + i + heads).flatten(1).any(dim=1).nonzero()
                    if len(bad):
                        right = False
                        # A step whose load failed is discarded and computed again by vLLM.
                        if not lost.intersection(table):
                            p = int(bad[0])
                            self.violations.append(
                                Violation(self.steps, rid, p, f"layer{i} slot holds another prefix's KV"))
                        break
            blocks, toks = self._slots(rid, torch.arange(start, start + n))
            for i in range(LAYERS):
                value = want[start:, None, :] + i + heads if right else torch.full((n, self.heads, DIM), POISON)
                self.write_slots(i, blocks, toks, value)
            # A token is sampled once the known tokens are all computed.
            sampled.append([next_token(tokens)] if start + n >= len(tokens) else [])
        kvo = None
        if w is not None:
            w.wait_for_save()
            sending, recving = w.get_finished(out.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            self.invalid_blocks += len(invalid)
            kvo = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=w.build_connector_worker_meta(),
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            w.clear_connector_metadata()
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kvo,
        )
        for eco in self.scheduler.update_from_output(out, mro).values():
            st = getattr(eco, "scheduler_stats", None)
            if st is not None and st.kv_connector_stats:
                self.connector_stats.append(st.kv_connector_stats)

    def run(self, timeout: float = 120.0) -> None:
        """Step until every request finished and no save holds blocks."""
        deadline = time.monotonic() + timeout
        # vLLM's scheduler also counts a connector's pending work (saves holding blocks).
        while self.scheduler.has_requests():
            if not self.scheduler.has_unfinished_requests():
                time.sleep(0.001)  # only saves are left: an idle engine steps, it does not spin
            self.step()
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout} s ({self.steps} steps)")

    def block_refs(self) -> int:
        """Blocks anyone still references (0 once every request and save is done)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)

    def close(self) -> None:
        if self.sched_connector is not None:
            self.sched_connector.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


class _Collect:
    """A KV event publisher that keeps what it is given."""

    def __init__(self, into: list[Any]) -> None:
        self.into = into

    def publish(self, batch: Any) -> None:
        self.into.extend(batch.events)

    def shutdown(self) -> None:
        pass


def audit(client: Any, prefix: str, prompts: list[list[int]], heads: int = 1) -> tuple[int, list[str]]:
    """Every block of these token sequences that the pool holds under ``prefix`` must hold the
    digests of its prefix, K and V of every layer. Returns (blocks checked, wrong keys)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    checked, wrong = 0, []
    for i, toks in enumerate(prompts):
        hasher = get_request_block_hasher(BLOCK, sha256)
        r = Request(f"audit-{i}", list(toks), SamplingParams(), None, block_hasher=hasher)
        want = digests(toks)
        keys = [f"{prefix}@{bytes(h).hex()}" for h in r.block_hashes]
        for b, (st, val) in enumerate(client.get_batch(keys)):
            if st != "ok":
                continue
            checked += 1
            # The pool object is the block's logical KV: [layer][head][token][K, V] (kvpool.vllm.layout).
            got = torch.frombuffer(bytearray(val), dtype=torch.float32).view(LAYERS, heads, BLOCK, DIM)
            exp = torch.stack([
                torch.stack([slot_value(want[b * BLOCK : (b + 1) * BLOCK], layer, h) for h in range(heads)])
                for layer in range(LAYERS)
            ])
            if not torch.equal(got, exp):
                wrong.append(keys[b])
    return checked, wrong

