"""Hosts as network namespaces on one machine (root only): a bridge in the root namespace, one
namespace per host joined to it by a veth pair, every host on one /24. The root namespace is a
host too (the bridge's address), where a test can run what all hosts reach (a master).

Traffic between hosts crosses the veth pairs and the bridge at the link's MTU, as between
machines; the filesystem is shared, so data directories and Unix sockets work as on one host.

Every veth gets the offloads a server NIC has on by default (GRO, GSO, TSO, UDP GSO, UDP GRO
forwarding, set with ``ethtool``) unless bare veths are asked for (``bare=True`` or
``KVPOOL_NETNS_BARE=1``: the veth as the kernel makes it). The twin of ``netns/src`` (Rust),
whose ``offloads.rs`` says why each feature is set.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from typing import Optional

# ``ethtool -K`` settings: a server NIC's offloads, and a bare veth's (the kernel's defaults).
NIC = ["gro", "on", "gso", "on", "tso", "on", "tx-udp-segmentation", "on", "rx-udp-gro-forwarding", "on"]
BARE = ["gro", "off", "rx-udp-gro-forwarding", "off", "gso", "on", "tso", "on", "tx-udp-segmentation", "on"]
# What ``offloads()`` reports, as ``ethtool -k`` names it.
REPORTED = [
    "generic-receive-offload",
    "rx-udp-gro-forwarding",
    "generic-segmentation-offload",
    "tcp-segmentation-offload",
    "tx-udp-segmentation",
]
NO_ETHTOOL = ("ethtool is not installed: the hosts' veths get a NIC's offloads with it "
              "(Debian/Ubuntu: `apt-get install ethtool`), or ask for bare veths (KVPOOL_NETNS_BARE=1)")


def available() -> Optional[str]:
    """``None`` when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "no iproute2 (ip)"
    return None


def _ethtool(prefix: list[str], *args: str) -> str:
    if shutil.which("ethtool") is None:
        raise RuntimeError(NO_ETHTOOL)
    r = subprocess.run([*prefix, "ethtool", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ethtool {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """``n`` hosts named ``h1``..``hn`` at ``ip(i)``; the root namespace is at ``root_ip``."""

    def __init__(self, n: int, mtu: int = 1500, bare: Optional[bool] = None) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.bridge = f"kvb{tag}"
        self.net = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.root_ip = f"{self.net}.254"
        self.names: list[str] = []
        self.veths: list[str] = []
        self.nic = False
        if bare is None:
            bare = os.environ.get("KVPOOL_NETNS_BARE") == "1"
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
                self.veths.append(veth)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "mtu", str(mtu), "up")
            if not bare:
                self.set_offloads(True)
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

    def _ends(self) -> list[tuple[list[str], str]]:
        """Every veth end: (the argv prefix of its namespace, its name)."""
        ends: list[tuple[list[str], str]] = []
        for i, veth in enumerate(self.veths):
            ends += [([], veth), (self.prefix(i + 1), "eth0")]
        return ends

    def set_offloads(self, nic: bool) -> None:
        """Give every veth end a NIC's offloads (``True``) or a bare veth's (``False``)."""
        for prefix, dev in self._ends():
            _ethtool(prefix, "-K", dev, *(NIC if nic else BARE))
        self.nic = nic

    def offloads(self) -> dict[str, str]:
        """Per ``REPORTED`` feature, read back with ``ethtool -k``: on at every veth end, off at
        every one, or mixed."""
        seen: dict[str, set[bool]] = {name: set() for name in REPORTED}
        for prefix, dev in self._ends():
            for line in _ethtool(prefix, "-k", dev).splitlines():
                k, _, v = line.strip().partition(":")
                if k in seen:
                    seen[k].add(v.strip().startswith("on"))
        return {k: "on" if v == {True} else "off" if v <= {False} else "mixed" for k, v in seen.items()}

    def link(self, i: int, up: bool) -> None:
        """Plug or unplug host ``i``'s cable (its end of the veth pair)."""
        _ip("-n", self.ns(i), "link", "set", "eth0", "up" if up else "down")

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.names = []
        self.veths = []
