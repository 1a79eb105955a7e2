"""How a worker moves block images (:mod:`kvpool.vllm.layout`) between vLLM's paged KV cache and
the pool.

- :class:`DirectMover` (a KV cache in host memory whose block image lies in a few runs: vLLM's
  CPU backend, LBHNC): the KV memory is registered with the client once, and each block's image
  moves straight between it and the pool, gathered into or scattered from one pool object.
- :class:`StagedMover` (device memory: CUDA, Ascend NPU; or a host layout whose image is
  scattered, such as LBNHC with several heads): the KV tensors are never read from the host. The
  image is gathered through the tensors' strides on the device into chunks of a staging area
  that any number of loads and saves share at once (each holds at most two, so one chunk's
  gather overlaps the other's transfer). For device caches the area is device memory registered
  with the client, which moves it through its own pinned host buffers on its own stream,
  pipelined with the transfer (the one staging implementation of the Python client, the same
  that ``kvpool.mooncake``'s device buffers take); where the client cannot take device memory
  (no CUDA or ACL runtime it can load), the area is host memory and torch copies into it. Host
  caches gather straight into host chunks (shared with a same-host server). The device work runs
  on a stream of the connector's, ordered after the forward pass that wrote the KV (saves) and
  complete before the step that reads it (loads).

Nothing GPU or NPU ran here: the device parts of :class:`StagedMover` are torch's stream and
event calls (``torch.cuda`` / ``torch.npu``), gathers as device kernels, and the client's device
staging (tested against stand-in runtimes of the same ABI, ``python/tests/test_device_memory.py``).
The staging logic itself runs on CPU tensors (``kvpool_staging: always``), which is how the tests
drive it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence, Union

import torch

from kvpool._native import Client, KvpoolError
from kvpool.vllm.layout import BlockImage, RegionImage

log = logging.getLogger("kvpool.vllm")

# Statuses of a save that leave the block in the pool.
STORED = ("ok", "already-exists")

Image = Union[BlockImage, RegionImage]


class Mover:
    """Moves whole blocks; one pool object per block holds its image."""

    block_bytes: int

    def fence(self) -> Any:
        """Mark the point of the compute stream after which this step's KV is written."""
        return None

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        raise NotImplementedError

    def save(
        self,
        keys: Sequence[str],
        block_ids: Sequence[int],
        parents: Sequence[Optional[str]],
        seq_tokens: Sequence[int],
        tokens: int,
        fence: Any,
    ) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class DirectMover(Mover):
    """Host KV tensors registered with the client; no copy of ours in between."""

    def __init__(self, client: Client, image: Image) -> None:
        assert image.direct
        self.client = client
        self.image = image
        self.block_bytes = image.block_bytes
        self.registered: list[int] = []
        for start, size in image.storages():
            self.client.register(start, size)
            self.registered.append(start)

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        ptrs, sizes = self.image.runs(block_ids)
        got = self.client.get_into_multi(list(keys), ptrs, sizes)
        return [st == "ok" and n == self.block_bytes for st, n in got]

    def save(self, keys, block_ids, parents, seq_tokens, tokens, fence):  # type: ignore[no-untyped-def]
        ptrs, sizes = self.image.runs(block_ids)
        return self.client.put_from_multi(
            list(keys), ptrs, sizes, parents=list(parents), seq_tokens=list(seq_tokens), tokens=[tokens] * len(keys)
        )

    def close(self) -> None:
        for p in self.registered:
            with contextlib.suppress(KvpoolError):
                self.client.unregister(p)
        self.registered.clear()


class HostOps:
    """Device operations for KV caches that live in host memory (no stream, no events)."""

    def stream(self) -> Any:
        return contextlib.nullcontext()

    def fence(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def record(self) -> Any:
        return None

    def sync(self, event: Any) -> None:
        pass

    def pin(self, ptr: int, size: int) -> bool:
        return False


class TorchDeviceOps(HostOps):
    """A copy stream of the connector's on a CUDA or Ascend device (``torch.cuda`` /
    ``torch.npu``, which torch_npu registers)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mod = getattr(torch, device.type)
        self._stream = self.mod.Stream(device=device)

    def stream(self) -> Any:
        return self.mod.stream(self._stream)

    def fence(self) -> Any:
        ev = self.mod.Event()
        ev.record(self.mod.current_stream(self.device))
        return ev

    def wait(self, event: Any) -> None:
        if event is not None:
            self._stream.wait_event(event)

    def record(self) -> Any:
        ev = self.mod.Event()
        ev.record(self._stream)
        return ev

    def sync(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def pin(self, ptr: int, size: int) -> bool:
        """Page-lock the staging area for the device's DMA; without it copies still work, slower."""
        try:
            if self.device.type == "cuda":
                return int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0)) == 0
            if self.device.type == "npu":
                import torch_npu  # noqa: F401  (registers torch.npu)

                ACL_HOST_REG_PINNED = 0x10000000
                return int(torch.npu.npurt().npuHostRegister(ptr, size, ACL_HOST_REG_PINNED)) == 0
        except Exception as e:  # an older runtime without the call: unpinned staging
            log.warning("kvpool: could not pin the staging area for %s: %s", self.device, e)
        return False


