"""Mooncake Store's consumers, driven through their own code, on a kvpool server through kvpool's
alias of ``mooncake.store`` (``kvpool.mooncake_alias``): SGLang 0.5.23's HiCache ``MooncakeStore``
over a real SGLang host KV pool (``MHATokenToKVPoolHost`` on CPU), and LMCache 0.5.6's
``mooncakestore://`` remote connector. An SGLang or LMCache *engine* needs a GPU here; what runs
is each project's storage class, with its own key naming, buffer registration, batching and
existence checks, against a real kvpool server. Needs the vLLM venv (torch) with the ``sglang``
and ``lmcache`` wheels (``examples/vllm_prefix_reuse/setup_venv.sh`` installs them); run by
``.ci/vllm-e2e.sh``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from conftest import Server

from kvpool import _mooncake_alias

pytestmark = pytest.mark.vllm

PAGE = 16


@pytest.fixture
def alias() -> Iterator[None]:
    """``mooncake.store`` served by kvpool in this process (as the ``.pth`` makes it for a
    whole environment)."""
    for name in ("mooncake", "mooncake.store"):
        sys.modules.pop(name, None)
    _mooncake_alias.activate("kvpool")
    try:
        yield
    finally:
        _mooncake_alias.deactivate()
        for name in ("mooncake", "mooncake.store"):
            sys.modules.pop(name, None)


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    s = Server()
    # Mooncake's own configuration file, with kvpool's credentials beside its fields.
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"master_server_address": s.addr, "metadata_server": "P2PHANDSHAKE",
                               "protocol": "tcp", "device_name": "", "global_segment_size": 64 << 20,
                               "local_buffer_size": 16 << 20, "kvpool_data_dir": str(s.dir)}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(cfg))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(cfg))
    yield s
    s.stop()


def _host_pool(seed: int, allocator: str = "default") -> Any:
    """An SGLang host KV pool on CPU (page_first), as HiCache builds it from a device pool;
    ``allocator="mooncake"`` allocates it with ``MooncakeHostMemAllocator`` (standalone mode)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
                           device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE, "page_first", pin_memory=False,
                                device="cpu", allocator_type=allocator, device_capacity_tokens=256,
                                start_layer=0, end_layer=3)
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
    return host


def _sglang_store(host: Any, pool: Server) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="tiny/model")
    store = MooncakeStore(cfg, mem_pool=host)
    store.register_mem_pool_host(host)
    return store


def test_sglangs_mooncake_store_sets_and_gets_pages_of_its_host_pool(alias: None, pool: Server) -> None:
    src = _host_pool(1)
    a = _sglang_store(src, pool)
    keys = [f"page-{i}" for i in range(6)]
    indices = torch.arange(PAGE, PAGE * 7)  # pages 1..6 of the host pool
    assert a.batch_set_v1(keys, indices) == [True] * 6
    assert a.batch_exists(keys) == 6
    assert a.batch_exists(keys[:3] + ["missing"] + keys[3:]) == 3, "leading pages present"
    # A second pool (another process's) reads them into other pages.
    dst = _host_pool(2)
    b = _sglang_store(dst, pool)
    out = torch.arange(PAGE * 10, PAGE * 16)
    assert b.batch_get_v1(keys, out) == [True] * 6
    sp, _ = src.get_page_buffer_meta(indices)
    dp, _ = dst.get_page_buffer_meta(out)
    ks = src.get_ksize_per_token() * PAGE
    import ctypes

    assert all(ctypes.string_at(p, ks) == ctypes.string_at(q, ks) for p, q in zip(sp, dp))
    # Setting the same pages again stores nothing twice (it checks existence first).
    assert a.batch_set_v1(keys, indices) == [True] * 6
    a.close()
    b.close()


