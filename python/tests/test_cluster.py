"""The Python client and the Mooncake store pointed at a cluster master: nothing else to set, the
client finds out it is a master and routes through it to the storage nodes."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import kvpool
from kvpool.mooncake import INVALID_PARAMS, OBJECT_NOT_FOUND, MooncakeDistributedStore

from conftest import Cluster, Etcd, Server


def until(what: str, ok: Callable[[], bool], within: float = 10.0) -> None:
    """A put reaches the master's map when its node reports it, a moment later."""
    deadline = time.monotonic() + within
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def master_client(c: Cluster, **kw: object) -> kvpool.Client:
    return kvpool.Client(c.master.addr, c.api_key, fingerprint=c.master.fingerprint, **kw)  # type: ignore[arg-type]


def node_client(c: Cluster, node: Server) -> kvpool.Client:
    return kvpool.Client(node.addr, c.api_key, fingerprint=node.fingerprint, transport="quic")


def node_blocks(c: Cluster) -> list[int]:
    out = []
    for n in c.nodes:
        nc = node_client(c, n)
        out.append(int(nc.stats()["blocks"]))
        nc.close()
    return out


def test_a_client_of_the_master_stores_on_the_nodes_and_reads_back(cluster: Cluster) -> None:
    c = master_client(cluster)
    assert c.cluster, "the master was not recognised"
    single = kvpool.Client(cluster.nodes[0].addr, cluster.api_key, fingerprint=cluster.nodes[0].fingerprint)
    assert not single.cluster, "a storage node is a server of its own"
    single.close()
    rng = np.random.default_rng(3)
    keys = [f"pc/{i}" for i in range(24)]
    values = [rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes() for _ in keys]
    before = sum(node_blocks(cluster))
    assert c.put_batch(keys, values) == ["ok"] * len(keys)
    # The blocks are on the storage nodes (the master holds none).
    assert sum(node_blocks(cluster)) - before == len(keys)
    until("puts visible through the master", lambda: all(c.exists(keys)))
    got = c.get_batch(keys)
    assert [s for s, _ in got] == ["ok"] * len(keys)
    assert [v for _, v in got] == values
    assert c.get_size(keys[:2]) == [("ok", 64 << 10)] * 2
    assert c.get_batch(["pc/missing"]) == [("not-found", None)]
    # A chain: the resident prefix, with and without a hold (a cluster holds nothing).
    chain = [f"pc-chain/{i}" for i in range(6)]
    assert c.put_batch(chain[:4], [b"kv"] * 4, parents=[None, *chain[:3]]) == ["ok"] * 4
    until("chain visible", lambda: c.lookup(chain) == 4)
    assert c.lookup_lease(chain) == (4, [])
    assert c.remove([chain[1]]) == ["ok"]
    until("a removed block leaves the map", lambda: c.lookup(chain) == 1)
    # Removal by prefix and of everything goes to every node.
    removed, kept = c.remove_matching("pc-chain/", force=True)
    assert (removed, kept) == (3, 0)
    removed, _ = c.remove_all(force=True)
    assert removed == len(keys)
    assert sum(node_blocks(cluster)) == 0
    c.close()


def test_registered_memory_through_the_master(cluster: Cluster) -> None:
    c = master_client(cluster)
    buf = np.zeros(4 << 20, dtype=np.uint8)
    base = buf.ctypes.data
    assert c.register(base, buf.size) is False  # plain memory: no same-host sharing with a master
    buf[: 1 << 20] = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    keys = ["rm/0", "rm/1"]
    assert c.put_from(keys, [base, base + (512 << 10)], [512 << 10] * 2) == ["ok", "ok"]
    until("puts visible", lambda: all(c.exists(keys)))
    assert c.get_into(keys, [base + (2 << 20), base + (3 << 20)], [1 << 20] * 2) == [("ok", 512 << 10)] * 2
    assert np.array_equal(buf[2 << 20 : (2 << 20) + (512 << 10)], buf[: 512 << 10])
    assert np.array_equal(buf[3 << 20 : (3 << 20) + (512 << 10)], buf[512 << 10 : 1 << 20])
    assert c.get_into(["rm/0"], [base + (2 << 20)], [100]) == [("value-too-large", 512 << 10)]
    c.unregister(base)
    c.remove_all(force=True)
    c.close()


