"""The Mooncake-compatible store against a real kvpool server, on both data paths.

Every test using ``store`` runs twice: ``tcp`` (Mooncake's protocol name: same-host shared memory
here) and ``quic`` (bytes in band over QUIC).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import threading
import time

import numpy as np
import pytest

import kvpool
from kvpool.mooncake import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    NOT_SUPPORTED,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    TASK_NOT_FOUND,
    KVPoolStore,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
)

from conftest import Server



def test_put_get_upsert_and_batches(store: MooncakeDistributedStore) -> None:
    assert store.put("a", b"alpha") == 0
    assert store.get("a") == b"alpha"
    # As Mooncake: a second put succeeds and keeps the first value.
    assert store.put("a", b"other") == 0
    assert store.get("a") == b"alpha"
    assert store.put("empty", b"") == INVALID_PARAMS and store.is_exist("empty") == 0
    assert store.put("u", b"first") == 0
    assert store.upsert("u", b"replaced") == 0
    assert store.get("u") == b"replaced"
    assert store.upsert("new", b"inserted") == 0 and store.get("new") == b"inserted"
    assert store.get("missing") == b""
    values = [os.urandom(n) for n in (1, 4096, 300_000)]
    keys = [f"batch/{i}" for i in range(len(values))]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys + ["nope"]) == values + [b""]
    # Existing keys keep their values; an empty value fails the whole batch.
    assert store.put_batch(["fresh", keys[1]], [b"f", b"x"]) == 0
    assert store.get("fresh") == b"f" and store.get(keys[1]) == values[1]
    assert store.put_batch(["fresh2", "empty"], [b"f", b""]) == INVALID_PARAMS
    assert store.batch_is_exist(["fresh2", "empty"]) == [0, 0]
    assert store.upsert_batch(["ub0", "ub1"], [b"u0", b"u1"]) == 0
    assert store.upsert_batch(["ub0", "ub1"], [b"v0", b"v1"]) == 0
    assert store.get_batch(["ub0", "ub1"]) == [b"v0", b"v1"]
    # numpy arrays and memoryviews are buffers too.
    arr = np.arange(1000, dtype=np.float32)
    assert store.put("np", arr) == 0
    assert np.array_equal(np.frombuffer(store.get("np"), dtype=np.float32), arr)
    assert store.put("mv", memoryview(b"view")) == 0 and store.get("mv") == b"view"


def test_exist_size_remove(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["x", "y"], [b"12345", b"1"]) == 0
    assert store.is_exist("x") == 1
    assert store.is_exist("z") == 0
    assert store.batch_is_exist(["x", "z", "y"]) == [1, 0, 1]
    assert store.get_size("x") == 5
    assert store.get_size("y") == 1
    assert store.get_size("z") == OBJECT_NOT_FOUND
    # get_size leases the block like a read (as Mooncake's does): removing it needs force.
    assert store.remove("x") == OBJECT_HAS_LEASE
    assert store.remove("x", force=True) == 0
    assert store.remove("x") == OBJECT_NOT_FOUND
    assert store.batch_remove(["y", "z"], True) == [0, OBJECT_NOT_FOUND]
    assert store.batch_is_exist(["x", "y"]) == [0, 0]
    assert store.put_batch([f"r{i}" for i in range(10)], [b"v"] * 10) == 0
    assert store.remove_all() == 10
    assert store.remove_all() == 0


def test_lease_blocks_remove_until_forced(store: MooncakeDistributedStore) -> None:
    assert store.put("leased", b"v" * 100) == 0
    # is_exist never leases (Mooncake's does): remove succeeds right after it.
    assert store.is_exist("leased") == 1
    assert store.remove("leased") == 0
    assert store.put("leased", b"v" * 100) == 0
    assert store.get("leased") == b"v" * 100  # grants a read lease (5 s default)
    assert store.remove("leased") == OBJECT_HAS_LEASE
    # As Mooncake, upsert replaces a leased value (kvpool drops the leased block, then stores).
    assert store.upsert("leased", b"new") == 0
    assert store.get("leased") == b"new"
    assert store.remove("leased", force=True) == 0


def test_lookup_counts_the_resident_prefix(store: MooncakeDistributedStore) -> None:
    chain = [f"chain/{i}" for i in range(8)]
    assert store.lookup(chain) == 0
    assert store.put_batch(chain[:5], [b"kv"] * 5) == 0
    assert store.lookup(chain) == 5
    assert store.remove(chain[2]) == 0
    assert store.lookup(chain) == 2, "a gap ends the resident prefix"
    assert store.lookup([]) == 0


def test_registered_buffers_and_zero_copy(store: MooncakeDistributedStore) -> None:
    buf = store.alloc_buffer(4 << 20)
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert arr.size == 4 << 20 and arr.ctypes.data == buf.address
    assert store.register_buffer(buf.address, buf.size) == 0
    assert store.client.registered() == [(buf.address, buf.size, True)]
    rng = np.random.default_rng(7)
    arr[: 1 << 20] = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    base = buf.address
    # Two 512 KiB values out of the first MiB, into the second MiB.
    keys = ["zc/0", "zc/1"]
    assert store.batch_put_from(keys, [base, base + (512 << 10)], [512 << 10] * 2) == [0, 0]
    assert store.batch_get_into(keys, [base + (2 << 20), base + (3 << 20)], [1 << 20] * 2) == [512 << 10] * 2
    assert np.array_equal(arr[2 << 20 : (2 << 20) + (512 << 10)], arr[: 512 << 10])
    assert np.array_equal(arr[3 << 20 : (3 << 20) + (512 << 10)], arr[512 << 10 : 1 << 20])
    # Single-key forms, and the value-larger-than-buffer code.
    assert store.put_from("zc/2", base, 100) == 0
    assert store.get_into("zc/2", base + (2 << 20), 100) == 100
    assert store.get_into("zc/2", base + (2 << 20), 99) == INVALID_PARAMS  # Mooncake's code
    assert store.get_into("zc/missing", base, 10) == OBJECT_NOT_FOUND
    assert store.put_from("zc/2", base + 1, 100) == 0  # exists: kept, as Mooncake
    assert store.get("zc/2") == arr[:100].tobytes()
    assert store.upsert_from("zc/2", base + 1, 50) == 0  # replaces, though read just now
    assert store.get("zc/2") == arr[1:51].tobytes()
    assert store.put_from("zc/4", base, 0) == INVALID_PARAMS
    assert store.upsert_from("zc/3", base + 1, 50) == 0 and store.get_size("zc/3") == 50
    assert store.unregister_buffer(buf.address) == 0
    assert store.unregister_buffer(buf.address) == INVALID_PARAMS


def test_plain_numpy_memory_and_multi_buffers(store: MooncakeDistributedStore) -> None:
    """Ordinary numpy memory (not a kvpool buffer): the staged path, and multi-buffer values
    gathered from scattered layers the way a KV connector stores one block of every layer."""
    layers = [np.random.default_rng(i).standard_normal((16, 256), dtype=np.float32) for i in range(4)]
    dest = [np.zeros_like(x) for x in layers]
    for a in layers + dest:
        assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    row = 256 * 4
    keys = [f"blk/{b}" for b in range(16)]
    ptrs = [[a.ctypes.data + b * row for a in layers] for b in range(16)]
    sizes = [[row] * 4 for _ in range(16)]
    assert store.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * 16
    assert store.get_size("blk/3") == 4 * row
    assert store.get("blk/3") == b"".join(a[3].tobytes() for a in layers)
    dptrs = [[a.ctypes.data + b * row for a in dest] for b in range(16)]
    assert store.batch_get_into_multi_buffers(keys, dptrs, sizes) == [4 * row] * 16
    for a, d in zip(layers, dest):
        assert np.array_equal(a, d)
    # Contiguous pieces (one block of one layer split in two) coalesce into one range.
    assert store.batch_put_from_multi_buffers(["half"], [[layers[0].ctypes.data, layers[0].ctypes.data + 512]],
                                              [[512, 512]]) == [0]
    assert store.get("half") == layers[0][0].tobytes()
    # Plain single-range forms.
    assert store.batch_put_from(["p0"], [layers[1].ctypes.data], [row]) == [0]
    dest[1][:] = 0
    assert store.batch_get_into(["p0"], [dest[1].ctypes.data + row], [row]) == [row]
    assert np.array_equal(dest[1][1], layers[1][0])
    for a in layers + dest:
        assert store.unregister_buffer(a.ctypes.data) == 0


def test_unregistered_and_out_of_range_addresses_are_refused(store: MooncakeDistributedStore) -> None:
    """Addresses outside the registered ranges answer -600 and are never dereferenced: the
    process must survive addresses that would segfault."""
    a = np.zeros(4096, dtype=np.uint8)
    p = a.ctypes.data
    assert store.put("k", b"x" * 64) == 0
    assert store.put_from("u", p, 16) == INVALID_PARAMS  # nothing registered yet
    assert store.get_into("k", 8, 64) == INVALID_PARAMS  # address 8 would segfault
    assert store.register_buffer(p, 4096) == 0
    assert store.register_buffer(p + 100, 10) == INVALID_PARAMS  # overlaps
    assert store.register_buffer(0, 10) == INVALID_PARAMS
    assert store.register_buffer(p + 8192, 0) == INVALID_PARAMS
    assert store.put_from("u", p + 4090, 16) == INVALID_PARAMS  # runs past the end
    assert store.put_from("u", p - 1, 16) == INVALID_PARAMS  # starts before
    assert store.get_into("k", p + 4095, 64) == INVALID_PARAMS
    assert store.batch_get_into(["k", "k"], [p, 0xDEAD0000], [64, 64]) == [64, INVALID_PARAMS]
    # Two destinations of one call that overlap: refused as a whole.
    assert store.batch_get_into(["k", "k"], [p, p + 32], [64, 64]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers(["m"], [[p, 0x10]], [[8, 8]]) == [INVALID_PARAMS]
    assert store.is_exist("u") == 0 and store.is_exist("m") == 0
    assert store.batch_put_from(["a", "b"], [p], [1]) == [INVALID_PARAMS] * 2  # length mismatch
    assert store.unregister_buffer(p) == 0
    assert store.get_into("k", p, 64) == INVALID_PARAMS


def _mmap(size: int, prot: int) -> int:
    """An anonymous private mapping with these protections (PROT_NONE: what CUDA and Ascend
    runtimes reserve device address ranges with)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
    p = libc.mmap(None, size, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    assert p not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    return int(p)


def _munmap(p: int, size: int) -> None:
    libc = ctypes.CDLL(None)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap(ctypes.c_void_p(p), size)


def test_device_pointers_are_refused_at_registration(store: MooncakeDistributedStore) -> None:
    """A device pointer (a number in a range the host may not touch) given to register_buffer is
    an error, never read: the process used to die on the first put_from of one."""
    PROT_NONE, PROT_READ = 0, 1
    size = 1 << 20
    none, ro, gone = _mmap(size, PROT_NONE), _mmap(size, PROT_READ), _mmap(size, PROT_READ | 2)
    _munmap(gone, size)
    try:
        for ptr, why in [(none, "---p"), (ro, "r--p"), (gone, "not mapped"), (0xDEAD0000, "not mapped")]:
            assert store.register_buffer(ptr, size) == INVALID_PARAMS
            with pytest.raises(kvpool.KvpoolError) as e:
                store.client.register(ptr, size)
            assert e.value.code == "invalid-argument" and why in str(e.value), str(e.value)
            assert store.put_from("dev", ptr, 64) == INVALID_PARAMS
        # Host memory right next to a refused range is fine, and the client serves on.
        a = np.arange(4096, dtype=np.uint8)
        assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
        assert store.put_from("host", a.ctypes.data, 4096) == 0
        assert store.get("host") == a.tobytes()
        assert store.unregister_buffer(a.ctypes.data) == 0
    finally:
        _munmap(none, size)
        _munmap(ro, size)


def test_sixteen_threads_share_one_client(store: MooncakeDistributedStore) -> None:
    """16 threads, one client: puts, gets, zero-copy transfers and lookups at once. Every thread
    checks its own bytes; a wrong value, an exception or a hang fails the test."""
    buf = store.alloc_buffer(16 * 2 * 65536)
    assert store.register_buffer(buf.address, buf.size) == 0
    view = np.frombuffer(buf, dtype=np.uint8)
    errors: list[str] = []
    barrier = threading.Barrier(16)

    def work(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            barrier.wait(30)
            for i in range(20):
                vals = [rng.bytes(int(rng.integers(1, 50_000))) for _ in range(4)]
                keys = [f"t{t}/i{i}/{j}" for j in range(4)]
                if store.put_batch(keys, vals) != 0:
                    errors.append(f"thread {t}: put_batch failed")
                    return
                if store.get_batch(keys) != vals:
                    errors.append(f"thread {t}: get_batch returned other bytes")
                    return
                if store.lookup(keys) != 4:
                    errors.append(f"thread {t}: lookup")
                    return
                own = buf.address + t * 2 * 65536
                src = view[t * 2 * 65536 : t * 2 * 65536 + 65536]
                src[:] = rng.integers(0, 256, 65536, dtype=np.uint8)
                k = f"t{t}/zc/{i}"
                if store.put_from(k, own, 65536) != 0 or store.get_into(k, own + 65536, 65536) != 65536:
                    errors.append(f"thread {t}: zero-copy round trip failed")
                    return
                if not np.array_equal(view[t * 2 * 65536 + 65536 : (t + 1) * 2 * 65536], src):
                    errors.append(f"thread {t}: zero-copy bytes differ")
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {e!r}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert errors == []
    assert store.unregister_buffer(buf.address) == 0


def test_gil_is_released_during_calls(server: Server) -> None:
    """While one thread waits in a slow kvpool call, another Python thread keeps running."""
    c = kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint, transport="quic")
    big = os.urandom(16 << 20)
    ticks = 0
    done = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    before = ticks
    for i in range(4):
        assert c.put_batch([f"gil/{i}"], [big]) == ["ok"]
    done.set()
    t.join()
    assert ticks - before > 1000, "the spinning thread barely ran: the GIL was held during the calls"
    assert c.remove([f"gil/{i}" for i in range(4)], True) == ["ok"] * 4
    c.close()


def test_health_check_and_close(server: Server) -> None:
    st = KVPoolStore()
    assert st.health_check() == 1
    assert st.setup("localhost", "", 0, 0, "tcp", "", server.addr, api_key=server.api_key,
                    fingerprint=server.fingerprint) == 0
    assert st.health_check() == 0
    assert st.close() == 0
    assert st.health_check() == 1
    assert st.get("x") == b"" and st.put("x", b"1") < 0 and st.is_exist("x") == -1


def test_health_check_reports_an_unreachable_server() -> None:
    s = Server()
    st = MooncakeDistributedStore()
    assert st.setup("localhost", "", 0, 0, "quic", "", s.addr, api_key=s.api_key, fingerprint=s.fingerprint,
                    timeout=2.0) == 0
    assert st.health_check() == 0
    s.stop()
    assert st.health_check() == 2
    assert st.put("x", b"1") < 0
    st.close()


def test_setup_errors(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MOONCAKE_CONFIG_PATH", "KVPOOL_API_KEY", "KVPOOL_API_KEY_FILE", "KVPOOL_FINGERPRINT", "KVPOOL_CA",
                "KVPOOL_DATA_DIR", "KVPOOL_SERVER"):
        monkeypatch.delenv(var, raising=False)
    st = MooncakeDistributedStore()
    # Nothing to authenticate with: the log names each missing setting and where to give it.
    with caplog.at_level(logging.ERROR, "kvpool.mooncake"):
        assert st.setup("localhost", "", 0, 0, "tcp", "", "127.0.0.1:9") == INVALID_PARAMS
    assert "an API key (kvpool_api_key" in caplog.text and "KVPOOL_API_KEY" in caplog.text
    assert "fingerprint or a CA" in caplog.text and "address" not in caplog.text.split("kvpool needs")[1].split(";")[0]
    caplog.clear()
    assert st.setup("localhost", "", 0, 0, "tcp", "", "", api_key="k") == INVALID_PARAMS
    assert "the kvpool server's address (master_server_address" in caplog.text
    assert st.setup("localhost", "", "lots", 0, "tcp", "", "127.0.0.1:9", api_key="k",  # type: ignore[arg-type]
                    fingerprint="00" * 32) == INVALID_PARAMS
    # Nobody listens there: Mooncake's code for a master it cannot reach (-1), and the log says
    # which server and where its address came from.
    caplog.clear()
    assert st.setup("localhost", "", 0, 0, "quic", "", "127.0.0.1:9", api_key="k", fingerprint="00" * 32,
                    timeout=1.0) == INTERNAL_ERROR
    assert "cannot connect to the kvpool server 127.0.0.1:9 (from master_server_addr)" in caplog.text
    assert st.health_check() == 1


def test_setup_from_mooncake_config_file_and_dict(server: Server, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "1GiB",
        "local_buffer_size": 134217728,
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": server.addr,
    }
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(cfg))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    monkeypatch.setenv("KVPOOL_API_KEY", server.api_key)
    monkeypatch.setenv("KVPOOL_FINGERPRINT", server.fingerprint)
    st = MooncakeDistributedStore()
    assert st.setup() == 0
    assert st.put("cfg", b"1") == 0 and st.get("cfg") == b"1"
    st.close()
    monkeypatch.delenv("KVPOOL_API_KEY")
    monkeypatch.delenv("KVPOOL_FINGERPRINT")
    # The data directory alone is enough on the server's host.
    monkeypatch.setenv("KVPOOL_DATA_DIR", str(server.dir))
    st2 = MooncakeDistributedStore()
    assert st2.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}) == 0
    assert st2.get("cfg") == b"1"
    assert st2.remove("cfg", force=True) == 0
    st2.close()


