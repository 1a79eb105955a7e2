"""Fixtures: a real kvpool server process per test session (or per test when asked)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The connector's tests drive vLLM's scheduler: they are collected where vLLM is installed (the
# venv of .ci/vllm-e2e.sh, which runs them), never in the plain client suite.
try:
    import vllm  # noqa: F401
except ImportError:
    collect_ignore = ["test_vllm_connector.py", "test_vllm_units.py"]


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
    """A kvpool server on loopback with its own data directory."""

    def __init__(self, dram: str = "256MiB", extra: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-pytest-"))
        self.args = ["--data-dir", str(self.dir), "--metrics-listen", "off", "--dram-size", dram,
                     "--ssd-capacity", "0", *extra]
        self._spawn("127.0.0.1:0")

    def _spawn(self, listen: str) -> None:
        self.log = open(self.dir / "server.log", "ab")
        (self.dir / "endpoint.json").unlink(missing_ok=True)
        self.proc = subprocess.Popen([str(server_binary()), "--listen", listen, *self.args],
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
        self.api_key = (self.dir / "api-key").read_text().strip()

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