def test_sglangs_standalone_mode_allocates_with_mooncakes_allocator_and_stores(alias: None, pool: Server,
                                                                               tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's standalone mode: the host pool allocated by ``MooncakeHostMemAllocator``, the
    store set up with ``setup_dummy`` (a separate Mooncake client process would own the pool in
    Mooncake; a kvpool client needs none), pages stored and read back."""
    import os

    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeHostTensorAllocator

    cfg = json.loads(Path(os.environ["MOONCAKE_CONFIG_PATH"]).read_text())
    cfg.update(standalone_storage=True, client_server_address=pool.addr, global_segment_size=0)
    f = tmp_path / "standalone.json"
    f.write_text(json.dumps(cfg))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(f))
    src = _host_pool(3, allocator="mooncake")
    assert isinstance(src.allocator, MooncakeHostTensorAllocator)
    a = _sglang_store(src, pool)
    keys = [f"solo-{i}" for i in range(3)]
    assert a.batch_set_v1(keys, torch.arange(PAGE, PAGE * 4)) == [True] * 3
    dst = _host_pool(4, allocator="mooncake")
    b = _sglang_store(dst, pool)
    assert b.batch_get_v1(keys, torch.arange(PAGE * 5, PAGE * 8)) == [True] * 3
    sp, _ = src.get_page_buffer_meta(torch.arange(PAGE, PAGE * 4))
    dp, _ = dst.get_page_buffer_meta(torch.arange(PAGE * 5, PAGE * 8))
    import ctypes

    n = src.get_ksize_per_token() * PAGE
    assert all(ctypes.string_at(p, n) == ctypes.string_at(q, n) for p, q in zip(sp, dp))


def test_lmcaches_mooncakestore_connector_round_trips_a_chunk(alias: None, pool: Server) -> None:
    """LMCache's ``mooncakestore://`` remote connector, built as LMCache builds it (its config,
    metadata and CPU backend), puts a KV chunk and reads it back through its default read path
    (``batch_get_buffer``: a ``BufferHandle`` read without an extra copy)."""
    import asyncio
    import threading

    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.mooncakestore_connector import MooncakestoreConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True, max_local_cpu_size=0.2,
                                            remote_url="mooncakestore://localhost:0/", remote_serde="naive")
    meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2, 16))
    backend = LocalCPUBackend(cfg, meta)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    conn = MooncakestoreConnector(loop, backend, cfg)
    try:
        objs, keys, want = [], [], []
        for i in range(3):
            obj = backend.allocate(torch.Size([2, 2, 256, 32]), torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
            obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
            objs.append(obj)
            want.append(obj.tensor.clone())
            keys.append(CacheEngineKey("m", 1, 0, 1000 + i, torch.bfloat16))
        for k, o in zip(keys, objs):
            run(conn.put(k, o))
        assert all(run(conn.exists(k)) for k in keys)
        assert conn.support_batched_get()
        got = run(conn.batched_get(keys + [CacheEngineKey("m", 1, 0, 99, torch.bfloat16)]))
        assert got[-1] is None, "a missing chunk reads as None"
        for g, w in zip(got, want):
            assert g is not None and torch.equal(g.tensor, w)
    finally:
        run(conn.close()) if asyncio.iscoroutinefunction(conn.close) else conn.close()
        loop.call_soon_threadsafe(loop.stop)


def test_kvpools_native_hicache_backend_through_sglangs_dynamic_loader(pool: Server) -> None:
    """``kvpool.sglang.KVPoolHiCacheStorage`` loaded by SGLang's own backend factory (``dynamic``),
    over a real SGLang host pool: pages stored with their prefix links, found with one lookup,
    read back into other pages byte for byte."""
    import ctypes

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    def backend(host: Any) -> Any:
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                   is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                   model_name="tiny/model",
                                   extra_config={"backend_name": "kvpool", "module_path": "kvpool.sglang",
                                                 "class_name": "KVPoolHiCacheStorage",
                                                 "kvpool_data_dir": str(pool.dir)})
        b = StorageBackendFactory.create_backend("dynamic", cfg, host)
        b.register_mem_pool_host(host)
        return b

    src, dst = _host_pool(5), _host_pool(6)
    a, b = backend(src), backend(dst)
    assert type(a).__name__ == "KVPoolHiCacheStorage"
    keys = [f"native-{i}" for i in range(5)]
    assert a.batch_set_v1(keys, torch.arange(PAGE, PAGE * 6)) == [True] * 5
    lookups = []
    inner = b.client

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def lookup(self, chain: list[str]) -> int:
            lookups.append(len(chain))
            return inner.lookup(chain)

    b.client = Counting()
    assert b.batch_exists(keys) == 5 and b.batch_exists(keys[:2] + ["gone"] + keys[2:]) == 2
    assert lookups == [5, 6], "one lookup request per batch_exists"
    assert b.batch_get_v1(keys, torch.arange(PAGE * 8, PAGE * 13)) == [True] * 5
    sp, _ = src.get_page_buffer_meta(torch.arange(PAGE, PAGE * 6))
    dp, _ = dst.get_page_buffer_meta(torch.arange(PAGE * 8, PAGE * 13))
    n = src.get_ksize_per_token() * PAGE
    assert all(ctypes.string_at(p, n) == ctypes.string_at(q, n) for p, q in zip(sp, dp))
    # Another client finds the whole chain in one lookup.
    from kvpool import Client

    c = Client(data_dir=str(pool.dir))
    assert c.lookup([a._key(k) for k in keys]) == 5
    a.clear()
    assert b.batch_exists(keys) == 0
    a.close()
    b.close()


@pytest.mark.parametrize("l1", [True, False], ids=["l1-registered", "copied"])
def test_kvpools_lmcache_l2_adapter_through_lmcaches_plugin_factory(pool: Server, l1: bool) -> None:
    """``kvpool.lmcache.KVPoolL2Adapter`` built by LMCache's own plugin factory, driven as its L2
    controllers drive an adapter (submit, wait on the event fd, collect): chunks stored, the
    leading ones found and held by one lookup (the pool refuses to remove them while held),
    unlocked, loaded into other buffers byte for byte."""
    import select

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    from kvpool import Client

    arena = torch.zeros(8 * 4096, dtype=torch.uint8)

    class Obj:
        """The parts of LMCache's MemoryObj an L2 adapter uses, over one arena (LMCache's L1)."""

        def __init__(self, i: int) -> None:
            self.t = arena[i * 4096 : (i + 1) * 4096]
            self.data_ptr = self.t.data_ptr()
            self.byte_array = memoryview(self.t.numpy())

        def get_size(self) -> int:
            return 4096

    cfg = get_l2_adapter_config_class("plugin").from_dict(
        {"type": "plugin", "module_path": "kvpool.lmcache", "class_name": "KVPoolL2Adapter",
         "adapter_params": {"kvpool_data_dir": str(pool.dir), "kvpool_lock_s": 30}})
    desc = L1MemoryDesc(ptr=arena.data_ptr(), size=arena.numel(), align_bytes=4096) if l1 else None
    a = create_l2_adapter_from_registry(cfg, desc)
    assert type(a).__name__ == "KVPoolL2Adapter" and (a._l1 is not None) == l1

    def wait(fd: int) -> None:
        assert select.select([fd], [], [], 10)[0], "no completion signalled"
        import os

        os.read(fd, 8)

    keys = [ObjectKey(bytes([i]) * 8, "m", 0) for i in range(4)]
    src = [Obj(i) for i in range(4)]
    for i, o in enumerate(src):
        o.t.copy_(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(i), dtype=torch.uint8))
    task = a.submit_store_task(keys, src)
    wait(a.get_store_event_fd())
    res = a.pop_completed_store_tasks()
    assert res[task].is_successful() and res[task].bytes_transferred() == 4 * 4096
    probe = keys[:2] + [ObjectKey(b"\xff" * 8, "m", 0)] + keys[2:]
    task = a.submit_lookup_and_lock_task(probe, {})
    wait(a.get_lookup_and_lock_event_fd())
    bm = a.query_lookup_and_lock_result(task)
    assert bm.count_leading_ones() == 2 and a.query_lookup_and_lock_result(task) is None
    c = Client(data_dir=str(pool.dir))
    assert c.remove([a._key(keys[0])]) == ["leased"], "a locked chunk was not held"
    a.submit_unlock(keys[:2])
    import time

    deadline = time.monotonic() + 5
    while c.remove([a._key(keys[1])], force=False) == ["leased"]:
        assert time.monotonic() < deadline, "unlock did not end the hold"
        time.sleep(0.05)
    dst = [Obj(4 + i) for i in range(4)]
    task = a.submit_load_task([keys[0], keys[2], keys[3], keys[1]], dst)
    wait(a.get_load_event_fd())
    bm = a.query_load_result(task)
    assert [bm.test(i) for i in range(4)] == [True, True, True, False], "the removed chunk loads nothing"
    assert torch.equal(dst[0].t, src[0].t) and torch.equal(dst[1].t, src[2].t) and torch.equal(dst[2].t, src[3].t)
    a.close()
