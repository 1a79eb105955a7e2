"""The connector's parts on their own: keys across parallel ranks, configuration (kvpool's and
Mooncake's names, environment, sizes), the staging path's ordering of device work, and the share
of saves of ranks that hold the same bytes. Needs vLLM (run by ``.ci/vllm-e2e.sh``)."""

from __future__ import annotations

import itertools
import threading
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool import _mooncake_config as mooncake
from kvpool.vllm.config import ConnectorConfig
from kvpool.vllm.keys import KeyLayout, model_name, replication_factor
from kvpool.vllm.metadata import KVPoolWorkerMetadata, SaveJob
from kvpool.vllm.transfer import HostOps, StagedMover

pytestmark = pytest.mark.vllm


# ---- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tp,pp,pcp,dcp,replication",
    [(1, 1, 1, 1, 1), (4, 1, 1, 1, 1), (4, 2, 1, 1, 2), (8, 1, 1, 1, 8), (2, 1, 2, 1, 1), (4, 1, 1, 2, 1),
     (8, 2, 2, 4, 1)],
)
def test_every_key_a_worker_writes_is_one_the_scheduler_looks_up(tp: int, pp: int, pcp: int, dcp: int,
                                                                 replication: int) -> None:
    layout = KeyLayout("m", tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp, replication=replication)
    written: dict[str, list[int]] = {}
    for t, p, c in itertools.product(range(tp), range(pp), range(pcp)):
        w = layout.writer(t, c, t % dcp if dcp > 1 else 0, p)
        assert w.step == replication
        written.setdefault(w.prefix, []).append(w.phase)
    assert set(written) == set(layout.lookup_prefixes())
    # Replicas of one key split its blocks: every position is saved by exactly one of them.
    for phases in written.values():
        assert sorted(phases) == list(range(replication))


def test_dcp_ranks_write_their_own_keys() -> None:
    # Workers used to write rank 0's decode-context-parallel key, so every lookup of dcp1 missed.
    layout = KeyLayout("m", tp_size=2, dcp_size=2)
    assert layout.writer(1, 0, 1, 0).prefix == "m@tp_rank:1@pcp0@dcp1@pp_rank:0@group:0"
    assert "m@tp_rank:1@pcp0@dcp1@pp_rank:0@group:0" in layout.lookup_prefixes()
    with pytest.raises(ValueError):
        layout.writer(1, 0, 0, 0)


def test_replication_of_mla_and_of_more_ranks_than_kv_heads() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    gqa = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert replication_factor(mla, 8, 1, 1) == 8, "an MLA cache is the same on every TP rank: stored once"
    assert replication_factor(gqa, 16, 8, 1) == 2
    assert replication_factor(gqa, 4, 8, 1) == 1
    assert replication_factor(mla, 8, 1, 2) == 1, "decode context parallel shards even MLA"
    layout = KeyLayout("ds", tp_size=8, replication=8)
    assert layout.lookup_prefixes() == ["ds@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"]


def test_the_model_part_of_keys_is_the_basename() -> None:
    assert model_name("/models/Qwen/Qwen3-8B/") == "Qwen3-8B"
    assert model_name("Qwen/Qwen3-8B") == "Qwen3-8B"
    layout = KeyLayout("Qwen3-8B", cache_prefix="prod", namespace="tenant:t1/")
    assert layout.model_prefix == "tenant:t1/prod@Qwen3-8B@"
    assert layout.prefix(0, 0, 0, 0).startswith(layout.model_prefix)


