"""Mooncake's tensor methods (``put_tensor``, ``get_tensor`` and their batch and ``_into`` forms).

A tensor is stored as Mooncake stores it, so sizes and ``get_into`` offsets agree: a 304-byte
little-endian header (magic ``0x4d4f4f4e``, version 1, dtype code, ndim, shape of up to 8 dims,
data offset and length; no tensor-parallel layout) followed by the tensor's bytes, C order.

torch is imported when a tensor method is called, never at import: kvpool works without it.
Differences from Mooncake: a tensor on a GPU is copied to host memory before it is stored
(Mooncake moves device memory itself), and tensors come back on the CPU.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any, Optional

OK = 0
INVALID_PARAMS = -600

_MAGIC = 0x4D4F4F4E
_VERSION = 1
_MAX_DIMS = 8
# magic u32, version u16, header size u16, dtype i32, ndim i32, layout kind u32, flags u32,
# data offset u64, data bytes u64; then global and local shape (8 x i64 each), axis count and a
# reserved u32, and 4 layout axes of 32 bytes (unused: always zero).
_HEADER = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct(f"<{_MAX_DIMS}q")
_GLOBAL_SHAPE_AT = _HEADER.size
_LOCAL_SHAPE_AT = _GLOBAL_SHAPE_AT + _SHAPE.size
_AXES_AT = _LOCAL_SHAPE_AT + _SHAPE.size
META_SIZE = _AXES_AT + 8 + 4 * 32  # 304, Mooncake's sizeof(TensorMetadata)

# Mooncake's dtype codes, by torch dtype name; numpy type the bytes are read as (by name: numpy,
# like torch, is imported only by the tensor methods).
_DTYPES: list[tuple[str, str]] = [
    ("float32", "float32"), ("float64", "float64"), ("int8", "int8"), ("uint8", "uint8"),
    ("int16", "int16"), ("uint16", "uint16"), ("int32", "int32"), ("uint32", "uint32"),
    ("int64", "int64"), ("uint64", "uint64"), ("bool", "bool"), ("float16", "uint16"),
    ("bfloat16", "uint16"), ("float8_e4m3fn", "uint8"), ("float8_e5m2", "uint8"),
]


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError("kvpool.mooncake's tensor methods need PyTorch (pip install torch)") from e
    return torch


def encode(tensor: Any) -> Optional[bytes]:
    """Header and bytes of ``tensor`` as Mooncake stores them; None when it is not a tensor of a
    dtype Mooncake stores (its ``put_tensor`` answers -600 then)."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        return None
    names = [n for n, _ in _DTYPES]
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in names or tensor.dim() > _MAX_DIMS:
        return None
    t = tensor.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy()
    shape = list(t.shape) + [-1] * (_MAX_DIMS - t.dim())
    head = bytearray(META_SIZE)
    _HEADER.pack_into(head, 0, _MAGIC, _VERSION, META_SIZE, names.index(name), t.dim(), 0, 0, META_SIZE, data.nbytes)
    _SHAPE.pack_into(head, _GLOBAL_SHAPE_AT, *shape)
    _SHAPE.pack_into(head, _LOCAL_SHAPE_AT, *shape)
    return bytes(head) + data.tobytes()


def decode(buf: Any, length: int) -> Any:
    """The tensor in the first ``length`` bytes of ``buf`` (a writable buffer: the tensor shares
    its memory), or None when they do not hold one (as Mooncake's ``get_tensor``)."""
    torch = _torch()
    import numpy as np  # torch's own dependency
    if length < META_SIZE:
        return None
    raw = memoryview(buf)[:length]
    magic, version, size, dtype, ndim, kind, _flags, offset, nbytes = _HEADER.unpack_from(raw, 0)
    axes = struct.unpack_from("<I", raw, _AXES_AT)[0]
    if (magic, version, size) != (_MAGIC, _VERSION, META_SIZE) or not 0 <= dtype < len(_DTYPES):
        return None
    if not 0 <= ndim <= _MAX_DIMS or kind > 1 or axes > 4 or offset < META_SIZE or offset + nbytes > length:
        return None
    shape = _SHAPE.unpack_from(raw, _LOCAL_SHAPE_AT)[:ndim]
    name, np_type = _DTYPES[dtype]
    tdtype = getattr(torch, name)
    if any(d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) * _itemsize(tdtype) != nbytes:
        return None
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    arr = np.frombuffer(raw, dtype=np_type, count=nbytes // np.dtype(np_type).itemsize, offset=offset)
    if ndim > 0:  # Mooncake returns a 0-dim tensor as shape (1,): kept, so results agree
        arr = arr.reshape(shape)
    t = torch.from_numpy(arr)
    return t.view(tdtype) if t.dtype != tdtype else t


def _itemsize(dtype: Any) -> int:
    return int(dtype.itemsize)


def _at(ptr: int, length: int) -> Any:
    """Writable memory at a caller's address, for a tensor that shares it (``get_tensor_into``)."""
    return (ctypes.c_uint8 * length).from_address(ptr)


class TensorMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its byte methods."""

    def _c(self) -> Any:  # provided by the store
        raise NotImplementedError

    def _put(self, keys: Sequence[Any], values: Sequence[Any], upsert: bool, config: Any) -> list[int]:
        raise NotImplementedError

    def get_batch(self, keys: Sequence[Any]) -> list[bytes]:
        raise NotImplementedError

    def batch_get_into(self, keys: Sequence[Any], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a tensor with its dtype and shape; 0, -600 for anything but a tensor of a
        supported dtype (or before ``setup``), or the put's code. A key that exists answers 0
        and keeps its value, as ``put``."""
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        """``put_tensor`` of many in one request; one code per key (-600 for every key when the
        lists differ in length)."""
        if self._c() is None or len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        values = [encode(t) for t in tensors_list]
        live = [i for i, v in enumerate(values) if v is not None]
        out = [INVALID_PARAMS] * len(keys)
        if live:
            codes = self._put([keys[i] for i in live], [values[i] for i in live], False, None)
            for i, c in zip(live, codes):
                out[i] = c
        return out

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (on the CPU), or None when it is missing or not a
        tensor."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        """``get_tensor`` of many in one request; None for each missing one."""
        _torch()  # missing torch is an error whatever the keys hold
        if self._c() is None:
            return [None] * len(keys)
        out = []
        for v in self.get_batch(keys):
            # A private copy: the tensor is writable and outlives the reply.
            out.append(decode(bytearray(v), len(v)) if v else None)
        return out

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a stored tensor into the registered range ``[buffer_ptr, buffer_ptr + size)`` and
        return a tensor over that memory (its data starts 304 bytes in, after the header), or
        None when missing, not a tensor, or larger than ``size``."""
        _torch()
        if self._c() is None or not buffer_ptr:
            return None
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        """``get_tensor_into`` of many in one request: a tensor or None per key; -600 for every
        key when the lists differ in length or an address is 0 (Mooncake's codes)."""
        _torch()
        if self._c() is None or not (len(keys) == len(buffer_ptrs) == len(sizes)) or 0 in buffer_ptrs:
            return [INVALID_PARAMS] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [decode(_at(int(p), n), n) if n >= META_SIZE else None for p, n in zip(buffer_ptrs, got)]
