"""GPU check of kvpool's device-memory path: register CUDA memory, put from it, get into other
CUDA memory, compare the bytes, and print GB/s device->pool->device beside the same transfers
from and to host memory (the baseline). **Written without a GPU; never run on one yet.**

Needs on the GPU machine: a CUDA GPU, torch with CUDA, this tree's kvpool wheel installed
(``pip install kvpool-*.whl``), and this tree's ``kvpool-server`` binary (``--server`` or
``KVPOOL_SERVER_BIN``); carry both over when the machine cannot build them. The script starts its
own server on loopback (same-host shared memory) and stops it at the end. kvpool finds the CUDA
runtime torch loaded (``KVPOOL_CUDA_RUNTIME`` names another). Exit status 0 only when every byte
matched and every transfer answered ok.

    KVPOOL_SERVER_BIN=target/release/kvpool-server python3 python/bench/device_check.py --total-mib 1024

``--standin LIB`` runs the same steps against kvpool-devmem's CUDA stand-in instead of torch (no
GPU: a smoke test of this script; its GB/s mean nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import kvpool


class Torch:
    """CUDA memory as torch tensors."""

    def __init__(self, device: int) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device("cuda", device)

    def random(self, n: int) -> Any:
        return self.torch.randint(0, 256, (n,), dtype=self.torch.uint8, device=self.dev)

    def zeros(self, n: int) -> Any:
        return self.torch.zeros(n, dtype=self.torch.uint8, device=self.dev)

    def ptr(self, t: Any) -> int:
        return int(t.data_ptr())

    def sync(self) -> None:
        # kvpool copies on streams of its own: the work that writes the memory must be over.
        self.torch.cuda.synchronize(self.dev)

    def equal(self, a: Any, b: Any) -> bool:
        return bool(self.torch.equal(a, b))


class Standin:
    """kvpool-devmem's CUDA stand-in through ctypes (no GPU: checks this script only)."""

    def __init__(self, lib: str) -> None:
        os.environ["KVPOOL_CUDA_RUNTIME"] = lib
        self.lib = ctypes.CDLL(lib)

    def _alloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        assert self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        return int(p.value or 0)

    def random(self, n: int) -> tuple[int, int]:
        p = self._alloc(n)
        data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        assert self.lib.cudaMemcpy(ctypes.c_void_p(p), ctypes.c_void_p(data.ctypes.data), ctypes.c_size_t(n), 1) == 0
        return (p, n)

    def zeros(self, n: int) -> tuple[int, int]:
        return (self._alloc(n), n)

    def ptr(self, t: tuple[int, int]) -> int:
        return t[0]

    def sync(self) -> None:
        pass

    def _read(self, t: tuple[int, int]) -> bytes:
        buf = ctypes.create_string_buffer(t[1])
        assert self.lib.cudaMemcpy(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_void_p(t[0]),
                                   ctypes.c_size_t(t[1]), 2) == 0
        return buf.raw

    def equal(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        return self._read(a) == self._read(b)


def start_server(binary: str, dram_mib: int, work: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([binary, "--data-dir", str(work), "--listen", "127.0.0.1:0", "--metrics-listen", "off",
                             "--dram-size", f"{dram_mib}MiB", "--ssd-capacity", "0"], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (work / "endpoint.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"kvpool-server did not start: {(work / 'server.log').read_text()[-2000:]}")
        time.sleep(0.05)
    ep = json.loads((work / "endpoint.json").read_text())
    return proc, {"addr": ep["quic_addr"], "fingerprint": ep["fingerprint"],
                  "key": (work / "api-key").read_text().strip()}


def rounds(c: kvpool.Client, name: str, src: int, dst: int, n: int, block: int, times: int,
           sync: Callable[[], None]) -> tuple[float, float]:
    """Median GB/s of put (src -> pool) and get (pool -> dst) over `times` rounds."""
    put, get = [], []
    for r in range(times):
        keys = [f"check/{name}/{r}/{i}" for i in range(n)]
        sync()
        t0 = time.perf_counter()
        st = c.put_from(keys, [src + i * block for i in range(n)], [block] * n)
        t1 = time.perf_counter()
        got = c.get_into(keys, [dst + i * block for i in range(n)], [block] * n)
        t2 = time.perf_counter()
        if st != ["ok"] * n or got != [("ok", block)] * n:
            bad = [s for s in st if s != "ok"][:3] + [g for g in got if g != ("ok", block)][:3]
            raise SystemExit(f"{name}: transfers failed: {bad} (last_device_error: {c.last_device_error})")
        put.append(n * block / (t1 - t0) / 1e9)
        get.append(n * block / (t2 - t1) / 1e9)
        c.remove(keys, force=True)
    return statistics.median(put), statistics.median(get)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=os.environ.get("KVPOOL_SERVER_BIN"), help="kvpool-server binary")
    ap.add_argument("--total-mib", type=int, default=512, help="bytes moved per round")
    ap.add_argument("--block-kib", type=int, default=2048, help="one value (a KV block of a few layers)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--device-chunk-mib", type=int, default=16, help="the client's staging chunk")
    ap.add_argument("--standin", help="kvpool-devmem's CUDA stand-in library instead of torch (no GPU)")
    a = ap.parse_args()
    if not a.server:
        raise SystemExit("give --server or KVPOOL_SERVER_BIN (this tree's kvpool-server)")
    mem: Any = Standin(a.standin) if a.standin else Torch(a.device)
    block = a.block_kib << 10
    n = max(1, (a.total_mib << 20) // block)
    total = n * block
    work = Path(tempfile.mkdtemp(prefix="kvpool-device-check-"))
    proc, ep = start_server(a.server, 2 * (total >> 20) + 256, work)
    try:
        c = kvpool.Client(ep["addr"], ep["key"], fingerprint=ep["fingerprint"], device_chunk=a.device_chunk_mib << 20)
        src, dst = mem.random(total), mem.zeros(total)
        for t in (src, dst):
            c.register(mem.ptr(t), total)
        kinds = {r[0]: r[3] for r in c.registered(memory=True)}
        if not kinds[mem.ptr(src)].startswith("cuda:"):
            raise SystemExit(f"the CUDA memory registered as {kinds[mem.ptr(src)]!r}: is the CUDA runtime loaded? "
                             "(KVPOOL_CUDA_RUNTIME=auto loads it by name)")
        dput, dget = rounds(c, "device", mem.ptr(src), mem.ptr(dst), n, block, a.rounds, mem.sync)
        mem.sync()
        same = mem.equal(src, dst)
        hsrc = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
        hdst = np.zeros(total, np.uint8)
        for h in (hsrc, hdst):
            c.register(h.ctypes.data, total)
        hput, hget = rounds(c, "host", hsrc.ctypes.data, hdst.ctypes.data, n, block, a.rounds, lambda: None)
        same_host = bool(np.array_equal(hsrc, hdst))
        print(f"kvpool {c.transport}, {n} values of {block >> 10} KiB per round, {a.rounds} rounds, "
              f"device_chunk {a.device_chunk_mib} MiB{' (stand-in: no GPU)' if a.standin else ''}")
        print(f"device -> pool {dput:6.2f} GB/s   pool -> device {dget:6.2f} GB/s   bytes equal: {same}")
        print(f"host   -> pool {hput:6.2f} GB/s   pool -> host   {hget:6.2f} GB/s   bytes equal: {same_host}")
        c.close()
        return 0 if same and same_host else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
