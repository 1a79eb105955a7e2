"""Device memory in the client: CUDA and Ascend device pointers registered, put from and got into,
against the stand-in runtimes of kvpool-devmem (``devmem/standin``). Nothing here ran on a GPU or
an NPU: the stand-ins have the runtimes' C ABI over host memory, copy asynchronously on worker
threads (with a delay when asked, so a missing sync gives stale bytes), and map their "device"
memory without access rights, so a host read of a device pointer would kill this process.

How the stand-ins are found: the ``kvpool-devmem-standin`` binary (built with the workspace's
binaries, next to ``kvpool-server``; built here with cargo when missing) writes both libraries
into a folder and prints their paths. ``KVPOOL_CUDA_RUNTIME`` / ``KVPOOL_ACL_RUNTIME`` point the
client at them. This test loads the same files with ctypes to allocate, fill and read device
memory and to read the stand-in's counters (the dynamic loader shares one instance).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpool
from conftest import REPO, Server, server_binary

pytestmark = pytest.mark.device

STANDIN_BIN = "kvpool-devmem-standin"
COUNTERS = ["copies_enqueued", "copies_done", "bytes", "h2d", "d2h", "stream_syncs", "event_records", "event_syncs",
            "host_registers", "host_unregisters", "register_refused", "unpinned_copies", "failed_copies",
            "streams_created", "streams_destroyed", "set_device", "max_busy_streams"]
COPY_CALL, COPY_RUN = 0, 1  # kvpool_devmem_standin_fail


class _Counters(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in COUNTERS]


class Standin:
    """A stand-in runtime loaded with ctypes (the same instance the client loads)."""

    def __init__(self, path: str, kind: str) -> None:
        self.path, self.kind = path, kind
        self.lib = ctypes.CDLL(path)
        assert self.lib.kvpool_devmem_standin_backend.restype is not None
        self.lib.kvpool_devmem_standin_backend.restype = ctypes.c_char_p
        assert self.lib.kvpool_devmem_standin_backend().decode() == kind
        self.lib.kvpool_devmem_standin_reset()

    def counters(self) -> dict[str, int]:
        c = _Counters()
        self.lib.kvpool_devmem_standin_counters_get(ctypes.byref(c))
        return {n: getattr(c, n) for n in COUNTERS}

    def delay_us(self, us: int) -> None:
        self.lib.kvpool_devmem_standin_set_delay_us(ctypes.c_uint32(us))

    def fail(self, what: int, count: int) -> None:
        self.lib.kvpool_devmem_standin_fail(ctypes.c_uint32(what), ctypes.c_uint32(count))

    def set_device(self, d: int) -> None:
        fn = self.lib.cudaSetDevice if self.kind == "cuda" else self.lib.aclrtSetDevice
        assert fn(ctypes.c_int(d)) == 0

    def alloc(self, device: int, n: int) -> int:
        self.set_device(device)
        p = ctypes.c_void_p()
        rc = (self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) if self.kind == "cuda"
              else self.lib.aclrtMalloc(ctypes.byref(p), ctypes.c_size_t(n), 0))
        assert rc == 0 and p.value
        return p.value

    def free(self, ptr: int) -> None:
        assert (self.lib.cudaFree if self.kind == "cuda" else self.lib.aclrtFree)(ctypes.c_void_p(ptr)) == 0

    def _copy(self, dst: int, src: int, n: int, kind: int) -> None:
        if self.kind == "cuda":
            rc = self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), kind)
        else:
            rc = self.lib.aclrtMemcpy(ctypes.c_void_p(dst), ctypes.c_size_t(n), ctypes.c_void_p(src),
                                      ctypes.c_size_t(n), kind)
        assert rc == 0

    def write(self, ptr: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        self._copy(ptr, ctypes.addressof(buf), len(data), 1)

    def read(self, ptr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self._copy(ctypes.addressof(buf), ptr, n, 2)
        return buf.raw


def _target_dir() -> Path:
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return Path(json.loads(meta.stdout)["target_directory"])


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    exe = server_binary().parent / STANDIN_BIN
    if not exe.exists():
        subprocess.run(["cargo", "build", "-q", "-p", "kvpool-devmem", "--bin", STANDIN_BIN], cwd=REPO, check=True)
        exe = _target_dir() / "debug" / STANDIN_BIN
    out = tmp_path_factory.mktemp("devmem-standin")
    cuda, acl = subprocess.run([str(exe), str(out)], check=True, capture_output=True, text=True).stdout.split()
    return {"cuda": cuda, "acl": acl}


@pytest.fixture
def cuda(libs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Standin]:
    monkeypatch.setenv("KVPOOL_CUDA_RUNTIME", libs["cuda"])
    monkeypatch.setenv("KVPOOL_ACL_RUNTIME", "off")
    s = Standin(libs["cuda"], "cuda")
    yield s
    s.lib.kvpool_devmem_standin_reset()


@pytest.fixture
def acl(libs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Standin]:
    monkeypatch.setenv("KVPOOL_CUDA_RUNTIME", "off")
    monkeypatch.setenv("KVPOOL_ACL_RUNTIME", libs["acl"])
    s = Standin(libs["acl"], "acl")
    yield s
    s.lib.kvpool_devmem_standin_reset()


def connect(server: Server, transport: str = "auto", **kw: Any) -> kvpool.Client:
    return kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint, transport=transport, **kw)


def rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("transport", ["shm", "quic"])
def test_device_ranges_register_and_round_trip(server: Server, cuda: Standin, transport: str) -> None:
    """put_from reads device memory only through the runtime's copies and get_into writes it the
    same way; the bytes are the pool's and arrive intact, over shared memory and in band."""
    n, size = 8, 50_000
    c = connect(server, transport, device_chunk=128 << 10)  # two items a chunk: four chunks
    src, dst = cuda.alloc(0, n * size), cuda.alloc(0, n * size)
    data = rand(n * size, 1)
    cuda.write(src, data)
    assert c.register(src, n * size) is False
    assert c.register(dst, n * size) is False
    assert c.registered(memory=True) == sorted([(src, n * size, False, "cuda:0"), (dst, n * size, False, "cuda:0")])
    assert c.registered() == sorted([(src, n * size, False), (dst, n * size, False)])
    keys = [f"dev/{transport}/{i}" for i in range(n)]
    assert c.put_from(keys, [src + i * size for i in range(n)], [size] * n) == ["ok"] * n
    assert [v for _, v in c.get_batch(keys)] == [data[i * size:(i + 1) * size] for i in range(n)]
    assert c.get_into(keys, [dst + i * size for i in range(n)], [size] * n) == [("ok", size)] * n
    assert cuda.read(dst, n * size) == data
    k = cuda.counters()
    assert (k["d2h"], k["h2d"], k["failed_copies"]) == (n, n, 0), k
    # The staging buffers were page-locked: every copy was a DMA of pinned memory.
    assert k["unpinned_copies"] == 0 and k["host_registers"] >= 1, k
    # A value larger than its device range is refused before any byte is copied.
    assert c.get_into(keys[:1], [dst], [size - 1]) == [("value-too-large", size)]
    assert cuda.counters()["h2d"] == n
    c.unregister(src)
    assert c.put_from(keys[:1], [src], [size]) == ["invalid-argument"]
    c.remove(keys, force=True)
    c.close()
    cuda.free(src)
    cuda.free(dst)


