"""Hosts as network namespaces on one machine (root only): a bridge in the root namespace, one
namespace per host joined to it by a veth pair, every host on one /24. The root namespace is a
host too (the bridge's address), where a test can run what all hosts reach (a master).

Traffic between hosts crosses the veth pairs and the bridge at the link's MTU, as between
machines; the filesystem is shared, so data directories and Unix sockets work as on one host.
"""

from __future__ import annotations

import os
import random
import subprocess
from typing import Optional


def available() -> Optional[str]:
    """``None`` when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "no iproute2 (ip)"
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """``n`` hosts named ``h1``..``hn`` at ``ip(i)``; the root namespace is at ``root_ip``."""

    def __init__(self, n: int, mtu: int = 1500) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.bridge = f"kvb{tag}"
        self.net = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.root_ip = f"{self.net}.254"
        self.names: list[str] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "mtu", str(mtu), "up")
            _ip("addr", "add", f"{self.root_ip}/24", "dev", self.bridge)
            for i in range(1, n + 1):
                ns = f"kvh{tag}-{i}"
                _ip("netns", "add", ns)
                self.names.append(ns)
                veth = f"kv{tag}v{i}"
                _ip("link", "add", veth, "mtu", str(mtu), "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "mtu", str(mtu), "up")
        except Exception:
            self.close()
            raise

    def ip(self, i: int) -> str:
        return f"{self.net}.{i}"

    def ns(self, i: int) -> str:
        return self.names[i - 1]

    def prefix(self, i: int) -> list[str]:
        """Argv prefix that runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]

    def link(self, i: int, up: bool) -> None:
        """Plug or unplug host ``i``'s cable (its end of the veth pair)."""
        _ip("-n", self.ns(i), "link", "set", "eth0", "up" if up else "down")

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.names = []
