"""Fixtures: a real kvpool server process per test session (or per test when asked)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]

# The connector's tests drive vLLM's scheduler: they are collected where vLLM is installed (the
# venv of .ci/vllm-e2e.sh, which runs them), never in the plain client suite.
try:
    import vllm  # noqa: F401
except ImportError:
    collect_ignore = ["test_vllm_connector.py", "test_vllm_units.py", "test_vllm_layouts.py", "test_vllm_robust.py",
                      "test_mooncake_consumers.py"]


def server_binary() -> Path:
    """``KVPOOL_SERVER_BIN``, else the workspace's build of ``kvpool-server`` (built if missing)."""
    explicit = os.environ.get("KVPOOL_SERVER_BIN")
    if explicit:
        return Path(explicit)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    target = Path(json.loads(meta.stdout)["target_directory"])
    for profile in ("release", "debug"):
        b = target / profile / "kvpool-server"
        if b.exists():
            return b
    subprocess.run(["cargo", "build", "-q", "-p", "kvpool-server", "--bin", "kvpool-server"], cwd=REPO, check=True)
    return target / "debug" / "kvpool-server"


class Server:
    """A kvpool server with its own data directory: on loopback, or at ``listen`` on the host
    that the argv prefix ``host`` runs commands on (``netns.Hosts.prefix``)."""

    def __init__(self, dram: str = "256MiB", extra: tuple[str, ...] = (), api_key: Optional[str] = None,
                 listen: str = "127.0.0.1:0", host: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-pytest-"))
        self.given_key = api_key
        self.host = list(host)
        self.args = ["--data-dir", str(self.dir), "--metrics-listen", "off", "--dram-size", dram,
                     "--ssd-capacity", "0", *extra]
        self._spawn(listen)

    def _spawn(self, listen: str) -> None:
        self.log = open(self.dir / "server.log", "ab")
        (self.dir / "endpoint.json").unlink(missing_ok=True)
        self.proc = subprocess.Popen([*self.host, str(server_binary()), "--listen", listen, *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (self.dir / "endpoint.json").exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool-server exited: {(self.dir / 'server.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("kvpool-server did not write endpoint.json within 60 s")
            time.sleep(0.05)
        ep = json.loads((self.dir / "endpoint.json").read_text())
        self.addr: str = ep["quic_addr"]
        self.fingerprint: str = ep["fingerprint"]
        self.api_key = self.given_key or (self.dir / "api-key").read_text().strip()

    def kill(self) -> None:
        """SIGKILL: no close reaches the clients (a crashed or unplugged server)."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def start_again(self) -> None:
        """The same server again: same address, data directory, certificate and key."""
        self._spawn(self.addr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """A cluster pool on loopback: a master and storage nodes that join it, one API key (admin)
    accepted by all of them. Clients connect to ``master``."""

    def __init__(self, nodes: int = 2, dram: str = "64MiB", etcd: Optional[str] = None,
                 hosts: Optional[Any] = None, masters: int = 1) -> None:
        """With ``hosts`` (``netns.Hosts``): the master on the root namespace's address, storage
        node i on host i+1. With etcd, ``masters`` masters elect a leader there."""
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-pytest-cluster-"))
        self.api_key = secrets.token_hex(16)
        (self.dir / "cluster.key").write_text(self.api_key + "\n")
        digest = hashlib.sha256(self.api_key.encode()).hexdigest()
        (self.dir / "cluster.toml").write_text(
            f'[[auth.keys]]\ntenant = "default"\nsha256 = "{digest}"\nadmin = true\n'
            "[cluster]\nreport_ms = 50\nnode_timeout_ms = 1000\n"
            + (f'etcd = "{etcd}"\n' if etcd else "")
        )
        conf = ("--config", str(self.dir / "cluster.toml"))
        at = (lambda i: f"{hosts.ip(i)}:0") if hosts else (lambda i: "127.0.0.1:0")
        self.masters = [
            Server(dram=dram, extra=(*conf, "--role", "master", "--node-name", f"m{i}"), api_key=self.api_key,
                   listen=f"{hosts.root_ip}:0" if hosts else "127.0.0.1:0")
            for i in range(masters)
        ]
        self.master = self.masters[0]
        # With etcd, nodes find the leading master there.
        find = () if etcd else ("--master", self.master.addr, "--master-fingerprint", self.master.fingerprint)
        self.nodes = [
            Server(dram=dram, api_key=self.api_key, listen=at(i + 1), host=tuple(hosts.prefix(i + 1)) if hosts else (),
                   extra=(*conf, "--role", "storage", *find,
                          "--master-key-file", str(self.dir / "cluster.key"), "--node-name", f"s{i}"))
            for i in range(nodes)
        ]

    def stop(self) -> None:
        for s in (*self.nodes, *self.masters):
            s.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def small_server() -> Iterator[Server]:
    """A server with a 4 MiB segment, for no-space behaviour."""
    s = Server(dram="4MiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.stop()


class Etcd:
    """A real etcd (Debian's etcd-server, installed by ``bench/peers/setup.sh etcd``) on free
    ports of ``ip`` (loopback unless the hosts of a test must reach it)."""

    def __init__(self, ip: str = "127.0.0.1") -> None:
        import socket
        import urllib.request

        def free() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return int(s.getsockname()[1])

        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-pytest-etcd-"))
        client, peer = free(), free()
        self.url = f"http://{ip}:{client}"
        peer_url = f"http://{ip}:{peer}"
        self.log = open(self.dir / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            ["etcd", "--data-dir", str(self.dir / "data"), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer_url,
             "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"default={peer_url}"],
            stdout=subprocess.DEVNULL, stderr=self.log,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not become healthy: {(self.dir / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd() -> Iterator[Etcd]:
    """A running etcd; skipped where none is installed unless ``KVPOOL_REQUIRE_PEERS`` is set
    (CI sets it: there a missing etcd fails)."""
    if shutil.which("etcd") is None and os.environ.get("KVPOOL_REQUIRE_PEERS", "") in ("", "0"):
        pytest.skip("etcd not installed (bench/peers/setup.sh etcd) and KVPOOL_REQUIRE_PEERS unset")
    e = Etcd()
    yield e
    e.stop()


@pytest.fixture(params=["tcp", "quic"])
def store(request: pytest.FixtureRequest, server: Server):  # type: ignore[no-untyped-def]
    """A ``kvpool.mooncake`` store set up on same-host shared memory (``tcp``) and on QUIC."""
    from kvpool.mooncake import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    rc = st.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, request.param, "", server.addr,
                  api_key=server.api_key, fingerprint=server.fingerprint)
    assert rc == 0
    assert st.client.transport == ("shm" if request.param == "tcp" else "quic")
    assert st.client.control == ("local" if request.param == "tcp" else "quic")
    yield st
    st.remove_all(True)
    st.close()