def test_mooncake_setup_with_the_master_address(cluster: Cluster) -> None:
    st = MooncakeDistributedStore()
    rc = st.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", cluster.master.addr,
                  api_key=cluster.api_key, fingerprint=cluster.master.fingerprint)
    assert rc == 0 and st.client.cluster
    assert st.put("mc/a", b"through the master") == 0
    until("put visible", lambda: st.is_exist("mc/a") == 1)
    assert st.get("mc/a") == b"through the master"
    buf = st.alloc_buffer(1 << 20)
    assert st.register_buffer(buf.address, buf.size) == 0
    assert st.get_into("mc/a", buf.address, 1 << 20) == len(b"through the master")
    assert bytes(np.frombuffer(buf, dtype=np.uint8)[:18]) == b"through the master"
    assert st.get_into("mc/a", buf.address, 4) == INVALID_PARAMS
    assert st.get_into("mc/none", buf.address, 10) == OBJECT_NOT_FOUND
    assert st.unregister_buffer(buf.address) == 0
    st.remove_all(True)
    st.close()


def test_etcd_names_the_master_to_the_client_and_to_mooncake(etcd: Etcd) -> None:
    c = Cluster(nodes=1, etcd=etcd.url)
    try:
        deadline = time.monotonic() + 20
        while True:  # the master takes the lead, the node joins it
            try:
                client = kvpool.Client(api_key=c.api_key, etcd=etcd.url)
                break
            except kvpool.KvpoolError as e:
                assert time.monotonic() < deadline, f"no leader in etcd: {e}"
                time.sleep(0.1)
        assert client.cluster
        until("the node joined", lambda: client.put_batch(["e/0"], [b"via etcd"]) == ["ok"], within=20)
        until("put visible", lambda: client.exists(["e/0"]) == [True])
        assert client.get_batch(["e/0"]) == [("ok", b"via etcd")]
        client.close()
        # Mooncake's metadata_server naming etcd, no master address: kvpool finds the leader.
        st = MooncakeDistributedStore()
        host = etcd.url.removeprefix("http://")
        assert st.setup("localhost", f"etcd://{host}", 0, 0, "tcp", "", "", api_key=c.api_key) == 0
        assert st.client.cluster and st.get("e/0") == b"via etcd"
        st.close()
    finally:
        c.stop()


def test_a_killed_master_is_replaced_through_etcd_and_every_block_stays(etcd: Etcd) -> None:
    """Two masters elect a leader in etcd; the leader is killed (no close). A client that found
    the cluster through etcd goes on with the new leader: the blocks put before (on the nodes,
    which join the new leader and report what they hold) read back, and new puts work."""
    c = Cluster(nodes=2, etcd=etcd.url, masters=2)
    try:
        a_killed_master_is_replaced(c, etcd.url)
    finally:
        c.stop()


def a_killed_master_is_replaced(c: Cluster, etcd_url: str) -> None:
    """The failover test's steps on cluster ``c`` (two masters, found through etcd)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            client = kvpool.Client(api_key=c.api_key, etcd=etcd_url, timeout=5.0, dead_after=1.0)
            break
        except kvpool.KvpoolError as e:
            assert time.monotonic() < deadline, f"no leader in etcd: {e}"
            time.sleep(0.1)
    keys = [f"fo/{i}" for i in range(8)]
    values = [bytes([i]) * 4096 for i in range(8)]
    until("both nodes joined", lambda: client.put_batch(keys, values) == ["ok"] * 8, within=20)
    until("puts visible", lambda: client.exists(keys) == [True] * 8)

    def leads(m: Server) -> bool:
        direct = kvpool.Client(m.addr, c.api_key, fingerprint=m.fingerprint, transport="quic")
        try:
            direct.exists(["x"])  # routed: a standby answers not-leader
            return True
        except kvpool.KvpoolError:
            return False
        finally:
            direct.close()

    leader = next(m for m in c.masters if leads(m))
    leader.kill()
    # Calls may fail while the standby takes over and the nodes join it; never wrong bytes.
    deadline = time.monotonic() + 30
    while True:
        try:
            got = client.get_batch(keys)
            assert all(st != "ok" or v == values[i] for i, (st, v) in enumerate(got)), got
            if [st for st, _ in got] == ["ok"] * 8:
                break
        except kvpool.KvpoolError:
            pass
        assert time.monotonic() < deadline, "the blocks never served through the new leader"
        time.sleep(0.1)
    assert client.put_batch(["fo/new"], [b"after"]) == ["ok"]
    until("new put visible", lambda: client.get_batch(["fo/new"]) == [("ok", b"after")])
    client.close()