def test_replicas_share_the_saves_of_one_key() -> None:
    """Two TP ranks of an MLA model: one key prefix, each rank stores half the blocks."""
    from kvpool.vllm.worker import Worker

    class Record:
        block_bytes = 8

        def __init__(self) -> None:
            self.keys: list[str] = []

        def fence(self) -> None:
            return None

        def save(self, keys: list[str], *a: Any) -> list[str]:
            self.keys.extend(keys)
            return ["ok"] * len(keys)

    layout = KeyLayout("ds", tp_size=2, replication=2)
    cfg = ConnectorConfig(async_save=False)
    job = SaveJob(1, "r", [0, 1, 2, 3, 4], ["a", "b", "c", "d", "e"], [None, "a", "b", "c", "d"], [5, 6, 7, 8, 9])
    saved, metas = [], []
    for tp in (0, 1):
        w = Worker(cfg, layout.writer(tp, 0, 0, 0), 16, 32, f"w{tp}", client=_NoClient())
        w.mover = rec = Record()  # type: ignore[assignment]
        from kvpool.vllm.metadata import KVPoolConnectorMetadata

        w.wait_for_save(KVPoolConnectorMetadata(saves=[job]))
        saved.append(rec.keys)
        metas.append(w.build_worker_meta())
    assert saved[0] == ["ds@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + h for h in "ace"]
    assert saved[1] == ["ds@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + h for h in "bd"]
    agg = metas[0].aggregate(metas[1])
    assert isinstance(agg, KVPoolWorkerMetadata) and agg.done == {1: 2} and not agg.failed


class _NoClient:
    transport = "none"

    def close(self) -> None:
        pass


# ---- configuration ---------------------------------------------------------------------------


def test_mooncake_sizes_are_binary_as_mooncake_reads_them() -> None:
    assert mooncake.parse_size("4GB") == 4 << 30
    assert mooncake.parse_size("4 gb") == 4 << 30
    assert mooncake.parse_size("512M") == 512 << 20
    assert mooncake.parse_size("1.5 KB") == 1536
    assert mooncake.parse_size("3GiB") == 3 << 30
    assert mooncake.parse_size(1024) == 1024
    assert mooncake.parse_size("100") == 100
    for bad in ("4 GX", "", "four", "4Gi", "-1", True):
        with pytest.raises(ValueError):
            mooncake.parse_size(bad)


def test_mooncake_connector_names_are_honoured_or_refused() -> None:
    c = ConnectorConfig.from_extra({"cache_prefix": "prod", "lookup_async": "true", "enable_lookup": False,
                                    "save_decode_cache": True, "tenant_id": "team-a", "not_a_key": 1})
    assert (c.key_prefix, c.lookup_async, c.enable_lookup, c.save_decode_cache) == ("prod", True, False, True)
    assert c.namespace == "tenant:team-a/"
    assert c.ignored == ["not_a_key"]
    assert ConnectorConfig.from_extra({"load_async": False}).lookup_async is False
    assert ConnectorConfig.from_extra({"load_async": "true"}).load_async is True
    for bad, word in [({"preferred_segment": "node1"}, "preferred_segment"),
                      ({"key_prefix": "a", "cache_prefix": "b"}, "different prefixes"),
                      ({"kvpool_transport": "rdma"}, "kvpool_transport"),
                      ({"kvpool_lookup_lease_s": 0}, "lease"), ({"async_save": "maybe"}, "boolean")]:
        with pytest.raises(ValueError, match=word):
            ConnectorConfig.from_extra(bad)
    assert ConnectorConfig.from_extra({"tenant_id": "default"}).namespace == ""


def test_mooncake_environment_and_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("KVPOOL_SERVER", "MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", "pool.example:7100")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_DEVICE", "mlx5_0")
    monkeypatch.setenv("MOONCAKE_TENANT_ID", "team-b")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2GB")
    c = ConnectorConfig.from_extra({})
    assert (c.server, c.transport, c.namespace) == ("pool.example:7100", "auto", "tenant:team-b/")
    assert mooncake.load()["global_segment_size"] == 2 << 30
    # kvpool's own settings win over Mooncake's.
    c = ConnectorConfig.from_extra({"kvpool_server": "mine:1", "kvpool_transport": "quic", "tenant_id": "x"})
    assert (c.server, c.transport, c.namespace) == ("mine:1", "quic", "tenant:x/")
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "file.example:7100", "protocol": "tcp",
                             "local_buffer_size": "1GB", "tenant_id": "team-c"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(f))
    c = ConnectorConfig.from_extra({})
    assert (c.server, c.namespace) == ("file.example:7100", "tenant:team-c/")
    assert mooncake.load()["local_buffer_size"] == 1 << 30


# ---- the staging path ------------------------------------------------------------------------


class _Ops(HostOps):
    """Host "device" operations that record their order, as a CUDA stream's would matter."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.n = 0

    def stream(self) -> Any:
        log = self.log

        class Ctx:
            def __enter__(self) -> None:
                log.append("stream{")

            def __exit__(self, *a: Any) -> None:
                log.append("}")

        return Ctx()

    def wait(self, event: Any) -> None:
        self.log.append(f"wait:{event}")

    def record(self) -> Any:
        self.n += 1
        self.log.append(f"record:e{self.n}")
        return f"e{self.n}"

    def sync(self, event: Any) -> None:
        if event is not None:
            self.log.append(f"sync:{event}")


class _Pool:
    """The client calls a mover makes, on a dict; it copies bytes as a server would."""

    transport = "test"

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.store: dict[str, bytes] = {}

    def alloc_buffer(self, size: int) -> Any:
        from kvpool import KvpoolError

        raise KvpoolError("no shared memory here", "unsupported")

    def register(self, ptr: int, size: int) -> bool:
        return False

    def unregister(self, ptr: int) -> None:
        pass

    def put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], **kw: Any) -> list[str]:
        import ctypes

        self.log.append(f"put:{len(keys)}")
        for k, p, n in zip(keys, ptrs, sizes):
            self.store[k] = ctypes.string_at(p, n)
        return ["ok"] * len(keys)

    def get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[tuple[str, int]]:
        import ctypes

        self.log.append(f"get:{len(keys)}")
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            v = self.store.get(k)
            if v is None:
                out.append(("not-found", 0))
                continue
            ctypes.memmove(p, v, len(v))
            out.append(("ok", len(v)))
        return out


def _kv(blocks: int = 10) -> dict[str, torch.Tensor]:
    """Two layers of vLLM's logical [blocks, heads, states, content] shape (LBHNC, one head)."""
    return {f"l{i}": torch.arange(blocks * 12, dtype=torch.float32).reshape(blocks, 1, 2, 6) + 100 * i for i in range(2)}


def _image_of(kv: dict[str, torch.Tensor], b: int) -> bytes:
    """A block's pool object: every layer's [H][N][C] bytes in turn."""
    return b"".join(kv[n][b].numpy().tobytes() for n in sorted(kv))


def test_staged_moves_wait_for_the_forward_and_finish_before_reuse() -> None:
    from kvpool.vllm.layout import BlockImage

    log: list[str] = []
    pool = _Pool(log)
    kv = _kv()
    image = BlockImage.from_kv_caches(kv, 10)
    assert image.block_bytes == 96
    # Two chunks of two blocks: one for the transfer under way, one for the next device copy.
    m = StagedMover(pool, image, staging_bytes=4 * 96, ops=_Ops(log), chunk_blocks=2)  # type: ignore[arg-type]
    assert m.nchunks == 2
    keys = [f"k{b}" for b in range(5)]
    st = m.save(keys, [1, 3, 5, 7, 9], [None] * 5, [16] * 5, 16, fence="F")
    assert st == ["ok"] * 5
    # Each chunk: the copy stream waits for the forward, the copy is done before its transfer.
    assert log.count("wait:F") == 3
    assert log.index("sync:e1") < log.index("put:2")
    for b, src in enumerate([1, 3, 5, 7, 9]):
        assert pool.store[keys[b]] == _image_of(kv, src)
    # Load into other blocks; one key is missing and is reported, not loaded.
    log.clear()
    before = {n: t.clone() for n, t in kv.items()}
    ok = m.load(keys[:3] + ["missing"] + keys[3:], [0, 2, 4, 6, 8, 9])
    assert ok == [True, True, True, False, True, True]
    for src, dst in [(1, 0), (3, 2), (5, 4), (7, 8), (9, 9)]:
        for n in kv:
            assert torch.equal(kv[n][dst], before[n][src])
    assert torch.equal(kv["l0"][6], before["l0"][6]), "a block that failed to load is left alone"
    # Three rounds of two blocks through two chunks: the third round refills the first chunk only
    # after the device took what it held (its copy's event e4), and all copies are done before
    # the load returns.
    gets = [i for i, x in enumerate(log) if x.startswith("get:")]
    assert len(gets) == 3
    assert gets[1] < log.index("sync:e4") < gets[2]
    assert {"sync:e5", "sync:e6"} <= set(log[gets[2]:])


def test_a_load_during_a_save_never_lands_in_the_saves_slots() -> None:
    """Loads and saves run on threads of their own: a load while a save's transfer is under way
    (its blocks staged, not yet sent) must not write where the save reads."""
    from kvpool.vllm.layout import BlockImage

    log: list[str] = []
    pool = _Pool(log)
    kv = _kv()
    pool.store.update({f"other{b}": bytes([200 + b]) * 96 for b in range(2)})
    m = StagedMover(pool, BlockImage.from_kv_caches(kv, 10), staging_bytes=4 * 96, ops=_Ops(log),  # type: ignore[arg-type]
                    chunk_blocks=1)
    staged, go = threading.Event(), threading.Event()
    put = pool.put_from

    def slow_put(*a: Any, **k: Any) -> list[str]:
        staged.set()  # the save's blocks sit in the staging area now
        assert go.wait(10)
        return put(*a, **k)

    pool.put_from = slow_put  # type: ignore[method-assign]
    want = _image_of(kv, 1)
    saver = threading.Thread(target=m.save, args=(["s0"], [1], [None], [16], 16, "F"))
    saver.start()
    assert staged.wait(10)
    assert m.load(["other0"], [4]) == [True]  # lands while the save waits to send
    go.set()
    saver.join(10)
    assert pool.store["s0"] == want, "the save sent what the load brought in"


def test_many_loads_and_saves_share_few_chunks_at_once() -> None:
    """Eight loads and a save at once through two chunks: none waits on another in a circle,
    every one lands where it should."""
    from kvpool.vllm.layout import BlockImage

    pool = _Pool([])
    kv = _kv(40)
    m = StagedMover(pool, BlockImage.from_kv_caches(kv, 40), staging_bytes=4 * 96, ops=HostOps(),  # type: ignore[arg-type]
                    chunk_blocks=2)
    for b in range(16):
        pool.store[f"k{b}"] = _image_of(kv, b)
    results: dict[int, list[bool]] = {}

    def load(t: int) -> None:
        results[t] = m.load([f"k{2 * t}", f"k{2 * t + 1}", "nope", f"k{(2 * t + 5) % 16}"],
                            [20 + 2 * t, 21 + 2 * t, 39, 6 + t])

    threads = [threading.Thread(target=load, args=(t,)) for t in range(8)]
    threads.append(threading.Thread(target=m.save, args=([f"s{b}" for b in range(6)], list(range(6)),
                                                          [None] * 6, [16] * 6, 16, None)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a load or save never finished"
    assert all(r == [True, True, False, True] for r in results.values())
    assert [pool.store[f"s{b}"] for b in range(6)] == [_image_of(kv, b) for b in range(6)]


# ---- what a block's bytes mean ---------------------------------------------------------------


def test_the_format_digest_tells_apart_what_byte_sizes_cannot() -> None:
    import torch as t
    from vllm_caches import Case

    from kvpool.vllm.layout import kv_format

    def digest(backend: str, layout: str, cache_dtype: str = "auto", dtype: Any = t.bfloat16) -> str:
        vc, kcfg, _, _ = Case(backend, layout, cache_dtype, 64, model_dtype=dtype).build()
        return kv_format(vc, kcfg).digest

    base = digest("FLASH_ATTN", "LBNHC")
    assert base == digest("FLASH_ATTN", "LBNHC"), "one configuration, one digest"
    assert base == digest("FLASH_ATTN", "LBHNC"), "the layout changes where bytes lie, not what they mean"
    assert base != digest("FLASH_ATTN", "LBNHC", dtype=t.float16)
    assert digest("TRITON_ATTN", "LBNHC", "fp8_e4m3") != digest("TRITON_ATTN", "LBNHC", "fp8_e5m2")
    assert digest("TRITON_ATTN", "LBNHC", "fp8") == digest("TRITON_ATTN", "LBNHC", "fp8_e4m3")
    assert base != digest("ROCM_ATTN", "LBHNC"), "ROCm packs K and V as two head slots"


def test_vllms_name_for_the_load_failure_policy_is_honoured_in_the_extra_config() -> None:
    assert ConnectorConfig.from_extra({}).load_failure_policy == "recompute"
    assert ConnectorConfig.from_extra({"kv_load_failure_policy": "fail"}).load_failure_policy == "fail"
    assert ConnectorConfig.from_extra({"kvpool_load_failure_policy": "fail"}).load_failure_policy == "fail"
    with pytest.raises(ValueError, match="disagree"):
        ConnectorConfig.from_extra({"kv_load_failure_policy": "fail", "kvpool_load_failure_policy": "recompute"})
    for bad, word in [({"kvpool_key_format": "x"}, "key_format"), ({"kvpool_load_threads": 0}, "load_threads"),
                      ({"kvpool_save_pin_limit": -1}, "pin_limit")]:
        with pytest.raises(ValueError, match=word):
            ConnectorConfig.from_extra(bad)


def test_kvpools_fields_in_mooncakes_config_file_reach_the_connector(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    for k in ("KVPOOL_SERVER", "KVPOOL_API_KEY", "KVPOOL_FINGERPRINT", "KVPOOL_DATA_DIR", "MOONCAKE_MASTER"):
        monkeypatch.delenv(k, raising=False)
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "pool.example:7100", "kvpool_api_key": "k1",
                             "kvpool_fingerprint": "ab" * 32, "kvpool_data_dir": "/var/lib/kvpool"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(f))
    c = ConnectorConfig.from_extra({})
    assert (c.server, c.api_key, c.fingerprint, c.data_dir) == ("pool.example:7100", "k1", "ab" * 32, "/var/lib/kvpool")
    # kvpool's own settings still win.
    assert ConnectorConfig.from_extra({"kvpool_api_key": "k2"}).api_key == "k2"


def test_an_explicit_failure_policy_is_read_from_vllm_serves_command_line() -> None:
    from kvpool.vllm.config import command_line_failure_policy as policy

    cfg = '{"kv_connector": "KVPoolConnector", "kv_load_failure_policy": "fail"}'
    assert policy(["vllm", "serve", "m", "--kv-transfer-config", cfg]) == "fail"
    assert policy(["vllm", "serve", "m", f"--kv-transfer-config={cfg}"]) == "fail"
    assert policy(["vllm", "serve", "--kv-transfer-config.kv_load_failure_policy", "fail"]) == "fail"
    assert policy(["vllm", "serve", "--kv-transfer-config", '{"kv_connector": "X"}']) is None
    assert policy(["python", "script.py"]) is None