def test_credentials_in_the_mooncake_config_file(server: Server, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's connector reads MOONCAKE_CONFIG_PATH itself and passes its fields positionally: the
    file's kvpool_* fields still reach setup, and a missing one is named with the file."""
    for var in ("KVPOOL_API_KEY", "KVPOOL_API_KEY_FILE", "KVPOOL_FINGERPRINT", "KVPOOL_CA", "KVPOOL_DATA_DIR",
                "KVPOOL_SERVER"):
        monkeypatch.delenv(var, raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(server.api_key + "\n")
    cfg = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
           "master_server_address": server.addr, "kvpool_api_key_file": str(key_file),
           "kvpool_fingerprint": server.fingerprint}
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(cfg))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    st = MooncakeDistributedStore()
    assert st.setup("localhost", "P2PHANDSHAKE", 1 << 30, 1 << 27, "tcp", "", server.addr) == 0  # as vLLM calls it
    assert st.put("cfgfile", b"1") == 0 and st.remove("cfgfile") == 0
    st.close()
    assert st.setup() == 0 and st.close() == 0
    # setup's dict may carry them too, and a keyword wins over both.
    assert st.setup({"local_hostname": "x", "master_server_addr": server.addr, "kvpool_api_key": "wrong",
                     "kvpool_fingerprint": server.fingerprint}, api_key=server.api_key) == 0
    st.close()
    with caplog.at_level(logging.ERROR, "kvpool.mooncake"):
        assert st.setup({"local_hostname": "x", "master_server_addr": server.addr, "kvpool_api_key": "wrong",
                         "kvpool_fingerprint": server.fingerprint}) == INTERNAL_ERROR  # refused key
    assert f"cannot connect to the kvpool server {server.addr} (from master_server_addr)" in caplog.text
    del cfg["kvpool_fingerprint"]
    path.write_text(json.dumps(cfg))
    caplog.clear()
    with caplog.at_level(logging.ERROR, "kvpool.mooncake"):
        assert st.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", server.addr) == INVALID_PARAMS
    assert f"kvpool_fingerprint or kvpool_ca in {path}" in caplog.text and "API key" not in caplog.text
    # The data directory alone, as a field of the file.
    path.write_text(json.dumps({"protocol": "tcp", "kvpool_data_dir": str(server.dir)}))
    assert st.setup() == 0 and st.get_hostname() and st.close() == 0
    path.write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.ERROR, "kvpool.mooncake"):
        assert st.setup("localhost", "", 0, 0, "tcp", "", server.addr) == INVALID_PARAMS
    assert f"MOONCAKE_CONFIG_PATH={path}: not JSON" in caplog.text


