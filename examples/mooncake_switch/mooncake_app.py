"""A small program written against Mooncake Store's Python API.

It runs unchanged on Mooncake and on kvpool; only the import differs:

    from mooncake.store import MooncakeDistributedStore    # Mooncake
    from kvpool.mooncake import MooncakeDistributedStore   # kvpool

``STORE_IMPL=mooncake`` or ``STORE_IMPL=kvpool`` picks the import (that line is the whole
switch). The rest is what a connector does: set up from the same arguments, put KV blocks from a
registered buffer, check which exist, read them back into another registered buffer, and remove
them. Connection settings come from the environment as each implementation expects them:
``MASTER`` (Mooncake's master address, or kvpool's QUIC address); kvpool also reads
``KVPOOL_DATA_DIR`` or ``KVPOOL_API_KEY`` + ``KVPOOL_FINGERPRINT``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

if os.environ.get("STORE_IMPL", "kvpool") == "mooncake":
    from mooncake.store import MooncakeDistributedStore
else:
    from kvpool.mooncake import MooncakeDistributedStore

BLOCK = 256 << 10
BLOCKS = 8


def main() -> int:
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", os.environ["MASTER"])
    if rc != 0:
        print(f"setup failed: {rc}")
        return 1
    src = np.random.default_rng(0).integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
    dst = np.zeros_like(src)
    for a in (src, dst):
        assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    keys = [f"mooncake-switch/block/{i}" for i in range(BLOCKS)]
    store.batch_remove(keys, True)

    codes = store.batch_put_from(keys, [src.ctypes.data + i * BLOCK for i in range(BLOCKS)], [BLOCK] * BLOCKS)
    assert codes == [0] * BLOCKS, codes
    assert store.batch_is_exist(keys + ["mooncake-switch/absent"]) == [1] * BLOCKS + [0]
    assert store.get_size(keys[0]) == BLOCK
    got = store.batch_get_into(keys, [dst.ctypes.data + i * BLOCK for i in range(BLOCKS)], [BLOCK] * BLOCKS)
    assert got == [BLOCK] * BLOCKS, got
    assert np.array_equal(src, dst)
    assert store.put("mooncake-switch/bytes", b"hello") == 0
    assert store.get("mooncake-switch/bytes") == b"hello"
    assert store.get("mooncake-switch/absent") == b""
    assert store.get_size("mooncake-switch/absent") < 0
    assert store.batch_remove(keys + ["mooncake-switch/bytes"], True) == [0] * (BLOCKS + 1)
    assert store.is_exist(keys[0]) == 0
    for a in (src, dst):
        assert store.unregister_buffer(a.ctypes.data) == 0
    store.close()
    print(f"ok: {MooncakeDistributedStore.__module__}.{MooncakeDistributedStore.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
