"""End-to-end checks on real vLLM CPU engines (slow: engines take ~45 s each to start).

Runs ``examples/vllm_prefix_reuse/run.py --check`` (three engines through the ``LLM`` class),
``dead_pool.py --check`` (the pool killed under a running engine, then back; also a cluster),
``cross_host.py --check`` (two hosts as network namespaces, a node and an engine on each),
``scenarios.py --check`` (the connector under preemption, chunked prefill, lost blocks, a full
pool, a sliding window, a reset; six engines) and ``openai_server.py --check`` (two
OpenAI-compatible servers, requests sent with curl) with the
interpreter that has vLLM and kvpool: ``KVPOOL_VLLM_PYTHON``, else the running one.
``.ci/vllm-e2e.sh`` runs it with the cached venv's Python. A missing vLLM fails the tests (they are
deselected with ``-m "not slow"``, never skipped).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, server_binary

pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "vllm_prefix_reuse"
PY = os.environ.get("KVPOOL_VLLM_PYTHON", sys.executable)


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    r = subprocess.run([PY, "-c", "import vllm, kvpool.vllm"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{PY} cannot import vllm and kvpool.vllm (.ci/vllm-e2e.sh sets it up):\n{r.stderr[-2000:]}")


def test_prefix_reuse_across_two_engines(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    r = subprocess.run(
        [PY, str(EXAMPLE / "run.py"), "--check", "--trials", "5", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--server-bin", str(server_binary())],
        capture_output=True, text=True, timeout=1800,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["min_cached_tokens_B"] > 0
    assert s["first_tokens_equal"]
    assert s["ttft_with_pool_s"] < s["ttft_without_pool_s"]
    assert s["bytes_loaded"] > 0 and s["bytes_saved"] > 0


def test_prefix_reuse_through_the_openai_server(tmp_path: Path) -> None:
    out = tmp_path / "api.json"
    r = subprocess.run(
        [PY, str(EXAMPLE / "openai_server.py"), "--check", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--server-bin", str(server_binary())],
        capture_output=True, text=True, timeout=1800,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["B_pool_prompt2"]["cached_tokens"] > 0
    assert s["B_pool_prompt2"]["first_token"] == s["A_prompt2"]["first_token"]


def test_the_connector_under_the_schedulers_real_life(tmp_path: Path) -> None:
    out = tmp_path / "scenarios.json"
    r = subprocess.run(
        [PY, str(EXAMPLE / "scenarios.py"), "--check", "--json", str(out), "--workdir", str(tmp_path / "work"),
         "--server-bin", str(server_binary())],
        capture_output=True, text=True, timeout=1800,
    )
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert not s["failures"]
    assert s["A_preemptions"] > 0
    assert s["blocks_compared_with_cold_kv"] > 0 and s["worst_relative_difference"] < 1e-4
    assert s["A_loaded_blocks"] > 0 and s["B_loaded_blocks"] > 0 and s["B_load_failed_blocks"] > 0
    assert s["D_save_failed_blocks"] > 0 and s["S_loaded_blocks"] > 0


# The cluster variant (`dead_pool.py --cluster`) went past the bound twice with other builds on the
# machine (all nodes killed: +487 and +670 ms) while a killed node was known only from the probe's
# bound. Since the client takes the host's port unreachable as the answer (2026-12-06, 14 runs):
# all killed, worst request -3..+84 ms (most under +17); one storage node killed, +14..+64 ms, +99
# beside a release build; one run failed, beside a build. Single TTFT samples against an engine
# without the connector stay too noisy to gate CI on: run it by hand.
@pytest.mark.parametrize("transport,cluster", [("auto", False), ("quic", False)], ids=["server-auto", "server-quic"])
def test_a_dead_pool_costs_an_engine_almost_nothing(tmp_path: Path, transport: str, cluster: bool) -> None:
    """The pool killed under a running engine: each request within 100 ms of an engine without
    the connector; the pool back: hits again within 5 s, without restarting the engine. On a
    cluster (a master and two storage nodes, all killed, then one storage node alone): the same
    bound, over QUIC, where a killed node is silent."""
    out = tmp_path / "dead.json"
    r = subprocess.run(
        [PY, str(EXAMPLE / "dead_pool.py"), "--check", "--transport", transport, "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--server-bin", str(server_binary()),
         *(["--cluster"] if cluster else [])],
        capture_output=True, text=True, timeout=1200,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert not s["failures"]
    assert s["extra_max_killed_s"] <= 0.1 and s["hits_back_after_s"] <= 5.0
    c = s["connector"]
    assert c["lookups_skipped"] > 0 and c["scheduler_pool_reconnects"] >= 1 and c["worker_pool_reconnects"] >= 1
    if cluster:
        assert s["extra_max_node_killed_s"] <= 0.1
        assert all(r["same_token"] for r in s["node_killed"])


def test_an_engine_on_another_host_loads_the_prefix_and_outlives_its_node(tmp_path: Path) -> None:
    """Two hosts (network namespaces), a storage node and an engine on each: engine 1's blocks
    land on its own node; engine 2 loads them over the network, every token equal to a cold
    engine's; host 1's node killed, engine 2 computes them within 100 ms of the cold engine."""
    out = tmp_path / "cross.json"
    r = subprocess.run(
        [PY, str(EXAMPLE / "cross_host.py"), "--check", "--trials", "2", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--server-bin", str(server_binary())],
        capture_output=True, text=True, timeout=1200,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert not s["failures"]
    for t in s["trials"]:
        assert t["same_tokens"] and t["stored_on_nodes"][1] == 0 and t["stored_on_nodes"][0] > 0
        assert t["cross_host_cached"] >= 128 * s["prefix_blocks"]
    assert s["node_killed"]["same_tokens"] and s["node_killed"]["extra_s"] <= 0.1


def test_vllms_own_mooncake_store_connector_runs_on_kvpool_through_the_alias(tmp_path: Path) -> None:
    """vLLM's ``MooncakeStoreConnector``, unchanged, with ``mooncake.store`` served by kvpool
    (``python -m kvpool.mooncake_alias install``): writer and reader, producer and consumer, the
    cold engine's tokens, the pool's objects byte for byte W's KV, a reset through the connector."""
    out = tmp_path / "mooncake.json"
    r = subprocess.run(
        [PY, str(EXAMPLE / "mooncake_connector.py"), "--check", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--server-bin", str(server_binary())],
        capture_output=True, text=True, timeout=1800,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert not s["failures"]
    assert s["blocks_compared"] > 0 and s["blocks_equal"] == s["blocks_compared"]
    assert min(s["R_cached"]) > 0 and min(s["K_cached"]) > 0 and s["reset_after"] == 0
