"""KV events from Python: a router-style consumer follows what the pool stores and drops."""

from __future__ import annotations

import threading
import time

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
    # Resume from the cursor on a new subscription of the same log: the same events, in order.
    again = c.subscribe(from_seq=events[0]["seq"], log_id=sub.log_id)
    b = again.next(timeout=5)
    assert b is not None and [e["seq"] for e in b["events"]] == [e["seq"] for e in events]
    again.close()
    with pytest.raises(kvpool.KvpoolError) as err:
        again.next(timeout=1)
    assert err.value.code == "closed"
    with pytest.raises(kvpool.KvpoolError) as err:
        c.subscribe(from_seq=10**9)
    assert err.value.code == "invalid-argument"
    with pytest.raises(kvpool.KvpoolError) as err:
        c.subscribe(from_seq=1, log_id=sub.log_id ^ 1)
    assert err.value.code == "expired"
    sub.close()
    c.close()


def test_close_ends_a_next_waiting_in_another_thread(server: Server) -> None:
    c = kvpool.Client(server.addr, server.api_key, fingerprint=server.fingerprint)
    sub = c.subscribe()
    assert sub.next(timeout=5) is not None
    outcome: list[str] = []

    def wait() -> None:
        try:
            sub.next()
            outcome.append("returned")
        except kvpool.KvpoolError as e:
            outcome.append(e.code)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    sub.close()
    t.join(timeout=5)
    assert not t.is_alive() and outcome == ["closed"]
    # A huge timeout is a long wait, not an error.
    again = c.subscribe()
    assert again.next(timeout=1e30) is not None
    c.close()
