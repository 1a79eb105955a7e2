"""The Mooncake switch example: one script, Mooncake's import or kvpool's, same results."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, server_binary


def test_mooncake_script_runs_unchanged_on_kvpool_and_mooncake() -> None:
    have_mooncake = importlib.util.find_spec("mooncake") is not None and shutil.which("mooncake_master") is not None
    if not have_mooncake and os.environ.get("KVPOOL_REQUIRE_PEERS") == "1":
        pytest.fail("KVPOOL_REQUIRE_PEERS=1 but Mooncake is not installed (bench/peers/setup.sh mooncake)")
    r = subprocess.run(
        ["bash", str(REPO / "examples" / "mooncake_switch" / "run.sh"), str(server_binary())],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHON=sys.executable),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: kvpool.mooncake.MooncakeDistributedStore" in r.stdout
    if have_mooncake:
        assert "ok: mooncake.store.MooncakeDistributedStore" in r.stdout, r.stdout
