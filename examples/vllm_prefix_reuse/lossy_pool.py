"""The kvpool connector in front of a pool that loses blocks between lookup and load.

For every second request whose tokens the scheduler counted as loadable, the second half of the
blocks it counted on is removed from the pool (by force, as a storage node that dies would take
them) right after vLLM allocated the blocks to load into. The load of those blocks then fails,
vLLM is told which, and computes them instead. ``scenarios.py`` checks the answers stay right.
"""

from __future__ import annotations

from typing import Any

from kvpool.vllm import KVPoolConnector as _Connector
from kvpool.vllm.keys import KeyLayout, hash_hex


class KVPoolConnector(_Connector):
    _counted = 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        s = self._scheduler
        load = s.pending.get(request.request_id) if s is not None else None
        if load is None:
            return
        KVPoolConnector._counted += 1
        if KVPoolConnector._counted % 2:
            return
        lost = [hash_hex(h) for h in request.block_hashes[(load.first + load.end) // 2 : load.end]]
        s.store.client.remove([k for p in s.prefixes for k in KeyLayout.chain(p, lost)], force=True)