def test_setup_dummy_init_all_and_the_memory_pool(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's standalone mode: setup_dummy connects as setup() does (its server_address is the
    server when nothing else names one); alloc_from_mem_pool then gives shared memory."""
    for var in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "KVPOOL_SERVER", "KVPOOL_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVPOOL_API_KEY", server.api_key)
    monkeypatch.setenv("KVPOOL_FINGERPRINT", server.fingerprint)
    st = MooncakeDistributedStore()
    assert st.setup_dummy(64 << 20, 16 << 20, server.addr) == 0
    p = st.alloc_from_mem_pool(1 << 20)
    assert p != 0 and st.register_buffer(p, 1 << 20) == 0
    ctypes.memmove(p, b"standalone", 10)
    assert st.put_from("dummy/1", p, 10) == 0 and st.get("dummy/1") == b"standalone"
    assert st.client.registered() == [(p, 1 << 20, True)]  # the server reads it directly
    assert st.init_all("tcp", "") == INVALID_PARAMS  # already set up, as Mooncake
    st.remove_all(True)
    st.close()
    # After setup (a real client, in Mooncake's terms) there is no memory pool: 0, as Mooncake.
    assert st.setup("localhost", "", 0, 0, "tcp", "", server.addr) == 0 and st.alloc_from_mem_pool(1 << 20) == 0
    st.close()
    monkeypatch.setenv("MOONCAKE_MASTER", server.addr)
    assert st.init_all("tcp", "mlx5_0", 1 << 24) == 0 and st.health_check() == 0
    st.close()


def test_reads_lease_for_the_servers_lease_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A read leases the block for cache.lease_ttl_ms (5 s by default; 600 ms here), renewed by a
    later read: until then remove answers -706, after it 0."""
    conf = tmp_path / "lease.toml"
    conf.write_text("[cache]\nlease_ttl_ms = 600\n")
    s = Server(extra=("--config", str(conf)))
    st = MooncakeDistributedStore()
    try:
        assert st.setup("localhost", "", 0, 0, "tcp", "", s.addr, api_key=s.api_key, fingerprint=s.fingerprint) == 0
        for read in (lambda: st.get("l"), lambda: st.get_size("l"), lambda: st.get_buffer("l"),
                     lambda: st.get_replica_desc("l")):
            assert st.put("l", b"v" * 100) == 0
            read()
            assert st.remove("l") == OBJECT_HAS_LEASE
            time.sleep(0.3)
            read()  # renews
            time.sleep(0.4)
            assert st.remove("l") == OBJECT_HAS_LEASE
            time.sleep(0.5)
            assert st.remove("l") == 0
    finally:
        st.close()
        s.stop()


