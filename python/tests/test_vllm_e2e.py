"""The seed's end-to-end check on real vLLM CPU engines (slow: engines take ~45 s each to start).

Runs ``examples/vllm_prefix_reuse/run.py --check`` (three engines through the ``LLM`` class) and
``openai_server.py --check`` (two OpenAI-compatible servers, requests sent with curl). Needs vLLM
in the running interpreter: ``.ci/vllm-e2e.sh`` runs it with the cached venv's Python.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, server_binary

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter (see .ci/vllm-e2e.sh)")
EXAMPLE = REPO / "examples" / "vllm_prefix_reuse"


def test_prefix_reuse_across_two_engines(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    r = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), "--check", "--trials", "3", "--json", str(out),
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
        [sys.executable, str(EXAMPLE / "openai_server.py"), "--check", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--server-bin", str(server_binary())],
        capture_output=True, text=True, timeout=1800,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["B_pool_prompt2"]["cached_tokens"] > 0
    assert s["B_pool_prompt2"]["first_token"] == s["A_prompt2"]["first_token"]
