"""A cluster across hosts (network namespaces on a bridge, ``netns.Hosts``): a master on the root
namespace, one storage node per host, and clients run on those hosts. An engine's blocks land on
its own host's node; another host reads them over the network; a host whose cable is pulled, or
whose node is killed, costs only its blocks, and serves again when it is back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvpool
import netns
from conftest import Cluster

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.Hosts]:
    why = netns.available()
    if why:
        if os.environ.get("KVPOOL_REQUIRE_PEERS") == "1":
            pytest.fail(f"cross-host tests required (KVPOOL_REQUIRE_PEERS=1): {why}")
        pytest.skip(why)
    h = netns.Hosts(2)
    yield h
    h.close()


def on_host(h: netns.Hosts, i: int, c: Cluster, **steps: Any) -> dict[str, Any]:
    cmd = {"master": c.master.addr, "api_key": c.api_key, "fingerprint": c.master.fingerprint, **steps}
    r = subprocess.run([*h.prefix(i), sys.executable, str(HERE / "host_client.py"), json.dumps(cmd)],
                       capture_output=True, text=True, timeout=60, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def holders(c: Cluster, keys: list[str]) -> list[list[int]]:
    """Per key, which storage nodes (their index in ``c.nodes``) hold it, asked of each node."""
    out: list[list[int]] = [[] for _ in keys]
    for i, n in enumerate(c.nodes):
        nc = kvpool.Client(n.addr, c.api_key, fingerprint=n.fingerprint, transport="quic")
        for k, here in zip(keys, nc.exists(keys)):
            if here:
                out[keys.index(k)].append(i)
        nc.close()
    return out


def test_an_engines_blocks_land_on_its_own_hosts_node_and_serve_every_host(hosts: netns.Hosts) -> None:
    c = Cluster(nodes=2, hosts=hosts)
    try:
        mine = {i: [f"h{i}-chain-{j}" for j in range(6)] for i in (1, 2)}
        # Both nodes joined before the puts (else placement has only one to choose from).
        probe = kvpool.Client(c.master.addr, c.api_key, fingerprint=c.master.fingerprint)
        deadline = time.monotonic() + 20
        while len([s for s in c.nodes if s.addr]) < 2 or probe.lookup(["x"]) != 0:
            time.sleep(0.05)
            assert time.monotonic() < deadline
        # Three chains per host, hosts taking turns: without locality the master would spread
        # new chains over both nodes.
        for j in range(0, 6, 2):
            for i in (2, 1):
                r = on_host(hosts, i, c, put=mine[i][j:j + 2])
                assert r["cluster"] and r["put"] == ["ok"] * 2, r
        # Each engine's blocks went to its own host's node (node i-1 runs on host i).
        assert holders(c, mine[1]) == [[0]] * 6
        assert holders(c, mine[2]) == [[1]] * 6
        # Every host reads every block, across the bridge when it is on the other host.
        deadline = time.monotonic() + 10
        while probe.lookup(mine[1]) < 6 or probe.lookup(mine[2]) < 6:  # reports reach the master
            time.sleep(0.02)
            assert time.monotonic() < deadline, "the master never learnt of the puts"
        for i in (1, 2):
            r = on_host(hosts, i, c, get=mine[1] + mine[2])
            assert r["get"] == ["ok"] * 12, r
        # Host 1's cable is pulled: its blocks are misses for host 2 within the node bound (not
        # the request timeout), host 2's own still serve; plugged back, host 1's node (alive all
        # along, its blocks in DRAM) rejoins and serves them again.
        hosts.link(1, False)
        r = on_host(hosts, 2, c, get=mine[1] + mine[2])
        assert r["get"] == ["not-found"] * 6 + ["ok"] * 6 and r["get_s"] < 2.0, r
        hosts.link(1, True)
        deadline = time.monotonic() + 15
        while (r := on_host(hosts, 2, c, get=mine[1]))["get"] != ["ok"] * 6:
            assert time.monotonic() < deadline, f"host 1's blocks never served again: {r}"
            time.sleep(0.2)
        # Host 1's node dies (killed: silent): host 2 still reads its own blocks, and host 1's
        # are misses, within the node bound, not the request timeout.
        c.nodes[0].kill()
        r = on_host(hosts, 2, c, get=mine[1] + mine[2])
        assert r["get"] == ["not-found"] * 6 + ["ok"] * 6, r
        assert r["get_s"] < 2.0, r
        probe.close()
    finally:
        c.stop()


def test_a_killed_master_is_replaced_through_etcd_across_hosts(hosts: netns.Hosts) -> None:
    """The failover test with the storage nodes on their own hosts: they find the new leader in
    etcd (on the root namespace's address) and report to it across the bridge."""
    import shutil

    from conftest import Etcd
    from test_cluster import a_killed_master_is_replaced

    if shutil.which("etcd") is None and os.environ.get("KVPOOL_REQUIRE_PEERS", "") in ("", "0"):
        pytest.skip("etcd not installed (bench/peers/setup.sh etcd) and KVPOOL_REQUIRE_PEERS unset")
    etcd = Etcd(hosts.root_ip)
    c = Cluster(nodes=2, etcd=etcd.url, masters=2, hosts=hosts)
    try:
        a_killed_master_is_replaced(c, etcd.url)
    finally:
        c.stop()
        etcd.stop()