def test_replicas_tasks_segments_and_process_calls(store: MooncakeDistributedStore) -> None:
    assert store.put("rd", b"12345") == 0
    (d,) = store.get_replica_desc("rd")
    assert isinstance(d, ReplicaDescriptor) and d.status == ReplicaStatus.COMPLETE and d.is_memory_replica()
    assert not d.is_disk_replica() and not d.is_local_disk_replica()
    bd = d.get_memory_descriptor().buffer_descriptor
    assert (bd.size, bd.buffer_address) == (5, 0) and bd.transport_endpoint
    with pytest.raises(RuntimeError):
        d.get_disk_descriptor()
    assert store.get_replica_desc("missing") == [] and list(store.batch_get_replica_desc(["rd", "missing"])) == ["rd"]
    assert store.remove("rd") == OBJECT_HAS_LEASE  # the query leased it, as Mooncake's
    assert store.create_copy_task("rd", ["seg"]) == ((0, 0), NOT_SUPPORTED)
    assert store.create_move_task("rd", "a", "b") == ((0, 0), NOT_SUPPORTED)
    assert store.create_copy_task("missing", ["seg"]) == ((0, 0), OBJECT_NOT_FOUND)
    assert store.query_task((1, 2)) == (None, TASK_NOT_FOUND)
    assert store.mount_segment("/dev/shm/x", 1 << 20) == {"ret": NOT_SUPPORTED, "segment_ids": []}
    assert store.allocate_and_mount_segment(1 << 20) == {"ret": NOT_SUPPORTED, "segment_ids": [], "allocated_size": 0}
    assert (store.unmount_segment([]), store.unmount_segment(["x"]), store.unmount_and_free_segment(["x"])) == (0, -1, -1)
    assert store.unmount_local_disk_segment() == 0 and store.get_offload_rpc_read_count() == 0
    assert store._get_pyclient_capsule() is None
    assert store.put_batch(["c1", "c2", "c3"], [b"1", b"2", b"3"]) == 0 and store.get("c3") == b"3"
    assert sorted(store.batch_replica_clear(["c1", "c3", "missing"])) == ["c1"]  # c3 is leased
    assert store.batch_replica_clear(["c2"], "some-segment") == [] and store.batch_is_exist(["c1", "c2"]) == [0, 1]
    # Process-level calls, as module functions (LMCache imports bind_to_numa_node) and methods.
    assert bind_to_numa_node(0) is None and bind_to_numa_node(10_000) is None and store.bind_to_numa_node(0) is None
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(get_free_func_addr())
    p = alloc(1 << 16)
    assert p and p % 4096 == 0
    ctypes.memset(p, 7, 1 << 16)
    free(p)
    a = MooncakeHostMemAllocator()
    p = a.alloc(1 << 20)
    assert p and p % 4096 == 0 and ctypes.string_at(p, 4) == b"\0" * 4
    assert store.register_buffer(p, 1 << 20) == 0 and store.put_from("host", p, 4096) == 0
    assert store.unregister_buffer(p) == 0 and a.free(p) == 0 and a.free(p) == -1 and a.alloc(0) == 0


