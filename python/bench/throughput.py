"""Python-client throughput: kvpool beside Mooncake, one script, one run.

Both stores are driven through the same Mooncake-style calls (``register_buffer``,
``batch_put_from``, ``batch_get_into``): each round puts ``--batch`` blocks of ``--size`` bytes
from a registered buffer in one call, reads them back into another registered buffer in one
call, checks the bytes, and removes the keys. Targets:

- ``kvpool-zero-copy``: buffers from ``alloc_buffer`` (shared memfd): the server copies between
  its segment and them; no byte crosses a socket.
- ``kvpool-staged``: ordinary numpy memory registered with ``register_buffer``: the client copies
  once into shared staging memory (same host).
- ``kvpool-quic``: ordinary numpy memory, bytes in band over QUIC + TLS (what a remote client gets).
- ``mooncake-tcp``: Mooncake Store's Python client (``mooncake-transfer-engine-non-cuda``),
  ``protocol="tcp"``, with a ``mooncake_master`` and a storage process on loopback.

Prints one line per target (GB/s, median and best round), then each kvpool target's ratio to
Mooncake's median; ``--json`` writes them. Mooncake is required unless ``--skip-mooncake``.

    cargo build --release -p kvpool-server && python3 python/bench/throughput.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def server_binary(explicit: Optional[str]) -> Path:
    b = explicit or os.environ.get("KVPOOL_SERVER_BIN")
    if b:
        return Path(b)
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO,
                          check=True, capture_output=True, text=True)
    target = Path(json.loads(meta.stdout)["target_directory"])
    for profile in ("release", "debug"):
        if (target / profile / "kvpool-server").exists():
            return target / profile / "kvpool-server"
    raise SystemExit("no kvpool-server build found: cargo build --release -p kvpool-server")


class Procs:
    """Child processes stopped together."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-pybench-"))

    def start(self, name: str, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen(cmd, stdout=open(self.dir / f"{name}.log", "wb"), stderr=subprocess.STDOUT, **kw)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_port(port: int, proc: subprocess.Popen[Any], what: str) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited")
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{what} not listening")


def run_rounds(store: Any, name: str, src_ptr: int, dst_ptr: int, dst: np.ndarray, src: np.ndarray,
               size: int, batch: int, rounds: int) -> dict[str, Any]:
    """put then get ``batch`` blocks per round; returns per-op GB/s of every round."""
    put_rates, get_rates = [], []
    for r in range(rounds + 1):  # round 0 warms up
        keys = [f"pybench/{name}/{r}/{i}" for i in range(batch)]
        dst[:] = 0
        t0 = time.perf_counter()
        codes = store.batch_put_from(keys, [src_ptr + i * size for i in range(batch)], [size] * batch)
        t1 = time.perf_counter()
        if any(c != 0 for c in codes):
            raise SystemExit(f"{name}: batch_put_from failed: {sorted(set(codes))}")
        got = store.batch_get_into(keys, [dst_ptr + i * size for i in range(batch)], [size] * batch)
        t2 = time.perf_counter()
        if got != [size] * batch:
            raise SystemExit(f"{name}: batch_get_into answered {sorted(set(got))}")
        if not np.array_equal(src, dst):
            raise SystemExit(f"{name}: the bytes read differ from the bytes written")
        store.batch_remove(keys, True)
        if r:
            put_rates.append(size * batch / (t1 - t0) / 1e9)
            get_rates.append(size * batch / (t2 - t1) / 1e9)
    return {"put_gbps": put_rates, "get_gbps": get_rates}


def bench_kvpool(binary: Path, procs: Procs, size: int, batch: int, rounds: int) -> dict[str, Any]:
    from kvpool.mooncake import MooncakeDistributedStore

    data = procs.dir / "kvpool"
    total = size * batch
    server = procs.start("kvpool", [str(binary), "--data-dir", str(data), "--listen", "127.0.0.1:0",
                                    "--metrics-listen", "off", "--dram-size", str(4 * total + (64 << 20)),
                                    "--ssd-capacity", "0"])
    for _ in range(600):
        if (data / "endpoint.json").exists() or server.poll() is not None:
            break
        time.sleep(0.05)
    ep = json.loads((data / "endpoint.json").read_text())
    key = (data / "api-key").read_text().strip()
    out: dict[str, Any] = {}
    rng = np.random.default_rng(1)
    for target, protocol in (("kvpool-zero-copy", "tcp"), ("kvpool-staged", "tcp"), ("kvpool-quic", "quic")):
        st = MooncakeDistributedStore()
        assert st.setup("localhost", "", 0, 0, protocol, "", ep["quic_addr"], api_key=key,
                        fingerprint=ep["fingerprint"]) == 0
        if target == "kvpool-zero-copy":
            buf = st.alloc_buffer(2 * total)
            mem = np.frombuffer(buf, dtype=np.uint8)
            src, dst = mem[:total], mem[total:]
            assert st.register_buffer(buf.address, buf.size) == 0
            regs = [buf.address]
        else:
            src, dst = np.empty(total, dtype=np.uint8), np.empty(total, dtype=np.uint8)
            regs = [src.ctypes.data, dst.ctypes.data]
            for a in (src, dst):
                assert st.register_buffer(a.ctypes.data, a.nbytes) == 0
        src[:] = rng.integers(0, 256, total, dtype=np.uint8)
        out[target] = run_rounds(st, target, src.ctypes.data, dst.ctypes.data, dst, src, size, batch, rounds)
        out[target]["transport"] = st.client.transport
        for p in regs:
            st.unregister_buffer(p)
        st.close()
    return out


def bench_mooncake(procs: Procs, size: int, batch: int, rounds: int) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    total = size * batch
    rpc, metrics = free_port(), free_port()
    master = procs.start("mooncake_master", ["mooncake_master", f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                                             f"--metrics_port={metrics}", "--metrics_host=127.0.0.1",
                                             "--enable_http_metadata_server=false"], cwd=procs.dir)
    wait_port(rpc, master, "mooncake_master")
    addr = f"127.0.0.1:{rpc}"
    storage = procs.start("mooncake_storage", [sys.executable, str(REPO / "bench/peers/mooncake_driver.py"), "serve",
                                               "--master", addr, "--segment", str(4 * total + (64 << 20))],
                          stdin=subprocess.PIPE)
    for _ in range(600):
        if "ready" in (procs.dir / "mooncake_storage.log").read_text(errors="replace") or storage.poll() is not None:
            break
        time.sleep(0.1)
    st = MooncakeDistributedStore()
    rc = st.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * total + (16 << 20), "tcp", "", addr)
    if rc != 0:
        raise SystemExit(f"mooncake setup failed: {rc}")
    src, dst = np.empty(total, dtype=np.uint8), np.empty(total, dtype=np.uint8)
    for a in (src, dst):
        assert st.register_buffer(a.ctypes.data, a.nbytes) == 0
    src[:] = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    res = run_rounds(st, "mooncake", src.ctypes.data, dst.ctypes.data, dst, src, size, batch, rounds)
    res["transport"] = "tcp"
    for a in (src, dst):
        st.unregister_buffer(a.ctypes.data)
    st.close()
    return {"mooncake-tcp": res}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--server-bin")
    p.add_argument("--skip-mooncake", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    procs = Procs()
    results: dict[str, Any] = {}
    try:
        results.update(bench_kvpool(server_binary(args.server_bin), procs, args.size, args.batch, args.rounds))
        if not args.skip_mooncake:
            try:
                import mooncake.store  # noqa: F401  # type: ignore[import-not-found]
            except ImportError:
                raise SystemExit("mooncake is not installed (bench/peers/setup.sh mooncake); "
                                 "--skip-mooncake runs kvpool alone") from None
            results.update(bench_mooncake(procs, args.size, args.batch, args.rounds))
    finally:
        procs.stop()
    fmt: Callable[[list[float]], str] = lambda xs: f"median {statistics.median(xs):6.2f}  best {max(xs):6.2f}"
    print(f"{args.batch} x {args.size >> 10} KiB per call, {args.rounds} rounds, GB/s")
    for name, r in results.items():
        print(f"{name:18s} put {fmt(r['put_gbps'])}   get {fmt(r['get_gbps'])}   ({r['transport']})")
    ratios: dict[str, dict[str, float]] = {}
    base = results.get("mooncake-tcp")
    if base:
        print("ratio to mooncake-tcp (median GB/s over median GB/s; > 1 is faster than Mooncake)")
        for name, r in results.items():
            if name == "mooncake-tcp":
                continue
            ratios[name] = {op: statistics.median(r[f"{op}_gbps"]) / statistics.median(base[f"{op}_gbps"])
                            for op in ("put", "get")}
            print(f"{name:18s} put x{ratios[name]['put']:5.2f}   get x{ratios[name]['get']:5.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "batch": args.batch, "rounds": args.rounds,
                                               "results": results, "ratio_to_mooncake": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
