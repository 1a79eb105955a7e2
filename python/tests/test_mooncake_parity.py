"""kvpool's Mooncake API side by side with real Mooncake Store: the same checks, the same answers.

Each check is a small function of a store (Mooncake's ``MooncakeDistributedStore`` or kvpool's)
and a key maker; it returns what a caller observes (return codes, values, sizes, the bytes a
tensor method stored). The checks of bytes in and out are here; ``parity_checks_api.py`` (replicas,
buffers, ranges, sessions, group ids, tasks, segments, the value types) and
``parity_checks_tensors.py`` (every tensor method: layouts byte for byte, tensor parallelism,
parallel IO, safetensors) register more into ``parity_registry.py``. The checks run
once against a real ``mooncake_master`` with an in-process Mooncake store lending a segment, and
against kvpool (one server, and a cluster of a master and two storage nodes). Results must be
equal except for the checks in ``DELIBERATE``, which README.md's "Deliberate differences from
Mooncake" paragraph lists too; a deliberate difference that no longer differs fails as well, so
the table stays true.

``test_tensors_cross_between_mooncake_and_kvpool`` copies the objects one side's tensor methods
stored to the other side and reads them there.

Mooncake is skipped where it is not installed (``bench/peers/setup.sh mooncake``) unless
``KVPOOL_REQUIRE_PEERS=1``; checks of the tensor methods need torch (and ``safetensors``) as well
and are skipped without it unless ``KVPOOL_REQUIRE_TORCH=1`` (CI's plain interpreter has Mooncake
but no torch; its tensor job installs the CPU wheel of torch and sets both variables).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import Cluster, Server

from parity_registry import CHECKS, DELIBERATE, TENSOR_CHECKS, Check, Key, _Buffer, _replicate_config, check

import parity_checks_api  # noqa: F401  (registers its checks)
import parity_checks_tensors  # noqa: F401

# ---- bytes ------------------------------------------------------------------------------------


@check
def put_then_get(s: Any, k: Key) -> Any:
    return s.put(k("a"), b"alpha"), s.get(k("a"))


@check
def get_missing(s: Any, k: Key) -> Any:
    return s.get(k("missing")), s.get_size(k("missing")), s.is_exist(k("missing"))


@check
def put_existing_key(s: Any, k: Key) -> Any:
    return s.put(k("a"), b"first"), s.put(k("a"), b"second"), s.get(k("a"))


@check
def put_batch_with_an_existing_key(s: Any, k: Key) -> Any:
    first = s.put(k("b"), b"old")
    return first, s.put_batch([k("a"), k("b")], [b"new-a", b"new-b"]), s.get(k("a")), s.get(k("b"))


@check
def put_empty_value(s: Any, k: Key) -> Any:
    return s.put(k("e"), b""), s.is_exist(k("e")), s.get_size(k("e")), s.get(k("e"))


@check
def put_batch_with_an_empty_value(s: Any, k: Key) -> Any:
    return s.put_batch([k("a"), k("e")], [b"a", b""]), s.batch_is_exist([k("a"), k("e")])


@check
def put_large_value(s: Any, k: Key) -> Any:
    v = os.urandom(3 << 20)
    return s.put(k("big"), v), s.get_size(k("big")), s.get(k("big")) == v


@check
def put_with_hard_pin(s: Any, k: Key) -> Any:
    cfg = _replicate_config(s)
    cfg.with_hard_pin = True
    return s.put(k("p"), b"pinned", cfg), s.get(k("p"))


@check
def upsert_empty_value(s: Any, k: Key) -> Any:
    return s.upsert(k("u"), b""), s.upsert_batch([k("a"), k("b")], [b"a", b""]), s.batch_is_exist([k("u"), k("a")])


@check
def upsert_new_and_unread(s: Any, k: Key) -> Any:
    return s.upsert(k("u"), b"one"), s.upsert(k("u"), b"two"), s.get(k("u"))


@check
def upsert_after_get(s: Any, k: Key) -> Any:
    return s.put(k("u"), b"one"), s.get(k("u")), s.upsert(k("u"), b"two"), s.get(k("u"))


@check
def upsert_batch(s: Any, k: Key) -> Any:
    s.put(k("a"), b"old")
    return s.upsert_batch([k("a"), k("b")], [b"A", b"B"]), s.get_batch([k("a"), k("b")])


@check
def get_batch_mixed(s: Any, k: Key) -> Any:
    s.put(k("a"), b"x")
    return s.get_batch([k("a"), k("missing"), k("a")])


@check
def exist_and_size(s: Any, k: Key) -> Any:
    s.put(k("a"), b"12345")
    return s.is_exist(k("a")), s.batch_is_exist([k("a"), k("no")]), s.get_size(k("a"))


# ---- removal ----------------------------------------------------------------------------------


@check
def remove_unread_and_missing(s: Any, k: Key) -> Any:
    s.put(k("a"), b"x")
    return s.remove(k("a")), s.remove(k("a")), s.is_exist(k("a"))


@check
def remove_after_get(s: Any, k: Key) -> Any:
    s.put(k("a"), b"x")
    s.get(k("a"))
    return s.remove(k("a")), s.remove(k("a"), True), s.is_exist(k("a"))


@check
def batch_remove_mixed(s: Any, k: Key) -> Any:
    s.put_batch([k("a"), k("b")], [b"a", b"b"])
    return s.batch_remove([k("a"), k("missing"), k("b")], True)


# ---- registered memory ------------------------------------------------------------------------


@check
def register_and_unregister(s: Any, k: Key) -> Any:
    a = np.zeros(1 << 16, np.uint8)
    return s.register_buffer(a.ctypes.data, a.nbytes), s.unregister_buffer(a.ctypes.data)


@check
def put_from_then_get_into(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 20) as b:
        put = s.put_from(k("f"), b.addr, 4096)
        got = s.get_into(k("f"), b.addr + 8192, 4096)
        return b.rc, put, got, bool(np.array_equal(b.a[:4096], b.a[8192:12288])), s.get_size(k("f"))


@check
def put_from_existing_key(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        return s.put_from(k("f"), b.addr, 100), s.put_from(k("f"), b.addr + 1, 50), s.get_size(k("f"))


@check
def put_from_zero_bytes(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        return s.put_from(k("z"), b.addr, 0), s.is_exist(k("z"))


@check
def batch_put_from_with_zero_bytes(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        put = s.batch_put_from([k("a"), k("b")], [b.addr, b.addr], [0, 10])
        multi = s.batch_put_from_multi_buffers([k("c"), k("d")], [[b.addr], [b.addr]], [[0], [10]])
        return put, multi, s.batch_is_exist([k("a"), k("b"), k("c"), k("d")])


@check
def upsert_from_unread(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        return s.put_from(k("f"), b.addr, 100), s.upsert_from(k("f"), b.addr + 1, 50), s.get_size(k("f"))


@check
def get_into_missing(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        return s.get_into(k("missing"), b.addr, 100)


@check
def get_into_a_buffer_too_small(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        s.put_from(k("f"), b.addr, 100)
        return s.get_into(k("f"), b.addr + 1000, 99), s.get_into(k("f"), b.addr + 1000, 100)


@check
def batch_get_into_a_buffer_too_small(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        s.batch_put_from([k("a"), k("b")], [b.addr, b.addr], [100, 3])
        return s.batch_get_into([k("a"), k("b"), k("missing")], [b.addr + 1000, b.addr + 2000, b.addr + 3000],
                                [10, 100, 100])


@check
def batch_put_from_and_get_into(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 20) as b:
        keys = [k(str(i)) for i in range(4)]
        put = s.batch_put_from(keys, [b.addr + i * 1024 for i in range(4)], [1024] * 4)
        got = s.batch_get_into(keys, [b.addr + (1 << 19) + i * 1024 for i in range(4)], [1024] * 4)
        return put, got, bool(np.array_equal(b.a[:4096], b.a[1 << 19:(1 << 19) + 4096]))


@check
def batch_put_from_with_an_existing_key(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        s.put_from(k("a"), b.addr, 10)
        return s.batch_put_from([k("a"), k("b")], [b.addr + 1, b.addr], [20, 30]), s.get_size(k("a"))


@check
def batch_upsert_from(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        s.put_from(k("a"), b.addr, 10)
        return s.batch_upsert_from([k("a"), k("b")], [b.addr + 1, b.addr], [20, 30]), s.get_size(k("a"))


@check
def multi_buffers_round_trip(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b, _Buffer(s, 1 << 16, fill=False) as d:
        put = s.batch_put_from_multi_buffers([k("m")], [[b.addr, b.addr + 5000]], [[300, 200]])
        got = s.batch_get_into_multi_buffers([k("m")], [[d.addr, d.addr + 9000]], [[250, 250]])
        same = bytes(b.a[:300]) + bytes(b.a[5000:5200]) == bytes(d.a[:250]) + bytes(d.a[9000:9250])
        return put, got, same, s.get_size(k("m"))


@check
def multi_buffers_too_small(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        s.put_from(k("m"), b.addr, 100)
        return s.batch_get_into_multi_buffers([k("m")], [[b.addr + 1000, b.addr + 2000]], [[10, 20]])


# ---- other ------------------------------------------------------------------------------------


@check
def health(s: Any, k: Key) -> Any:
    return s.health_check()


@check
def hostname_is_a_string(s: Any, k: Key) -> Any:
    h = s.get_hostname()
    return type(h).__name__, bool(h)


@check
def put_parts_and_upsert_parts(s: Any, k: Key) -> Any:
    put = s.put_parts(k("p"), b"ab", memoryview(b"cd"), np.frombuffer(b"ef", np.uint8))
    again = s.put_parts(k("p"), b"x")
    first = s.get(k("p"))
    up = s.upsert_parts(k("p"), b"y", b"z")
    return put, again, first, up, s.get(k("p")), s.upsert_parts(k("new"), b"n"), s.get(k("new"))


@check
def put_parts_of_wrong_buffers(s: Any, k: Key) -> Any:
    out = []
    for part in (np.zeros((2, 2), np.uint8), np.zeros(4, np.float32), "text"):
        try:
            out.append(s.put_parts(k("w"), part))
        except Exception as e:
            out.append(type(e).__name__)
    return out, s.is_exist(k("w"))


@check
def put_parts_of_no_bytes(s: Any, k: Key) -> Any:
    return s.put_parts(k("n")), s.put_parts(k("e"), b"", b""), s.upsert_parts(k("u"), b""), \
        s.batch_is_exist([k("n"), k("e"), k("u")])


@check
def remove_by_regex(s: Any, k: Key) -> Any:
    s.put_batch([k("rx/1"), k("rx/2"), k("ry/1")], [b"1", b"2", b"3"])
    base = k("")
    return (s.remove_by_regex("^" + base + "rx/"), s.batch_is_exist([k("rx/1"), k("rx/2"), k("ry/1")]),
            s.remove_by_regex(base + "nothing-matches"), s.remove_by_regex("("))


@check
def remove_by_regex_keeps_leased(s: Any, k: Key) -> Any:
    s.put_batch([k("a"), k("b")], [b"1", b"2"])
    s.get(k("a"))
    base = k("")
    return s.remove_by_regex("^" + base), s.is_exist(k("a")), s.remove_by_regex("^" + base, True), s.is_exist(k("a"))


# ---- running them -----------------------------------------------------------------------------


def _require_mooncake() -> None:
    have = importlib.util.find_spec("mooncake") is not None and shutil.which("mooncake_master") is not None
    if not have:
        if os.environ.get("KVPOOL_REQUIRE_PEERS") == "1":
            pytest.fail("KVPOOL_REQUIRE_PEERS=1 but Mooncake is not installed (bench/peers/setup.sh mooncake)")
        pytest.skip("Mooncake not installed (bench/peers/setup.sh mooncake)")


def _have_torch() -> bool:
    have = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("safetensors") is not None
    if not have and os.environ.get("KVPOOL_REQUIRE_TORCH") == "1":
        pytest.fail("KVPOOL_REQUIRE_TORCH=1 but torch or safetensors is not installed")
    return have


def _checks() -> dict[str, Check]:
    """Every check; the tensor checks only where torch is installed (not in CI's plain interpreter)."""
    return {**CHECKS, **TENSOR_CHECKS} if _have_torch() else CHECKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(store: Any, prefix: str, checks: dict[str, Check]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in checks.items():
        try:
            out[name] = fn(store, lambda s, name=name: f"{prefix}/{name}/{s}")
        except Exception as e:  # an exception is an observable outcome too
            out[name] = ("raised", type(e).__name__)
    return out


@pytest.fixture(scope="module")
def mooncake_store() -> Iterator[Any]:
    """Real Mooncake: a ``mooncake_master`` on free loopback ports and an in-process store that
    lends the segment its puts land in (as ``bench/peers``)."""
    _require_mooncake()
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    work = tempfile.mkdtemp(prefix="kvpool-pytest-mooncake-")
    port = _free_port()
    log = open(os.path.join(work, "master.log"), "wb")
    master = subprocess.Popen(
        ["mooncake_master", f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}",
         "--metrics_host=127.0.0.1", "--enable_http_metadata_server=false"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                if master.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master did not start: {open(log.name).read()[-2000:]}")
                time.sleep(0.1)
        store = MooncakeDistributedStore()
        # P2PHANDSHAKE: peers exchange transfer metadata directly, no metadata server.
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 128 << 20, 64 << 20, "tcp", "", f"127.0.0.1:{port}")
        assert rc == 0, f"Mooncake setup failed: {rc}"
        try:
            yield store
        finally:
            store.close()
    finally:
        master.kill()
        master.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def mooncake_results(mooncake_store: Any) -> dict[str, Any]:
    """Every check's result on real Mooncake."""
    return _run(mooncake_store, "parity", _checks())


def _kvpool_store(addr: str, api_key: str, fingerprint: str) -> Any:
    from kvpool.mooncake import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    rc = st.setup("localhost", "P2PHANDSHAKE", 128 << 20, 64 << 20, "tcp", "", addr,
                  api_key=api_key, fingerprint=fingerprint)
    assert rc == 0
    return st


def _compare(where: str, mooncake: dict[str, Any], kvpool: dict[str, Any]) -> None:
    agree = [n for n in mooncake if mooncake[n] == kvpool[n]]
    differ = {n: (mooncake[n], kvpool[n]) for n in mooncake if mooncake[n] != kvpool[n]}
    torch = "" if len(mooncake) > len(CHECKS) else " (tensor checks skipped: no torch)"
    print(f"\n{where}: {len(agree)} of {len(mooncake)} checks agree with Mooncake{torch}; "
          f"deliberate differences: {sorted(differ)}")
    unexpected = {n: d for n, d in differ.items() if n not in DELIBERATE}
    assert not unexpected, f"{where}: (Mooncake, kvpool) differ: {unexpected}"
    stale = [n for n in DELIBERATE if n in mooncake and n not in differ]
    assert not stale, f"{where}: listed as deliberate differences but agree now: {stale}"


def test_parity_on_one_server(mooncake_results: dict[str, Any], server: Server) -> None:
    st = _kvpool_store(server.addr, server.api_key, server.fingerprint)
    try:
        _compare("one server", mooncake_results, _run(st, "parity", _checks()))
    finally:
        st.remove_all(True)
        st.close()


def _writes(name: str) -> bool:
    """Whether a method stores or removes (its answer is awaited by the cluster's master)."""
    return (any(w in name for w in ("put", "upsert", "pub_", "remove", "replica_clear", "load_tensor"))
            and "session_start" not in name) or name == "batch_put_session_end"


class _Settled:
    """A store whose writes return once the cluster master has heard of them. A master learns what
    a storage node stored or dropped from the node's next report (every ``report_ms``, 50 ms in
    these tests): until then a read of a key just written can miss it (and a second put of it can
    land on another node). Mooncake's master records a put when it completes. Waiting here keeps
    the comparison about return conventions; README's cluster section states the window."""

    def __init__(self, store: Any, settle: float) -> None:
        self._store = store
        self._settle = settle

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not _writes(name):
            return attr

        def settled(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            time.sleep(self._settle)
            return out

        return settled


def test_parity_on_a_cluster(mooncake_results: dict[str, Any], cluster: Cluster) -> None:
    st = _kvpool_store(cluster.master.addr, cluster.api_key, cluster.master.fingerprint)
    try:
        _compare("cluster", mooncake_results, _run(_Settled(st, 0.2), "parity", _checks()))
    finally:
        st.remove_all(True)
        st.close()


def _tensor_writes(s: Any, p: str) -> list[str]:
    """Tensors of every layout written under the prefix ``p``; the keys they were stored under."""
    import torch

    from parity_checks_tensors import _Writer, _axis, _grid, _par

    t = _grid()
    s.put_tensor(p + "whole", t)
    s.put_tensor(p + "bf16", torch.ones(3, 4, dtype=torch.bfloat16) / 3)
    s.put_tensor_with_tp(p + "tp", t, tp_size=2, split_dim=1)
    for r in range(2):
        s.put_tensor_with_parallelism(p + "par", t[:, r * 6:(r + 1) * 6], _par(s, _axis(s, "tp", r, 2, 1)))
        s.put_tensor_with_parallelism(p + "wp", t, writer_partition=_Writer(r, 2, 0))
    s.put_tensor_with_parallelism(p + "gen", t, _par(s, _axis(s, "dp", 1, 2)))
    return [p + x for x in ("whole", "bf16", "tp_tp_0", "tp_tp_1", "par_tp_0", "par_tp_1", "par__parallelism_manifest",
                            "wp__writer_0of2_sd0", "wp__writer_1of2_sd0", "wp__writer_manifest", "gen__dp_1of2")]


def _tensor_reads(s: Any, p: str) -> list[Any]:
    from parity_checks_tensors import _axis, _par, _t, _target

    tp = lambda r, n: _par(s, _axis(s, "tp", r, n, 1))  # noqa: E731
    return [_t(x) for x in (
        s.get_tensor(p + "whole"), s.get_tensor(p + "bf16"), s.get_tensor_with_tp(p + "tp", 1, 2),
        *s.batch_get_tensor_with_tp([p + "tp"], 0, 2), s.get_tensor_with_parallelism(p + "par", _target(s, "full", tp(0, 2))),
        s.get_tensor_with_parallelism(p + "par", _target(s, "shard", tp(1, 3))),
        s.get_tensor_with_parallelism(p + "wp", _target(s, "full")),
        s.get_tensor_with_parallelism(p + "gen", _target(s, "shard", _par(s, _axis(s, "dp", 1, 2)))),
    )]


def test_tensors_cross_between_mooncake_and_kvpool(mooncake_store: Any, server: Server) -> None:
    """Tensors Mooncake wrote, their stored bytes copied to kvpool, read on kvpool as on Mooncake;
    and the other way round. Needs torch (skipped without it)."""
    if not _have_torch():
        pytest.skip("torch is not installed here")
    kv = _kvpool_store(server.addr, server.api_key, server.fingerprint)
    try:
        for writer, reader, p in ((mooncake_store, kv, "cross/mc/"), (kv, mooncake_store, "cross/kv/")):
            keys = _tensor_writes(writer, p)
            values = writer.get_batch(keys)
            assert all(values), [k for k, v in zip(keys, values) if not v]
            assert reader.put_batch(keys, values) == 0
            expected = _tensor_reads(writer, p)
            assert None not in expected
            assert _tensor_reads(reader, p) == expected, f"written by {type(writer).__module__}"
    finally:
        kv.remove_all(True)
        kv.close()
        mooncake_store.remove_all(True)