def test_replicate_config_fields_pins_and_group_ids(store: MooncakeDistributedStore) -> None:
    c = ReplicateConfig()
    assert (c.replica_num, c.nof_replica_num, c.dfs_replica_num, c.soft_pin_action, c.soft_pin_ttl_ms) == \
        (1, 0, 0, SoftPinAction.PRESERVE, None)
    assert (c.group_ids, c.session_ids, c.data_type, c.preferred_nof_segments) == (None, None, ObjectDataType.UNKNOWN, [])
    assert str(c).startswith("ReplicateConfig: { replica_num: 1, nof_replica_num: 0")
    c.soft_pin_action = SoftPinAction.ENABLE
    assert store.put("soft", b"x", c) == 0 and store.get("soft") == b"x"
    two = ReplicateConfig()
    two.group_ids, two.session_ids = ["g", ""], ["s1", "s2"]
    one = ReplicateConfig()
    one.group_ids = ["g"]
    assert store.put_batch(["g1", "g2"], [b"1", b"2"], two) == 0
    assert store.put_batch(["g3", "g4"], [b"3", b"4"], one) == INVALID_PARAMS
    assert store.put("g5", b"5", two) == INVALID_PARAMS and store.put("g6", b"6", one) == 0
    buf = store.alloc_buffer(1 << 16)
    assert store.register_buffer(buf.address, buf.size) == 0
    assert store.batch_put_from(["g7", "g8"], [buf.address] * 2, [10, 10], one) == [INVALID_PARAMS] * 2
    assert store.batch_put_from(["g7", "g8"], [buf.address] * 2, [10, 10], two) == [0, 0]
    assert store.batch_is_exist(["g1", "g2", "g3", "g4", "g5", "g6", "g7", "g8"]) == [1, 1, 0, 0, 0, 1, 1, 1]
    assert store.unregister_buffer(buf.address) == 0


