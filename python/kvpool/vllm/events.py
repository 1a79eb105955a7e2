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
"""

from __future__ import annotations

import logging
import threading
from collections import deque
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


class KvEvents:
    def __init__(self, connect: Callable[[], Client], watch_prefix: str, block_size: int) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU

        self.connect = connect
        self.medium = MEDIUM_CPU
        self.block_size = block_size
        self.watch = watch_prefix + "@"
        # Tokens and LoRA name of each save job's blocks, set when the job is built.
        self.tokens: dict[int, tuple[list[list[int]], Optional[str]]] = {}
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

    def saved(self, job: SaveJob, failed: set[int]) -> None:
        from vllm.distributed.kv_events import BlockStored

        tokens, lora = self.tokens.pop(job.job, ([], None))
        with self.lock:
            for i, pos in enumerate(job.positions):
                if pos in failed:
                    continue
                h = job.hashes[i]
                if h not in self.announced:
                    self.saves += 1
                    self.pending[h] = self.saves
                self.out.append(
                    BlockStored(
                        block_hashes=[bytes.fromhex(h)],
                        parent_block_hash=bytes.fromhex(job.parents[i]) if job.parents[i] else None,
                        token_ids=tokens[i] if i < len(tokens) else [],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=self.medium,
                        lora_name=lora,
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
                if key.startswith(self.watch):
                    h = key[len(self.watch) :]
                    if h in self.announced:
                        # One copy went; whether it was the last is the pool's to say.
                        self.announced.discard(h)
                        self.pending.setdefault(h, 0)

    def _settle(self, client: Client) -> None:
        """Ask the pool about pending blocks: still there, announced; gone, ``BlockRemoved``."""
        from vllm.distributed.kv_events import BlockRemoved

        with self.lock:
            ask = list(self.pending.items())
        if not ask:
            return
        present: list[bool] = []
        for i in range(0, len(ask), _BATCH):
            present += client.exists([self.watch + h for h, _ in ask[i : i + _BATCH]])
        with self.lock:
            for (h, n), there in zip(ask, present):
                if self.pending.get(h) != n:
                    continue  # cleared or saved again meanwhile
                del self.pending[h]
                if there:
                    self.announced.add(h)
                else:
                    self.out.append(BlockRemoved(block_hashes=[bytes.fromhex(h)], medium=self.medium))
