"""Python client of the kvpool KV-cache pool.

- :class:`kvpool.Client` is the native client (a Rust extension): every call releases the GIL
  and one client may be shared by many threads.
- :mod:`kvpool.mooncake` offers Mooncake Store's ``MooncakeDistributedStore`` API on kvpool, so
  code written against Mooncake switches by changing an import.
- :mod:`kvpool.vllm` is a vLLM KV connector (``KVPoolConnector``); importing it needs vLLM.
"""

from __future__ import annotations

from kvpool._native import Client, EventSubscription, KvpoolError, SharedBuffer, __version__


def _code(self: KvpoolError) -> str:
    """kvpool's error code name of this failure (``not-found``, ``timeout``, ...)."""
    return str(self.args[1]) if len(self.args) > 1 else "internal"


# The exception class comes from the extension; give it the code as an attribute.
KvpoolError.code = property(_code)  # type: ignore[attr-defined]

__all__ = ["Client", "EventSubscription", "KvpoolError", "SharedBuffer", "__version__"]