def test_module_offers_every_method_and_name_of_mooncake_store() -> None:
    import kvpool.mooncake as m

    from parity_checks_api import MODULE_NAMES, MOONCAKE_METHODS

    assert [n for n in MOONCAKE_METHODS if not callable(getattr(MooncakeDistributedStore, n, None))] == []
    assert [n for n in MODULE_NAMES if not hasattr(m, n)] == []
    assert MooncakeDistributedStore.__module__ == ReplicaDescriptor.__module__ == "kvpool.mooncake"
    assert m.PROCESSING is m.TaskStatus.PROCESSING and m.COMPLETE is ReplicaStatus.COMPLETE


def test_no_space_is_minus_200(small_server: Server) -> None:
    st = MooncakeDistributedStore()
    assert st.setup("localhost", "", 0, 0, "tcp", "", small_server.addr, api_key=small_server.api_key,
                    fingerprint=small_server.fingerprint) == 0
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True  # hard-pinned blocks are never evicted: the segment fills up
    big = os.urandom(1 << 20)
    codes = [st.put(f"fill/{i}", big, cfg) for i in range(8)]
    assert codes[0] == 0
    assert NO_AVAILABLE_HANDLE in codes, codes
    st.close()


def test_native_errors_carry_codes(server: Server) -> None:
    c = kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint)
    with pytest.raises(kvpool.KvpoolError) as e:
        c.put_batch(["k" * 5000], [b"v"])
    assert e.value.code == "key-too-long"
    with pytest.raises(TypeError):
        c.exists([1])  # type: ignore[list-item]
    with pytest.raises(kvpool.KvpoolError) as e:
        kvpool.Client(server.addr, "wrong-key", fingerprint=server.fingerprint)
    assert e.value.code == "unauthorized"
    c.close()
    with pytest.raises(kvpool.KvpoolError) as e:
        c.ping()
    assert e.value.code == "closed"


