"""The namespace harness (``netns.Hosts``) gives its veths a NIC's offloads by default, bare veths
on request, and reports which are on as ``ethtool -k`` reads them back."""

from __future__ import annotations

import os
import shutil

import pytest

import netns


def test_veths_get_a_nics_offloads_or_stay_bare_and_report_which() -> None:
    why = netns.available() or (None if shutil.which("ethtool") else netns.NO_ETHTOOL)
    if why:
        if os.environ.get("KVPOOL_REQUIRE_PEERS") == "1":
            pytest.fail(f"cross-host tests required (KVPOOL_REQUIRE_PEERS=1): {why}")
        pytest.skip(why)
    h = netns.Hosts(1, bare=False)
    try:
        assert h.nic
        assert h.offloads() == {name: "on" for name in netns.REPORTED}
        h.set_offloads(False)
        o = h.offloads()
        assert not h.nic
        assert (o["generic-receive-offload"], o["rx-udp-gro-forwarding"]) == ("off", "off"), o
        assert (o["tcp-segmentation-offload"], o["tx-udp-segmentation"]) == ("on", "on"), "a veth's defaults"
    finally:
        h.close()
    bare = netns.Hosts(1, bare=True)
    try:
        assert not bare.nic
        assert bare.offloads()["generic-receive-offload"] == "off", "as the kernel makes a veth"
    finally:
        bare.close()
