"""vLLM's KV events for the blocks this engine put in the pool, so that KV-aware routing sees them.

``BlockStored`` when this engine's save of a block is done, ``BlockRemoved`` when the pool no
longer holds it (removed, or evicted from its last tier), ``AllBlocksCleared`` after a reset.

Removals come from the pool's event stream, followed on a thread of its own, and the stream alone
cannot say everything: a save is reported done a step after its put, so a removal can come (and
be passed over) before the block is announced; the thread may subscribe after the first saves
(it starts with the engine and must not hold it up), lose events (``lagged``) or find a restarted
server (a new log). So the pool's own word settles each doubt: a block is announced *pending*,
and the thread asks the pool (``exists``, batched, at most every half second) whether pending
blocks are still there; a removal event for an announced block is confirmed the same way before
vLLM hears of it, since a block removed and stored again shows both events.

Events are what vLLM's own block pool sends, so a KV-aware router matches pool blocks to GPU
blocks: block hashes converted as vLLM converts them (``maybe_convert_block_hash``: 64-bit ints
by default, raw bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), ``group_idx`` 0 (the one
group the connector stores), each block's ``extra_keys`` (LoRA name, multimodal features, cache
salt), ``lora_id``, ``lora_name``, ``session_id``, and the medium ``CPU`` (``kvpool_event_medium``
names another). A block is in the pool when every shard (tensor parallel rank) holds it: a
removal on any shard makes it doubtful, and the pool's answer on every shard settles it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvpool._native import Client, KvpoolError
from kvpool.vllm.metadata import SaveJob

log = logging.getLogger("kvpool.vllm")

# How long the follower waits for a batch before it settles pending blocks anyway.
_POLL_S = 0.5
# Keys per ``exists`` (well under the server's batch limit).
_BATCH = 512

if TYPE_CHECKING:
    from kvpool._native import EventSubscription


@dataclass
class _Blocks:
    """What a save job's BlockStored events say besides the hashes, taken when it is built."""

    tokens: list[list[int]]
    extra_keys: list[Optional[tuple[Any, ...]]]
    lora_id: Optional[int]
    lora_name: Optional[str]
    session_id: Optional[str]