def test_shared_buffer_outlives_its_python_object_while_registered(server: Server) -> None:
    """A registered kvpool buffer stays mapped even when Python drops its last reference, so
    a registered address can never dangle."""
    c = kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint)
    buf = c.alloc_buffer(1 << 16)
    addr = buf.address
    assert c.register(addr, 1 << 16) is True
    ctypes.memmove(addr, b"still here", 10)
    del buf
    assert c.put_from(["sb"], [addr], [10]) == ["ok"]
    assert c.get_batch(["sb"])[0] == ("ok", b"still here")
    c.unregister(addr)
    assert c.remove(["sb"], True) == ["ok"]
    c.close()


def test_client_side_verification_of_shm_gets(server: Server) -> None:
    """verify_shm_gets=True: gets into registered buffers are hashed again by the client, and
    whole blocks still arrive intact (a bad type is refused before connecting)."""
    with pytest.raises(TypeError):
        kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint, verify_shm_gets="yes")  # type: ignore[arg-type]
    c = kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint, transport="shm", verify_shm_gets=True)
    assert c.transport == "shm"
    n = 3 * (1 << 18) + 11
    buf = c.alloc_buffer(2 * n)
    assert c.register(buf.address, 2 * n) is True
    payload = os.urandom(n)
    ctypes.memmove(buf.address, payload, n)
    assert c.put_from(["vsg"], [buf.address], [n]) == ["ok"]
    assert c.get_into(["vsg"], [buf.address + n], [n]) == [("ok", n)]
    assert ctypes.string_at(buf.address + n, n) == payload
    assert c.remove(["vsg"], True) == ["ok"]
    c.unregister(buf.address)
    c.close()


