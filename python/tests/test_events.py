"""KV events from Python: a router-style consumer follows what the pool stores and drops."""

from __future__ import annotations

import pytest

import kvpool

from conftest import Server


def test_subscribe_sees_stores_and_removes_and_resumes(server: Server) -> None:
    c = kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint)
    sub = c.subscribe()
    first = sub.next(timeout=5)
    assert first is not None and first["events"] == [] and first["lagged"] == 0
    c.put_batch(["py-a", "py-b"], [b"1", b"22"], parents=[None, "py-a"])
    c.remove(["py-a"])
    events = []
    while len(events) < 3:
        b = sub.next(timeout=5)
        assert b is not None, f"only {events}"
        events.extend(b["events"])
    assert [(e["kind"], e["key"], e["tier"]) for e in events] == [
        ("stored", b"py-a", "dram"),
        ("stored", b"py-b", "dram"),
        ("removed", b"py-a", "dram"),
    ]
    assert events[1]["parent"] == b"py-a" and events[1]["size"] == 2
    assert sub.next(timeout=0.2) is None, "nothing else happened"
    # Resume from the cursor on a new subscription: the same events, in order.
    again = c.subscribe(from_seq=events[0]["seq"])
    b = again.next(timeout=5)
    assert b is not None and [e["seq"] for e in b["events"]] == [e["seq"] for e in events]
    again.close()
    with pytest.raises(kvpool.KvpoolError) as err:
        again.next(timeout=1)
    assert err.value.code == "closed"
    with pytest.raises(kvpool.KvpoolError) as err:
        c.subscribe(from_seq=10**9)
    assert err.value.code == "invalid-argument"
    sub.close()
    c.close()