class KvEvents:
    def __init__(self, connect: Callable[[], Client], prefixes: list[str], block_size: int,
                 medium: Optional[str] = None) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU

        self.connect = connect
        self.medium = medium or MEDIUM_CPU
        self.block_size = block_size
        self.watch = [p + "@" for p in prefixes]
        # What each save job's events say besides the hashes, set when the job is built.
        self.blocks: dict[int, _Blocks] = {}
        self.lock = threading.Lock()
        self.out: deque[Any] = deque()
        # Blocks vLLM was told of, by hash: ``announced`` are known to be in the pool as of the
        # stream's cursor; ``pending`` wait for the pool to confirm them.
        # A pending block's number changes with every save of it, so an answer the pool gave
        # before the latest save does not settle it.
        self.announced: set[str] = set()
        self.pending: dict[str, int] = {}
        self.saves = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="kvpool-events", daemon=True)
        self.thread.start()

    # ---- the scheduler's side -----------------------------------------------------------

    def remember(self, job: SaveJob, request: Any, block_size: int) -> None:
        """Take what the events of a save job's blocks say, from the request, as vLLM does."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        tokens = request.all_token_ids
        extra: list[Optional[tuple[Any, ...]]] = []
        mm = 0
        for b in job.positions:
            keys, mm = generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, mm)
            extra.append(keys)
        lora = getattr(request, "lora_request", None)
        self.blocks[job.job] = _Blocks(
            tokens=[list(tokens[b * block_size : (b + 1) * block_size]) for b in job.positions],
            extra_keys=list(to_event_extra_keys(extra) or [None] * len(extra)),
            lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
            lora_name=getattr(lora, "name", None) if lora is not None else None,
            session_id=getattr(request, "session_id", None),
        )

    def saved(self, job: SaveJob, failed: set[int]) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        info = self.blocks.pop(job.job, None)
        with self.lock:
            for i, pos in enumerate(job.positions):
                if pos in failed:
                    continue
                h = job.hashes[i]
                if h not in self.announced:
                    self.saves += 1
                    self.pending[h] = self.saves
                parent = job.parents[i]
                self.out.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(bytes.fromhex(h))],
                        parent_block_hash=maybe_convert_block_hash(bytes.fromhex(parent)) if parent else None,
                        token_ids=info.tokens[i] if info is not None else [],
                        block_size=self.block_size,
                        lora_id=info.lora_id if info is not None else None,
                        medium=self.medium,
                        lora_name=info.lora_name if info is not None else None,
                        extra_keys=[info.extra_keys[i]] if info is not None else None,
                        group_idx=0,
                        session_id=info.session_id if info is not None else None,
                    )
                )

    def cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        with self.lock:
            self.announced.clear()
            self.pending.clear()
            self.out.append(AllBlocksCleared())

    def take(self) -> list[Any]:
        with self.lock:
            out = list(self.out)
            self.out.clear()
        return out

    def close(self) -> None:
        self.stop.set()

    # ---- the follower thread ------------------------------------------------------------

    def _follow(self) -> None:
        backoff = 0.2
        cursor: Optional[tuple[int, int]] = None  # (next seq, log id) to resume from
        while not self.stop.is_set():
            client = None
            try:
                client = self.connect()
                sub = self._subscribe(client, cursor)
                backoff = 0.2
                while not self.stop.is_set():
                    batch = sub.next(_POLL_S)
                    if batch is not None:
                        cursor = (batch["next"], batch["log_id"])
                        if batch["lagged"]:
                            self._doubt_all()
                        self._apply(batch["events"])
                    self._settle(client)
            except KvpoolError as e:
                log.debug("kvpool events: %s; following again in %.1f s", e, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if client is not None:
                    client.close()

    def _subscribe(self, client: Client, cursor: Optional[tuple[int, int]]) -> "EventSubscription":
        if cursor is not None:
            try:
                return client.subscribe(from_seq=cursor[0], log_id=cursor[1])
            except KvpoolError as e:
                if e.code not in ("expired", "invalid-argument"):
                    raise
                log.info("kvpool events: the pool restarted; checking what it still holds")
        # From now on; whatever happened before is settled by asking the pool.
        sub = client.subscribe()
        self._doubt_all()
        return sub

    def _doubt_all(self) -> None:
        with self.lock:
            for h in self.announced:
                self.pending.setdefault(h, 0)
            self.announced.clear()

    def _apply(self, events: list[dict[str, Any]]) -> None:
        with self.lock:
            for e in events:
                if e["kind"] == "stored":
                    continue
                key = bytes(e["key"]).decode("utf-8", "replace")
                for w in self.watch:
                    if key.startswith(w):
                        h = key[len(w) :]
                        if h in self.announced:
                            # A copy of one shard went; whether the block is still whole in the
                            # pool is the pool's to say.
                            self.announced.discard(h)
                            self.pending.setdefault(h, 0)
                        break

    def _settle(self, client: Client) -> None:
        """Ask the pool about pending blocks: whole (every shard), announced; not, ``BlockRemoved``."""
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        with self.lock:
            ask = list(self.pending.items())
        if not ask:
            return
        shards = len(self.watch)
        keys = [w + h for h, _ in ask for w in self.watch]
        found: list[bool] = []
        step = max(shards, _BATCH - _BATCH % shards)
        for i in range(0, len(keys), step):
            found += client.exists(keys[i : i + step])
        present = [all(found[j * shards : (j + 1) * shards]) for j in range(len(ask))]
        with self.lock:
            for (h, n), there in zip(ask, present):
                if self.pending.get(h) != n:
                    continue  # cleared or saved again meanwhile
                del self.pending[h]
                if there:
                    self.announced.add(h)
                else:
                    self.out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(bytes.fromhex(h))],
                                                 medium=self.medium, group_idx=0))