def test_tenant_ids_are_separate_key_spaces(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's tenant_id: from setup's keyword, and from MOONCAKE_* as Mooncake reads them."""
    stores = {}
    for t in ("team-a", "team-b", None):
        st = MooncakeDistributedStore()
        assert st.setup("localhost", "", 0, 0, "tcp", "", server.addr, api_key=server.api_key,
                        fingerprint=server.fingerprint, tenant_id=t) == 0
        assert st.put("shared-name", (t or "default").encode()) == 0
        stores[t] = st
    assert [stores[t].get("shared-name") for t in stores] == [b"team-a", b"team-b", b"default"]
    assert stores["team-a"].is_exist("shared-name") == 1
    assert stores["team-a"].remove_all(True) == 1  # (the get above leased it)
    assert stores["team-a"].get("shared-name") == b""
    assert stores["team-b"].get("shared-name") == b"team-b" and stores[None].get("shared-name") == b"default"
    # Configured by the environment alone, as Mooncake's MooncakeConfig.load_from_env.
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("KVPOOL_SERVER", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", server.addr)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "TCP")
    monkeypatch.setenv("MOONCAKE_TENANT_ID", "team-b")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4GB")
    monkeypatch.setenv("KVPOOL_API_KEY", server.api_key)
    monkeypatch.setenv("KVPOOL_FINGERPRINT", server.fingerprint)
    env = MooncakeDistributedStore()
    assert env.setup() == 0
    assert env.get("shared-name") == b"team-b"
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4 gigabytes")
    assert MooncakeDistributedStore().setup() == INVALID_PARAMS
    # remove_by_regex stays inside the tenant's key space; "^" anchors at the tenant's key.
    for t in ("team-b", None):
        assert stores[t].put_batch(["rx/1", "rx/2"], [b"1", b"2"]) == 0
    assert stores["team-b"].remove_by_regex("^rx/") == 2
    assert stores["team-b"].batch_is_exist(["rx/1", "rx/2"]) == [0, 0]
    assert stores[None].batch_is_exist(["rx/1", "rx/2"]) == [1, 1]
    assert stores[None].remove_by_regex("^rx/") == 2
    for st in [*stores.values(), env]:
        st.remove_all(True)
        st.close()


def test_tensor_methods_need_torch(server: Server) -> None:
    """Without torch, kvpool.mooncake imports and its byte methods work; a tensor method says
    what is missing."""
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here (test_mooncake_parity.py checks the tensor methods)")
    st = MooncakeDistributedStore()
    assert st.setup("localhost", "", 0, 0, "tcp", "", server.addr, api_key=server.api_key,
                    fingerprint=server.fingerprint) == 0
    with pytest.raises(ImportError, match="PyTorch"):
        st.put_tensor("t", object())
    with pytest.raises(ImportError, match="PyTorch"):
        st.get_tensor("t")
    st.close()