def test_multi_forms_mix_device_and_host_pieces(server: Server, cuda: Standin) -> None:
    """Several pieces per key, on two devices and in host memory, and host-only items in the same
    call: gathered in order on put, scattered in order on get."""
    c = connect(server, device_chunk=16 << 10)
    p = 3000
    d0, d1 = cuda.alloc(0, 8 * p), cuda.alloc(1, 8 * p)
    o0, o1 = cuda.alloc(0, 8 * p), cuda.alloc(1, 8 * p)
    host, out = np.frombuffer(bytearray(rand(8 * p, 2)), np.uint8), np.zeros(8 * p, np.uint8)
    dev0, dev1 = rand(8 * p, 3), rand(8 * p, 4)
    cuda.write(d0, dev0)
    cuda.write(d1, dev1)
    for r, n in [(d0, 8 * p), (d1, 8 * p), (o0, 8 * p), (o1, 8 * p), (host.ctypes.data, host.nbytes),
                 (out.ctypes.data, out.nbytes)]:
        c.register(r, n)
    hp, op = host.ctypes.data, out.ctypes.data
    keys = ["multi/0", "multi/1", "multi/host", "multi/2"]
    src = [[d0, d1 + 4 * p, hp, d0 + 6 * p], [d1, d1 + p], [hp + 2 * p, hp + 5 * p], [hp + 7 * p, d0 + 7 * p]]
    dst = [[o0, o1 + 4 * p, op, o0 + 6 * p], [o1, o1 + p], [op + 2 * p, op + 5 * p], [op + 7 * p, o0 + 7 * p]]
    sizes = [[p, 2 * p, p, p], [p, p], [p, p], [p, p]]
    assert c.put_from_multi(keys, src, sizes) == ["ok"] * 4

    def expect(ptrs: list[int], lens: list[int]) -> bytes:
        parts = []
        for q, n in zip(ptrs, lens):
            for base, mem in [(d0, dev0), (d1, dev1), (hp, host.tobytes())]:
                if base <= q < base + 8 * p:
                    parts.append(mem[q - base:q - base + n])
        return b"".join(parts)

    want = [expect(s, z) for s, z in zip(src, sizes)]
    assert [v for _, v in c.get_batch(keys)] == want
    # multi/1's two pieces follow each other on the device: one copy.
    assert cuda.counters()["d2h"] == 5
    assert c.get_into_multi(keys, dst, sizes) == [("ok", sum(z)) for z in sizes]
    got_o0, got_o1 = cuda.read(o0, 8 * p), cuda.read(o1, 8 * p)
    for d, z, w in zip(dst, sizes, want):
        at = 0
        for q, n in zip(d, z):
            for base, mem in [(o0, got_o0), (o1, got_o1), (op, out.tobytes())]:
                if base <= q < base + 8 * p:
                    assert mem[q - base:q - base + n] == w[at:at + n]
            at += n
    k = cuda.counters()
    assert (k["h2d"], k["unpinned_copies"]) == (5, 0), k
    c.remove(keys, force=True)
    c.close()
    for d in (d0, d1, o0, o1):
        cuda.free(d)


