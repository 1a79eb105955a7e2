"""How a worker moves blocks between vLLM's paged KV cache and the pool.

- :class:`DirectMover` (KV cache in host memory: vLLM's CPU backend): the KV tensors are
  registered with the client once, and each block's pieces (K and V of every layer) move straight
  between them and the pool, gathered into or scattered from one pool object per block.
- :class:`StagedMover` (KV cache in device memory: CUDA, Ascend NPU): the KV tensors are never
  read from the host. A registered host staging area (shared with a same-host server, so the
  server copies straight into it; pinned for the device's DMA) holds blocks on their way; the
  device copies run on a stream of the connector's, ordered after the forward pass that wrote the
  KV (saves) and before the one that reads it (loads, which complete before the step's first
  attention layer). Loads and saves each have a part of the area, used in two halves, so one
  half's device copies overlap the other half's transfer with the pool.

Nothing GPU or NPU ran here: the device parts of :class:`StagedMover` are torch's stream and
event calls (``torch.cuda`` / ``torch.npu``) and host registration (``cudaHostRegister``,
``npuHostRegister``). The staging logic itself runs on CPU tensors (``kvpool_staging:
always``), which is how the tests drive it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from kvpool._native import Client, KvpoolError

log = logging.getLogger("kvpool.vllm")

# The staging area's two parts.
SAVE, LOAD = 0, 1

# Statuses of a save that leave the block in the pool.
STORED = ("ok", "already-exists")


def block_pieces(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Every layer's KV as byte tensors of shape ``(num_blocks, piece_bytes)``, in layer order:
    one piece per layer when blocks come first (``(num_blocks, ...)``: CPU, FlashInfer, MLA),
    two (K, then V) when K and V come first (``(2, num_blocks, ...)``: FlashAttention)."""
    pieces: list[torch.Tensor] = []
    for name, kv in kv_caches.items():
        if not isinstance(kv, torch.Tensor) or not kv.is_contiguous():
            raise ValueError(f"KVPoolConnector needs contiguous KV tensors; layer {name} is not")
        if kv.shape[0] == num_blocks:
            parts = [kv]
        elif kv.dim() > 1 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
            parts = [kv[0], kv[1]]
        else:
            raise ValueError(f"KV layout of layer {name} {tuple(kv.shape)} has no block dimension first")
        pieces.extend(p.view(torch.uint8).reshape(num_blocks, -1) for p in parts)
    if not pieces:
        raise ValueError("no KV caches to register")
    if len({p.shape[1] for p in pieces}) != 1:
        raise ValueError("KVPoolConnector needs the same block size in bytes in every layer")
    return pieces


