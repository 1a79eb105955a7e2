"""The pool as one side of the connector sees it: up, or down until it answers again.

An engine must never wait on the pool. Up, calls go through. A call that finds the pool
unreachable (the connection died or was refused, nothing came back within ``dead_after``) or that
misses its deadline marks the pool down at once. Down, calls raise :class:`PoolDown` without a
network round trip, and a background thread tries to reach the pool again (backoff from 50 ms to
2 s) until a ping answers; the same client object then serves again, reconnected.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, TypeVar

from kvpool._native import Client, KvpoolError

log = logging.getLogger("kvpool.vllm")

T = TypeVar("T")

# Error codes that say the pool cannot be reached, as opposed to a refused request.
UNREACHABLE = frozenset({"unavailable", "timeout", "shutting-down"})


class PoolDown(Exception):
    """The pool is down, or did not answer in time: go on without it. ``late`` is the call still
    running past its deadline, when there is one (its result must still be cleaned up)."""

    def __init__(self, why: str, late: Optional[Future[Any]] = None) -> None:
        super().__init__(why)
        self.late = late


class Pool:
    def __init__(self, connect: Callable[[], Client], name: str,
                 on_connect: Optional[Callable[[Client], None]] = None) -> None:
        self._connect = connect
        self.name = name
        self._on_connect = on_connect
        self._client: Optional[Client] = None
        self._up = False
        self._lock = threading.Lock()
        self._probing = False
        self._stop = threading.Event()
        # Calls with a deadline, and work nothing waits for (lease releases, cleanups), on
        # executors of their own: a queue of releases never delays a lookup past its deadline
        # (which would mark a healthy pool down).
        self._exec = ThreadPoolExecutor(2, thread_name_prefix=f"kvpool-{name}")
        self._bg = ThreadPoolExecutor(2, thread_name_prefix=f"kvpool-{name}-bg")
        self.counters = {"pool_down_events": 0, "pool_reconnects": 0, "pool_down_seconds": 0.0}
        self._down_at = 0.0
        try:
            self._attach(connect())
        except KvpoolError as e:
            # The engine starts without the pool and uses it once it answers.
            self.down(f"cannot connect: {e}")

    @property
    def up(self) -> bool:
        return self._up

    @property
    def client(self) -> Optional[Client]:
        """The client, once connected (it reconnects by itself after the pool comes back)."""
        return self._client

    def _attach(self, c: Client) -> None:
        if self._client is None:
            self._client = c
            if self._on_connect is not None:
                self._on_connect(c)
        with self._lock:
            self._up = True

    def down(self, why: str) -> None:
        """Mark the pool down (once) and start trying to reach it again."""
        with self._lock:
            if self._stop.is_set():
                return
            if self._up or self._client is None:
                self.counters["pool_down_events"] += 1
                self._down_at = time.monotonic()
                log.warning("kvpool (%s): pool down (%s); going on without it until it answers", self.name, why)
            self._up = False
            if self._probing:
                return
            self._probing = True
        threading.Thread(target=self._reach, name=f"kvpool-{self.name}-probe", daemon=True).start()

    def _reach(self) -> None:
        wait = 0.05
        while not self._stop.wait(wait):
            try:
                c = self._client if self._client is not None else self._connect()
                c.ping()
                self._attach(c)
                with self._lock:
                    self._probing = False
                    self.counters["pool_reconnects"] += 1
                    self.counters["pool_down_seconds"] += time.monotonic() - self._down_at
                log.warning("kvpool (%s): pool back after %.1f s", self.name, time.monotonic() - self._down_at)
                return
            except KvpoolError as e:
                log.debug("kvpool (%s): pool still down: %s", self.name, e)
                wait = min(wait * 2, 2.0)
        with self._lock:
            self._probing = False

    def _failed(self, e: KvpoolError) -> Exception:
        if getattr(e, "code", None) in UNREACHABLE:
            self.down(str(e))
            return PoolDown(str(e))
        return e

    def call(self, fn: Callable[[Client], T], deadline: Optional[float] = None) -> T:
        """``fn(client)``, unless the pool is down; with a ``deadline`` (seconds), the call runs
        on a thread of this pool's and an answer later than that counts as the pool down."""
        c = self._client
        if not self._up or c is None:
            raise PoolDown("the pool is down")
        if deadline is None:
            try:
                return fn(c)
            except KvpoolError as e:
                raise self._failed(e) from e
        fut = self._exec.submit(fn, c)
        try:
            return fut.result(timeout=deadline)
        except FutureTimeout:
            self.down(f"no answer within {deadline * 1e3:.0f} ms")
            raise PoolDown("deadline", late=fut) from None
        except KvpoolError as e:
            raise self._failed(e) from e

    def background(self, fn: Callable[[Client], Any]) -> None:
        """Run ``fn(client)`` off the caller's thread when the pool is up; failures only mark it
        down (for calls nothing waits for: releases, cleanups)."""
        c = self._client
        if not self._up or c is None:
            return

        def run() -> None:
            try:
                fn(c)
            except KvpoolError as e:
                self._failed(e)
                log.debug("kvpool (%s): %s", self.name, e)

        self._bg.submit(run)

    def close(self) -> None:
        self._stop.set()
        self._exec.shutdown(wait=True)
        self._bg.shutdown(wait=True)
        if self._client is not None:
            self._client.close()
