"""Every KV cache layout vLLM 0.32 hands a connector, through the public connector and a real
server: caches built by vLLM's own functions for each attention backend it ships (``vllm_caches``),
registered with ``KVPoolConnector``, blocks saved, then loaded into a second, zeroed cache of the
same kind: the *logical* KV (layer, block, head, state, content) must be equal. Engines whose
bytes mean something else (another dtype, fp8 encoding, packing) find nothing, never wrong KV;
engines whose bytes mean the same in another layout share blocks. vllm-ascend's per-layer tuples
and Mooncake's key format too. Needs vLLM (run by ``.ci/vllm-e2e.sh``).
"""

from __future__ import annotations

import ctypes
import secrets
from collections import defaultdict
from typing import Any, Iterator

import pytest
import torch
import vllm_caches
from conftest import Server
from vllm_caches import Case

pytestmark = pytest.mark.vllm

_ALL, SKIPPED = vllm_caches.backend_cases()


def _selection(cases: list[Case]) -> list[Case]:
    """Each backend's every layout and block size with its first dtype, and its every dtype with
    its first layout and block size."""
    out: dict[str, Case] = {}
    first: dict[str, tuple[str, int]] = {}
    dtype0: dict[str, str] = {}
    for c in cases:
        first.setdefault(c.backend, (c.layout, c.block_size))
        dtype0.setdefault(c.backend, c.cache_dtype)
        if c.cache_dtype == dtype0[c.backend] or (c.layout, c.block_size) == first[c.backend]:
            out.setdefault(c.id, c)
    return list(out.values())


CASES = _selection(vllm_caches.buildable(_ALL)[0])


@pytest.fixture(scope="module")
def pool() -> Iterator[Server]:
    s = Server(dram="512MiB")
    yield s
    s.stop()


def connector(case_or_built: Any, s: Server, **extra: Any) -> tuple[Any, dict[str, Any], Any]:
    """A worker-side ``KVPoolConnector`` over freshly built (zeroed) caches of ``case``; or over
    ``(vllm_config, kv_cache_config, kv_caches)`` when given those."""
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_sim import init_parallel_state

    from kvpool.vllm import KVPoolConnector

    if isinstance(case_or_built, Case):
        vc, kcfg, kv, _ = case_or_built.build()
    else:
        vc, kcfg, kv = case_or_built
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.vllm", kv_role="kv_both",
        kv_connector_extra_config={"kvpool_server": s.addr, "kvpool_api_key": s.api_key,
                                   "kvpool_fingerprint": s.fingerprint, "async_save": False,
                                   "kvpool_staging_bytes": 4 << 20, **extra},
    )
    with set_current_vllm_config(vc):
        init_parallel_state()
        c = KVPoolConnector(vc, KVConnectorRole.WORKER, kcfg)
        c.register_kv_caches(kv)
    return c, kv, kcfg


def save(c: Any, hashes: list[str], block_ids: list[int]) -> None:
    from kvpool.vllm.metadata import KVPoolConnectorMetadata, SaveJob

    job = SaveJob(1, "r", list(range(len(hashes))), hashes, [None, *hashes[:-1]], block_ids)
    c.bind_connector_metadata(KVPoolConnectorMetadata(saves=[job]))
    c.start_load_kv(None)
    c.wait_for_save()
    c.clear_connector_metadata()
    wm = c.build_connector_worker_meta()
    assert wm is not None and wm.done == {1: 1} and not wm.failed, f"save failed: {wm}"


def load(c: Any, hashes: list[str], block_ids: list[int]) -> set[int]:
    """Load synchronously; the block ids that failed."""
    from kvpool.vllm.metadata import KVPoolConnectorMetadata, LoadJob

    job = LoadJob(2, "r", list(range(len(hashes))), hashes, block_ids)
    c.bind_connector_metadata(KVPoolConnectorMetadata(loads=[job]))
    c.start_load_kv(None)
    c.clear_connector_metadata()
    c.build_connector_worker_meta()
    return set(c.get_block_ids_with_load_errors())