def ops_for(device: torch.device) -> HostOps:
    return HostOps() if device.type == "cpu" else TorchDeviceOps(device)


class _Chunk:
    """Consecutive block slots of the staging area."""

    def __init__(self, mem: torch.Tensor, base: int, block_bytes: int) -> None:
        self.mem = mem  # [slots, block_bytes] uint8, on the host or the caches' device
        self.addrs = [base + i * block_bytes for i in range(mem.shape[0])]


class _Chunks:
    """The staging area's chunks, shared by every load and save in flight. An operation waits for
    a chunk only while it holds none, so operations never wait on each other in a circle."""

    def __init__(self, chunks: list[_Chunk]) -> None:
        self.free = list(chunks)
        self.cond = threading.Condition()

    def take(self, wait: bool) -> Optional[_Chunk]:
        with self.cond:
            while not self.free:
                if not wait:
                    return None
                self.cond.wait()
            return self.free.pop()

    def give(self, chunk: _Chunk) -> None:
        with self.cond:
            self.free.append(chunk)
            self.cond.notify()


class StagedMover(Mover):
    """Blocks staged through a registered host area; the KV tensors stay unregistered."""

    def __init__(self, client: Client, image: Image, staging_bytes: int, ops: Optional[HostOps] = None,
                 chunk_blocks: Optional[int] = None, device_staging_bytes: int = 64 << 20) -> None:
        self.client = client
        self.image = image
        self.device = image.device
        self.ops = ops if ops is not None else ops_for(self.device)
        self.block_bytes = image.block_bytes
        self.on_device = False
        flat: Optional[torch.Tensor] = None
        pinned = False
        if self.device.type != "cpu":
            # Device memory the client takes: it stages it through its own pinned buffers. Kept
            # small (it is the engine's device memory): the client's chunks pipeline the rest.
            slots = max(4, device_staging_bytes // self.block_bytes)
            flat = self._device_area(self._layout(slots, chunk_blocks)[2])
            self.on_device = flat is not None
        if flat is None:
            slots = max(4, staging_bytes // self.block_bytes)
        self.chunk_blocks, nchunks, size = self._layout(slots, chunk_blocks)
        if flat is None:
            try:
                # Memory shared with a same-host server: it copies straight into the area.
                self.buffer = client.alloc_buffer(size)
                flat = torch.frombuffer(self.buffer, dtype=torch.uint8)
            except KvpoolError:
                # A server on another host: ordinary memory, page-locked by torch where it can.
                pinned = self.device.type == "cuda"
                flat = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self.client.register(flat.data_ptr(), size)
            pinned = pinned or self.ops.pin(flat.data_ptr(), size)
        self.area = flat.view(nchunks * self.chunk_blocks, self.block_bytes)
        self.base = self.area.data_ptr()
        self.pinned = pinned
        c = self.chunk_blocks
        self.chunks = _Chunks([
            _Chunk(self.area[i * c : (i + 1) * c], self.base + i * c * self.block_bytes, self.block_bytes)
            for i in range(nchunks)
        ])
        self.nchunks = nchunks
        # Puts of saves run here while the saving thread stages the next chunk.
        self.xfer = ThreadPoolExecutor(4, thread_name_prefix="kvpool-stage")
        where = ("device memory the client stages" if self.on_device
                 else f"{'pinned' if self.pinned else 'pageable'} host memory")
        log.info("kvpool: staging %d chunks of %d blocks of %d bytes through %s (%s)", nchunks, c,
                 self.block_bytes, where, self.device)

    def _layout(self, slots: int, chunk_blocks: Optional[int]) -> tuple[int, int, int]:
        """Blocks per chunk, chunks, bytes: chunks small enough that several operations run at
        once, large enough that one request per chunk carries many blocks."""
        c = chunk_blocks or max(1, min(32, slots // 8))
        n = max(2, slots // c)
        return c, n, n * c * self.block_bytes

    def _device_area(self, size: int) -> Optional[torch.Tensor]:
        """A staging area in the caches' device memory, registered with the client; None where
        the client cannot take device memory (then torch stages through host memory)."""
        area = torch.empty(size, dtype=torch.uint8, device=self.device)
        try:
            self.client.register(area.data_ptr(), size)
        except KvpoolError as e:
            log.warning("kvpool: the client does not take %s memory (%s): staging through host memory with "
                        "torch's copies instead", self.device, e)
            return None
        return area

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _batches(self, n: int) -> list[range]:
        return [range(lo, min(lo + self.chunk_blocks, n)) for lo in range(0, n, self.chunk_blocks)]

    def _stage(self, idx: torch.Tensor, slots: torch.Tensor) -> None:
        """The images of blocks ``idx`` into staging ``slots`` (in the copy stream)."""
        if self.device.type == "cpu" or self.on_device:
            self.image.gather(idx, slots)
        else:
            scratch = torch.empty(slots.shape, dtype=torch.uint8, device=self.device)
            self.image.gather(idx, scratch)
            slots.copy_(scratch, non_blocking=True)

    def save(self, keys, block_ids, parents, seq_tokens, tokens, fence):  # type: ignore[no-untyped-def]
        out: list[str] = ["internal"] * len(keys)
        held: collections.deque[tuple[Future[None], _Chunk]] = collections.deque()

        def put(batch: range, chunk: _Chunk) -> None:
            st = self.client.put_from(
                [keys[i] for i in batch], chunk.addrs[: len(batch)], [self.block_bytes] * len(batch),
                parents=[parents[i] for i in batch], seq_tokens=[seq_tokens[i] for i in batch],
                tokens=[tokens] * len(batch),
            )
            for i, s in zip(batch, st):
                out[i] = s

        try:
            for batch in self._batches(len(keys)):
                chunk = self.chunks.take(wait=not held)
                if chunk is None:  # every chunk busy: reuse this save's oldest once it is sent
                    fut, chunk = held.popleft()
                    fut.result()
                try:
                    slots = chunk.mem[: len(batch)]
                    with self.ops.stream():
                        self.ops.wait(fence)
                        self._stage(self._index([block_ids[i] for i in batch]), slots)
                        done = self.ops.record()
                    self.ops.sync(done)
                    fut = self.xfer.submit(put, batch, chunk)
                except BaseException:
                    self.chunks.give(chunk)
                    raise
                held.append((fut, chunk))
                if len(held) > 1:
                    fut, old = held.popleft()
                    try:
                        fut.result()
                    finally:
                        self.chunks.give(old)
        finally:
            first: Optional[BaseException] = None
            for fut, chunk in held:
                try:
                    fut.result()
                except BaseException as e:  # every chunk goes back before the error does
                    first = first or e
                self.chunks.give(chunk)
            if first is not None:
                raise first
        return out

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        ok = [False] * len(keys)
        copying: collections.deque[tuple[Any, _Chunk]] = collections.deque()
        try:
            for batch in self._batches(len(keys)):
                chunk = self.chunks.take(wait=not copying)
                if chunk is None:  # every chunk busy: reuse this load's oldest once the device has it
                    ev, chunk = copying.popleft()
                    self.ops.sync(ev)
                try:
                    got = self.client.get_into([keys[i] for i in batch], chunk.addrs[: len(batch)],
                                               [self.block_bytes] * len(batch))
                    good = [j for j, (st, n) in enumerate(got) if st == "ok" and n == self.block_bytes]
                    if good:
                        with self.ops.stream():
                            rows = chunk.mem[: len(batch)]
                            if len(good) < len(batch):
                                rows = rows.index_select(0, torch.tensor(good, dtype=torch.long, device=rows.device))
                            src = rows.to(self.device, non_blocking=True)
                            self.image.scatter(self._index([block_ids[batch[j]] for j in good]), src)
                            ev = self.ops.record()
                except BaseException:
                    self.chunks.give(chunk)
                    raise
                if not good:
                    self.chunks.give(chunk)
                    continue
                copying.append((ev, chunk))
                for j in good:
                    ok[batch[j]] = True
                if len(copying) > 1:
                    ev, old = copying.popleft()
                    self.ops.sync(ev)
                    self.chunks.give(old)
        finally:
            # The blocks are in place before the step that reads them.
            for ev, chunk in copying:
                self.ops.sync(ev)
                self.chunks.give(chunk)
        return ok

    def close(self) -> None:
        self.xfer.shutdown(wait=True)
        with contextlib.suppress(KvpoolError):
            self.client.unregister(self.base)