def test_copies_still_in_flight_when_the_transfer_starts(server: Server, cuda: Standin) -> None:
    """Every copy waits 30 ms in the stand-in: a chunk sent before its copies' event, or a get
    that returned before its copies, would show stale bytes. Chunks overlap: the next chunk's
    copies are queued while one is sent."""
    n, size = 6, 40_000
    c = connect(server, device_chunk=80_000)  # two items a chunk: three chunks
    src, dst = cuda.alloc(0, n * size), cuda.alloc(0, n * size)
    data = rand(n * size, 5)
    cuda.write(src, data)
    c.register(src, n * size)
    c.register(dst, n * size)
    cuda.delay_us(30_000)
    keys = [f"slow/{i}" for i in range(n)]
    assert c.put_from(keys, [src + i * size for i in range(n)], [size] * n) == ["ok"] * n
    k = cuda.counters()
    assert k["max_busy_streams"] >= 2, k
    assert k["event_syncs"] == 3, k  # one event per chunk, waited for before the chunk was sent
    assert [v for _, v in c.get_batch(keys)] == [data[i * size:(i + 1) * size] for i in range(n)]
    assert c.get_into(keys, [dst + i * size for i in range(n)], [size] * n) == [("ok", size)] * n
    k = cuda.counters()
    assert k["copies_done"] == k["copies_enqueued"] == 2 * n, k
    assert cuda.read(dst, n * size) == data
    cuda.delay_us(0)
    c.remove(keys, force=True)
    c.close()
    cuda.free(src)
    cuda.free(dst)