def new_hashes(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_backend_layout_and_dtype_keeps_its_logical_kv(case: Case, pool: Server) -> None:
    a, kv_a, kcfg = connector(case, pool)
    b, kv_b, _ = connector(case, pool)
    try:
        nb = kcfg.num_blocks
        vllm_caches.fill(kv_a, seed=hash(case.id) & 0xFFFF)
        hashes, src, dst = new_hashes(3), [1, nb - 1, 0], [2, 0, nb - 2]
        save(a, hashes, src)
        assert load(b, hashes, dst) == set()
        assert vllm_caches.logical_blocks(kv_a, src, nb) == vllm_caches.logical_blocks(kv_b, dst, nb)
        others = [x for x in range(nb) if x not in dst]
        assert not any(any(x) for x in vllm_caches.logical_blocks(kv_b, others, nb)), "a block not loaded changed"
    finally:
        a.shutdown()
        b.shutdown()


def test_only_backends_that_need_a_gpu_library_are_left_out() -> None:
    left = {name for name, _ in SKIPPED}
    # Backends whose module imports a CUDA-only library (flashinfer, the NVIDIA driver) or that
    # a plugin registers; every other backend vLLM ships is built above.
    assert left <= {"TORCH_SDPA", "FLASHINFER", "TRITON_FLASHINFER", "FLASHINFER_MLA", "CUTLASS_MLA",
                    "ROCM_FLASHMLA_SPARSE_DSV4", "FLASH_ATTN_MLA", "NO_ATTENTION", "ULTRAQUANT", "CUSTOM"}, SKIPPED
    assert len({c.backend for c in CASES}) >= 25
    assert {"LBNHC", "LBHNC", "LHBNC", "BLHNC"} <= {c.layout for c in CASES}


def _case(backend: str, layout: str, cache_dtype: str = "auto", block_size: int = 64,
          model_dtype: torch.dtype = torch.bfloat16) -> Case:
    return Case(backend, layout, cache_dtype, block_size, model_dtype=model_dtype)


@pytest.mark.parametrize(
    "saver,loader",
    [
        # fp16 saved, bf16 loaded: the same bytes per block, other numbers.
        (_case("FLASH_ATTN", "LBNHC", model_dtype=torch.float16), _case("FLASH_ATTN", "LBNHC")),
        # fp8 e4m3 saved, e5m2 loaded: both uint8 to vLLM.
        (_case("TRITON_ATTN", "LBNHC", "fp8_e4m3"), _case("TRITON_ATTN", "LBNHC", "fp8_e5m2")),
        # ROCm packs K and V as two head slots: same page bytes as FlashAttention's four heads.
        (_case("ROCM_ATTN", "LBHNC"), _case("FLASH_ATTN", "LBHNC")),
        # Triton's per-token-head int8 (scales inline) and fp8 per-token-head: other bytes.
        (_case("TRITON_ATTN", "LBNHC", "int8_per_token_head"), _case("TRITON_ATTN", "LBNHC", "fp8_per_token_head")),
    ],
    ids=["fp16-bf16", "e4m3-e5m2", "rocm-packing", "int8-fp8-per-token-head"],
)
def test_bytes_that_mean_something_else_are_never_loaded(saver: Case, loader: Case, pool: Server) -> None:
    a, kv_a, kcfg = connector(saver, pool)
    b, kv_b, kcfg_b = connector(loader, pool)
    try:
        assert a._worker.mover.block_bytes == b._worker.mover.block_bytes, "the pair must have equal block sizes"
        vllm_caches.fill(kv_a, seed=7)
        hashes = new_hashes(2)
        save(a, hashes, [1, 2])
        assert load(b, hashes, [3, 4]) == {3, 4}, "bytes of another format were loaded"
        nb = kcfg_b.num_blocks
        assert not any(any(x) for x in vllm_caches.logical_blocks(kv_b, list(range(nb)), nb))
    finally:
        a.shutdown()
        b.shutdown()


def _same_format_pairs() -> list[tuple[Case, Case]]:
    """Pairs of cases whose bytes mean the same but lie differently: another layout, or kernel
    blocks of another size."""
    from kvpool.vllm.layout import kv_format

    groups: dict[str, list[tuple[Case, str, int]]] = defaultdict(list)
    for c in CASES:
        try:
            vc, kcfg, kv, kernel = c.build()
        except Exception:
            continue
        groups[kv_format(vc, kcfg).digest].append((c, c.layout, kernel))
    pairs = []
    for members in groups.values():
        seen: set[tuple[str, int]] = set()
        for c, layout, kernel in members:
            if (layout, kernel) not in seen:
                seen.add((layout, kernel))
        if len(seen) > 1:
            a = members[0]
            b = next(m for m in members if (m[1], m[2]) != (a[1], a[2]))
            pairs.append((a[0], b[0]))
    return pairs[:12]


PAIRS = _same_format_pairs()


@pytest.mark.parametrize("saver,loader", PAIRS, ids=[f"{a.id}->{b.id}" for a, b in PAIRS])
def test_one_format_in_another_layout_loads_the_same_kv(saver: Case, loader: Case, pool: Server) -> None:
    a, kv_a, kcfg_a = connector(saver, pool)
    b, kv_b, kcfg_b = connector(loader, pool)
    try:
        vllm_caches.fill(kv_a, seed=11)
        hashes = new_hashes(2)
        save(a, hashes, [1, 3])
        assert load(b, hashes, [2, 0]) == set()
        assert (vllm_caches.logical_blocks(kv_a, [1, 3], kcfg_a.num_blocks)
                == vllm_caches.logical_blocks(kv_b, [2, 0], kcfg_b.num_blocks))
    finally:
        a.shutdown()
        b.shutdown()


def test_layouts_in_pairs_cover_splits_and_layouts() -> None:
    assert len(PAIRS) >= 4
    assert any(a.layout != b.layout for a, b in PAIRS)


@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_vllm_ascend_caches_share_blocks_with_vllms_own(mla: bool, pool: Server) -> None:
    """vllm-ascend hands each layer separate tensors ([B, N, H, D] each): their block image is
    the same logical KV as vLLM's single strided view, so an NPU engine and a GPU engine of one
    model share blocks; and an NPU engine loads its own."""
    gpu_case = _case("TRITON_MLA" if mla else "FLASH_ATTN", "LBNHC", block_size=64)
    vc, kcfg, _, _ = gpu_case.build()
    order = list(kcfg.kv_cache_groups[0].layer_names)
    heads, dims = (1, (512, 64)) if mla else (vllm_caches.HEADS, (vllm_caches.HEAD, vllm_caches.HEAD))
    npu_kv = vllm_caches.ascend_caches(kcfg.num_blocks, 64, heads, dims, torch.bfloat16, order)
    npu, kv_n, _ = connector((vc, kcfg, npu_kv), pool)
    gpu, kv_g, _ = connector(gpu_case, pool)
    # vllm-ascend sizes its tensors from the bytes it allocated: more rows than blocks.
    npu2, kv_n2, _ = connector((vc, kcfg, vllm_caches.ascend_caches(kcfg.num_blocks + 3, 64, heads, dims,
                                                                    torch.bfloat16, order)), pool)
    try:
        assert isinstance(npu._worker.mover, type(npu2._worker.mover))
        vllm_caches.fill(kv_n, seed=5)
        hashes = new_hashes(3)
        save(npu, hashes, [0, 4, 2])
        assert load(gpu, hashes, [1, 3, 5]) == set()
        assert load(npu2, hashes, [5, 1, 3]) == set()
        nb = kcfg.num_blocks
        want = vllm_caches.logical_blocks(kv_n, [0, 4, 2], nb)
        assert vllm_caches.logical_blocks(kv_g, [1, 3, 5], nb) == want
        assert vllm_caches.logical_blocks(kv_n2, [5, 1, 3], nb) == want
    finally:
        for c in (npu, gpu, npu2):
            c.shutdown()


def test_mooncake_key_format_stores_what_vllms_mooncake_connector_stores(pool: Server) -> None:
    """``kvpool_key_format: mooncake``: keys exactly upstream's, and each object the bytes vLLM's
    own ``MooncakeStoreConnector`` (its ``RankLocalStoreLayout``) puts for the block; an engine
    whose bytes mean something else is refused under those keys."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        KeyMetadata,
        PoolKey,
        RankLocalStoreLayout,
    )

    from kvpool import Client

    prefix = secrets.token_hex(4)
    case = _case("FLASH_ATTN", "LBNHC")
    a, kv, kcfg = connector(case, pool, kvpool_key_format="mooncake", cache_prefix=prefix)
    try:
        vllm_caches.fill(kv, seed=3)
        meta = KeyMetadata(model_name="m", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0, cache_prefix=prefix)
        assert a._worker.keys.prefix == PoolKey.build_prefix(meta)
        hashes = new_hashes(2)
        save(a, hashes, [3, 1])
        upstream = RankLocalStoreLayout(meta, 64, 64)
        upstream.register_kv_caches(list(kv.values()), kcfg.num_blocks)
        c = Client(pool.addr, pool.api_key, fingerprint=pool.fingerprint)
        for h, bid in zip(hashes, [3, 1]):
            addrs, sizes = upstream.prepare_value_for_block(bid)
            want = b"".join(ctypes.string_at(p, n) for p, n in zip(addrs, sizes))
            ((st, got),) = c.get_batch([PoolKey.build_key_string(PoolKey.build_prefix(meta), h)])
            assert st == "ok" and bytes(got) == want
        # Another dtype under the same (format-less) keys: refused at registration.
        with pytest.raises(ValueError, match="another format"):
            connector(_case("FLASH_ATTN", "LBNHC", model_dtype=torch.float16), pool, kvpool_key_format="mooncake",
                      cache_prefix=prefix)
        # The same format again: accepted.
        connector(case, pool, kvpool_key_format="mooncake", cache_prefix=prefix)[0].shutdown()
    finally:
        a.shutdown()


def test_caches_that_do_not_match_the_spec_are_refused_at_registration(pool: Server) -> None:
    case = _case("FLASH_ATTN", "LBNHC")
    vc, kcfg, kv, _ = case.build()
    name = next(iter(kv))
    bad = dict(kv)
    bad[name] = kv[name][:, :2]  # two heads where the spec says four
    with pytest.raises(ValueError, match="head slots"):
        connector((vc, kcfg, bad), pool)
    bad[name] = [kv[name], None]
    with pytest.raises(ValueError, match="paged attention KV caches"):
        connector((vc, kcfg, bad), pool)
    bad[name] = kv[name].flatten(0, 1)
    with pytest.raises(ValueError, match="vLLM 0.32 hands"):
        connector((vc, kcfg, bad), pool)