class Mover:
    """Moves whole blocks; one pool object per block holds all its pieces, in order."""

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

    def __init__(self, client: Client, pieces: list[torch.Tensor]) -> None:
        self.client = client
        self.bases = [p.data_ptr() for p in pieces]
        self.stride = pieces[0].stride(0)
        self.piece = pieces[0].shape[1]
        self.block_bytes = self.piece * len(pieces)
        self.registered: list[int] = []
        for p in pieces:
            s = p.untyped_storage()
            if s.data_ptr() not in self.registered:
                self.client.register(s.data_ptr(), s.nbytes())
                self.registered.append(s.data_ptr())

    def _ranges(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        ptrs = [[b0 + b * self.stride for b0 in self.bases] for b in block_ids]
        return ptrs, [[self.piece] * len(self.bases)] * len(block_ids)

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        ptrs, sizes = self._ranges(block_ids)
        got = self.client.get_into_multi(list(keys), ptrs, sizes)
        return [st == "ok" and n == self.block_bytes for st, n in got]

    def save(self, keys, block_ids, parents, seq_tokens, tokens, fence):  # type: ignore[no-untyped-def]
        ptrs, sizes = self._ranges(block_ids)
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


class StagedMover(Mover):
    """Blocks staged through a registered host area; KV tensors stay unregistered."""

    def __init__(
        self, client: Client, pieces: list[torch.Tensor], staging_bytes: int, ops: Optional[HostOps] = None
    ) -> None:
        self.client = client
        self.pieces = pieces
        self.device = pieces[0].device
        self.ops = ops if ops is not None else ops_for(self.device)
        self.piece = pieces[0].shape[1]
        self.block_bytes = self.piece * len(pieces)
        # Loads and saves run on threads of their own, at once: each has its own part of the
        # area (two halves each), else a load could land in slots a save has yet to send.
        slots = max(4, staging_bytes // self.block_bytes)
        self.half = slots // 4
        size = 4 * self.half * self.block_bytes
        self.locks = {SAVE: threading.Lock(), LOAD: threading.Lock()}
        self.buffer: Any = None
        try:
            # Memory shared with a same-host server: it copies straight into the area.
            self.buffer = client.alloc_buffer(size)
            flat = torch.frombuffer(self.buffer, dtype=torch.uint8)
            pinned = False
        except KvpoolError:
            # A server on another host: ordinary memory, page-locked by torch where it can.
            pinned = self.device.type == "cuda"
            flat = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.host = flat.view(4 * self.half, len(pieces), self.piece)
        self.base = self.host.data_ptr()
        self.client.register(self.base, size)
        self.pinned = pinned or self.ops.pin(self.base, size)
        self.xfer = ThreadPoolExecutor(1, thread_name_prefix="kvpool-stage")
        log.info("kvpool: staging %d blocks of %d bytes through %s host memory (%s)", 4 * self.half,
                 self.block_bytes, "pinned" if self.pinned else "pageable", self.device)

    def _slots(self, part: int, half: int, n: int) -> tuple[torch.Tensor, list[int]]:
        lo = (2 * part + half) * self.half
        return self.host[lo : lo + n], [self.base + (lo + i) * self.block_bytes for i in range(n)]

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _chunks(self, n: int) -> list[range]:
        return [range(lo, min(lo + self.half, n)) for lo in range(0, n, self.half)]

    def save(self, keys, block_ids, parents, seq_tokens, tokens, fence):  # type: ignore[no-untyped-def]
        with self.locks[SAVE]:
            return self._save(keys, block_ids, parents, seq_tokens, tokens, fence)

    def _save(self, keys, block_ids, parents, seq_tokens, tokens, fence):  # type: ignore[no-untyped-def]
        out: list[str] = ["internal"] * len(keys)
        busy: list[Optional[Future[None]]] = [None, None]

        def put(chunk: range, addrs: list[int]) -> None:
            st = self.client.put_from(
                [keys[i] for i in chunk], addrs, [self.block_bytes] * len(chunk),
                parents=[parents[i] for i in chunk], seq_tokens=[seq_tokens[i] for i in chunk],
                tokens=[tokens] * len(chunk),
            )
            for i, s in zip(chunk, st):
                out[i] = s

        try:
            for c, chunk in enumerate(self._chunks(len(keys))):
                h = c % 2
                if busy[h] is not None:
                    busy[h].result()  # that half's transfer is done: it may be written again
                slots, addrs = self._slots(SAVE, h, len(chunk))
                with self.ops.stream():
                    self.ops.wait(fence)
                    idx = self._index([block_ids[i] for i in chunk])
                    gathered = torch.stack([p.index_select(0, idx) for p in self.pieces], dim=1)
                    slots.copy_(gathered, non_blocking=True)
                    done = self.ops.record()
                self.ops.sync(done)
                busy[h] = self.xfer.submit(put, chunk, addrs)
        finally:
            for f in busy:
                if f is not None:
                    f.result()
        return out

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        with self.locks[LOAD]:
            return self._load(keys, block_ids)

    def _load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        ok = [False] * len(keys)
        copying: list[Any] = [None, None]
        for c, chunk in enumerate(self._chunks(len(keys))):
            h = c % 2
            self.ops.sync(copying[h])  # the device has taken what this half held
            slots, addrs = self._slots(LOAD, h, len(chunk))
            got = self.client.get_into([keys[i] for i in chunk], addrs, [self.block_bytes] * len(chunk))
            good = [j for j, (st, n) in enumerate(got) if st == "ok" and n == self.block_bytes]
            for j in good:
                ok[chunk[j]] = True
            if not good:
                continue
            with self.ops.stream():
                sel = torch.tensor(good, dtype=torch.long)
                src = slots.index_select(0, sel) if len(good) < len(chunk) else slots
                dev = src.to(self.device, non_blocking=True)
                idx = self._index([block_ids[chunk[j]] for j in good])
                for p_i, p in enumerate(self.pieces):
                    p.index_copy_(0, idx, dev[:, p_i])
                copying[h] = self.ops.record()
        # The blocks are in place before the step's forward pass reads them.
        for ev in copying:
            self.ops.sync(ev)
        return ok

    def close(self) -> None:
        self.xfer.shutdown(wait=True)
        with contextlib.suppress(KvpoolError):
            self.client.unregister(self.base)