def test_device_memory_not_registered_is_refused_never_read(server: Server, cuda: Standin,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    c = connect(server)
    a, b = cuda.alloc(0, 1 << 16), cuda.alloc(0, 1 << 16)
    assert c.register(a, 1 << 16) is False
    before = cuda.counters()
    # b is device memory nobody registered; a range running off a's end is outside a.
    assert c.put_from(["b", "a+"], [b, a + 100], [64, 1 << 16]) == ["invalid-argument"] * 2
    assert c.get_into(["b"], [b], [64]) == [("invalid-argument", 0)]
    assert cuda.counters()["copies_enqueued"] == before["copies_enqueued"]
    # A range that starts on the device and ends elsewhere: refused by name.
    with pytest.raises(kvpool.KvpoolError) as e:
        c.register(b, 1 << 20)
    assert e.value.code == "invalid-argument" and "starts in device 0 memory" in str(e.value), str(e.value)
    c.close()
    # Without a runtime that claims it, device memory is refused as today (never read).
    monkeypatch.setenv("KVPOOL_CUDA_RUNTIME", "off")
    c = connect(server)
    with pytest.raises(kvpool.KvpoolError) as e:
        c.register(b, 1 << 16)
    assert e.value.code == "invalid-argument" and "is mapped ---s" in str(e.value), str(e.value)
    c.close()
    # A runtime named explicitly that does not load fails the registration with its reason.
    monkeypatch.setenv("KVPOOL_CUDA_RUNTIME", "/nonexistent/libcudart.so.12")
    c = connect(server)
    with pytest.raises(kvpool.KvpoolError) as e:
        c.register(b, 1 << 16)
    assert e.value.code == "device-error" and "/nonexistent/libcudart.so.12" in str(e.value), str(e.value)
    c.close()
    cuda.free(a)
    cuda.free(b)


def test_acl_standin_round_trip_from_a_thread_without_a_context(server: Server, acl: Standin) -> None:
    n, size = 4, 30_000
    src, dst = acl.alloc(1, n * size), acl.alloc(1, n * size)
    data = rand(n * size, 6)
    acl.write(src, data)
    # This thread has no ACL context now: the client must make device 1 current itself.
    assert acl.lib.aclrtResetDevice(1) == 0
    c = connect(server, device_chunk=64 << 10)
    c.register(src, n * size)
    c.register(dst, n * size)
    assert [r[3] for r in c.registered(memory=True)] == ["acl:1", "acl:1"]
    acl.delay_us(10_000)
    keys = [f"npu/{i}" for i in range(n)]
    assert c.put_from(keys, [src + i * size for i in range(n)], [size] * n) == ["ok"] * n
    assert c.get_into(keys, [dst + i * size for i in range(n)], [size] * n) == [("ok", size)] * n
    acl.delay_us(0)
    assert acl.read(dst, n * size) == data
    k = acl.counters()
    # ACL's fences are stream syncs; the staging buffers were 4 KiB aligned and registered.
    assert k["stream_syncs"] >= 4 and k["unpinned_copies"] == 0 and k["register_refused"] == 0, k
    c.remove(keys, force=True)
    c.close()
    acl.free(src)
    acl.free(dst)


def test_a_failed_device_copy_answers_its_item(server: Server, cuda: Standin) -> None:
    c = connect(server, device_chunk=4096)  # one item a chunk
    size = 4000
    src = cuda.alloc(0, 3 * size)
    cuda.write(src, rand(3 * size, 7))
    c.register(src, 3 * size)
    keys = ["f/0", "f/1", "f/2"]
    cuda.fail(COPY_CALL, 1)
    assert c.put_from(keys, [src + i * size for i in range(3)], [size] * 3) == ["device-error", "ok", "ok"]
    assert "cudaMemcpyAsync" in c.last_device_error and c.exists(keys) == [False, True, True]
    assert c.put_from(keys[:1], [src], [size]) == ["ok"]
    cuda.fail(COPY_RUN, 1)
    got = c.get_into(keys, [src + i * size for i in range(3)], [size] * 3)
    assert got == [("device-error", 0), ("ok", size), ("ok", size)]
    assert "cudaEventSynchronize failed with error 700" in c.last_device_error, c.last_device_error
    assert cuda.counters()["failed_copies"] == 1
    c.remove(keys, force=True)
    c.close()
    cuda.free(src)


def test_pinned_and_managed_host_memory_take_the_host_path(server: Server, cuda: Standin) -> None:
    """Host memory the runtime knows (pinned, managed) is host memory: read by the CPU, no copies."""
    c = connect(server)
    a = np.frombuffer(bytearray(rand(1 << 16, 8)), np.uint8)
    assert cuda.lib.cudaHostRegister(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes), 0) == 0
    m = ctypes.c_void_p()
    assert cuda.lib.cudaMallocManaged(ctypes.byref(m), ctypes.c_size_t(1 << 16), 1) == 0
    c.register(a.ctypes.data, a.nbytes)
    c.register(m.value, 1 << 16)
    assert sorted(r[3] for r in c.registered(memory=True)) == ["host", "host"]
    assert c.put_from(["pinned"], [a.ctypes.data], [a.nbytes]) == ["ok"]
    assert c.get_into(["pinned"], [m.value], [a.nbytes]) == [("ok", a.nbytes)]
    assert ctypes.string_at(m.value, a.nbytes) == a.tobytes()
    assert cuda.counters()["copies_enqueued"] == 0
    c.unregister(a.ctypes.data)
    c.unregister(m.value)
    assert cuda.lib.cudaHostUnregister(ctypes.c_void_p(a.ctypes.data)) == 0
    c.remove(["pinned"], force=True)
    c.close()


def test_mooncake_store_with_device_buffers(server: Server, cuda: Standin) -> None:
    """Mooncake's API as vLLM's and SGLang's connectors call it, with the KV cache on a device."""
    from kvpool.mooncake import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    assert st.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", server.addr,
                    api_key=server.api_key, fingerprint=server.fingerprint) == 0
    p = 8192
    kv, back = cuda.alloc(0, 8 * p), cuda.alloc(0, 8 * p)
    data = rand(8 * p, 9)
    cuda.write(kv, data)
    assert st.register_buffer(kv, 8 * p) == 0 and st.register_buffer(back, 8 * p) == 0
    keys = ["mc/0", "mc/1"]
    assert st.batch_put_from_multi_buffers(keys, [[kv, kv + 4 * p], [kv + p, kv + 5 * p]], [[p, p], [p, p]]) == [0, 0]
    assert st.batch_get_into_multi_buffers(keys, [[back, back + 4 * p], [back + p, back + 5 * p]],
                                           [[p, p], [p, p]]) == [2 * p, 2 * p]
    got = cuda.read(back, 8 * p)
    for off in (0, 4 * p, p, 5 * p):
        assert got[off:off + p] == data[off:off + p]
    assert st.put_from("mc/one", kv + 2 * p, p) == 0 and st.get_into("mc/one", back + 2 * p, p) == p
    assert cuda.read(back + 2 * p, p) == data[2 * p:3 * p]
    st.remove_all(True)
    st.close()
    cuda.free(kv)
    cuda.free(back)
