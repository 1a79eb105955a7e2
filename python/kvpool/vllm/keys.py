"""Pool keys of the connector: vLLM's Mooncake store connector's grammar, with the format of the
bytes in it, so that engines that load one model from different paths name a block alike and
engines whose bytes mean different things never do.

``[ns][cache_prefix@]<model>@kv:<format>@tp_rank:T@pcpP@dcpD@pp_rank:R@group:0@<block hash hex>``
where ``<model>`` is the basename of the model path (as upstream forms it), ``ns`` stands for a
Mooncake ``tenant_id`` other than ``default`` (``tenant:<id>/``), ``<format>`` is the digest of
what the bytes mean (:func:`kvpool.vllm.layout.kv_format`: dtypes, fp8 encoding, quantisation,
heads, head sizes, states and content per block) in the slot where upstream puts its
``store_namespace``, and one object holds one block of one rank: its KV of every layer of that
rank (:mod:`kvpool.vllm.layout`).

With ``kvpool_key_format: mooncake`` the ``@kv:<format>`` part is left out: keys are exactly
upstream's, for a fleet that mixes this connector with vLLM's ``MooncakeStoreConnector``.

Which ranks hold distinct bytes:

- tensor parallel ranks hold different KV heads, unless heads are replicated: an MLA cache is the
  same on every TP rank, and with more TP ranks than KV heads ``tp_size // num_kv_heads`` ranks
  share each head. Replicas write one key (``tp_rank // replication``) and split its blocks
  between them (block ``b`` is saved by the replica ``b % replication``), as upstream does;
* decode context parallel (DCP) subdivides TP: ``dcp_rank == tp_rank % dcp_size``;
* prefill context parallel (PCP) and pipeline (PP) ranks always hold distinct bytes.

The scheduler asks the pool for every distinct shard, so a block counts only when all of them
are stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


def model_name(model: str) -> str:
    """The model part of keys: the basename of the path or hub id vLLM was given."""
    return str(model).rstrip("/").split("/")[-1]


def hash_hex(block_hash: Any) -> str:
    """A vLLM block hash (bytes) as the hex that ends a key."""
    return bytes(block_hash).hex()


@dataclass(frozen=True)
class KeyLayout:
    """Key prefixes of one engine's ranks."""

    model: str
    cache_prefix: str = ""
    namespace: str = ""
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    # TP ranks that hold the same bytes (see the module docs).
    replication: int = 1
    # The format digest of the bytes ("" in Mooncake's key format).
    format: str = ""

    def __post_init__(self) -> None:
        if self.replication < 1 or self.tp_size % self.replication:
            raise ValueError(f"replication {self.replication} does not divide tp_size {self.tp_size}")
        if self.dcp_size > 1 and self.replication != 1:
            raise ValueError("with decode context parallel every TP rank holds its own bytes")

    @property
    def model_prefix(self) -> str:
        """What every key of this model (and namespace) starts with."""
        head = f"{self.cache_prefix}@" if self.cache_prefix else ""
        return f"{self.namespace}{head}{self.model}@"

    def prefix(self, tp: int, pcp: int, dcp: int, pp: int) -> str:
        fmt = f"kv:{self.format}@" if self.format else ""
        return f"{self.model_prefix}{fmt}tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:0"

    def writer(self, tp_rank: int, pcp_rank: int, dcp_rank: int, pp_rank: int) -> "RankKeys":
        """The keys a worker of these ranks reads and writes, and its share of the saves."""
        if self.dcp_size > 1 and dcp_rank != tp_rank % self.dcp_size:
            raise ValueError(f"dcp rank {dcp_rank} of tp rank {tp_rank} is not tp_rank % {self.dcp_size}")
        return RankKeys(
            self.prefix(tp_rank // self.replication, pcp_rank, dcp_rank, pp_rank),
            self.replication,
            tp_rank % self.replication,
        )

    def lookup_prefixes(self) -> list[str]:
        """One prefix per distinct shard: a block is in the pool when every one has it."""
        if self.dcp_size > 1:
            return [
                self.prefix(tp, pcp, tp % self.dcp_size, pp)
                for pcp in range(self.pcp_size)
                for tp in range(self.tp_size)
                for pp in range(self.pp_size)
            ]
        return [
            self.prefix(shard, pcp, 0, pp)
            for pcp in range(self.pcp_size)
            for shard in range(self.tp_size // self.replication)
            for pp in range(self.pp_size)
        ]

    @staticmethod
    def chain(prefix: str, hashes: Iterable[str]) -> list[str]:
        return [f"{prefix}@{h}" for h in hashes]


@dataclass(frozen=True)
class RankKeys:
    """One worker's prefix, and which of the blocks it saves (``b % step == phase``)."""

    prefix: str
    step: int = 1
    phase: int = 0

    def keys(self, hashes: Sequence[str]) -> list[str]:
        return KeyLayout.chain(self.prefix, hashes)

    def saves(self, position: int) -> bool:
        """Whether this rank saves the block at chain position ``position``."""
        return position % self.step == self.phase


def replication_factor(kv_cache_spec: Any, tp_size: int, num_kv_heads: int, dcp_size: int) -> int:
    """How many TP ranks hold the same bytes of a block (see the module docs)."""
    if dcp_size > 1:
        return 1
    # A uniform-type spec wraps one spec per layer; MLA specs (MLAAttentionSpec and its sliding
    # variant) hold the latent cache every TP rank computes alike.
    specs = list(getattr(kv_cache_spec, "kv_cache_specs", {}).values()) or [kv_cache_spec]
    if all("MLA" in type(s).__name__ for s in specs):
        return tp_size
    if num_kv_heads <= 0:
        return 1
    r = max(1, tp_size // num_kv_heads)
    return r if tp_size % r == 0 else 1
