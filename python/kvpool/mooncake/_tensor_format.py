"""Mooncake's tensor object layout, byte for byte (``integration_utils.h``'s ``TensorMetadata``).

A stored tensor is a 304-byte little-endian header followed by the tensor's bytes in C order:

- header (40 bytes): magic ``0x4d4f4f4e``, version 1, header size 304 (u16), dtype code (i32),
  ndim (i32), layout kind (u32: 0 full, 1 shard), flags (u32, 0), data offset (u64, 304), data
  bytes (u64);
- global shape and local shape: 8 x i64 each, -1 past ``ndim`` (a shard's local shape is its
  own, its global shape the whole tensor's);
- axis count (u32), reserved (u32), then 4 layout axes of 32 bytes: kind (i32: dp 0, tp 1, ep 2,
  pp 3), axis index, shard rank, shard count, split dim (-1 for none), reserved0 (the expert id of
  an ``ep`` axis, the stage id of a ``pp`` axis), reserved1 (i64: the shard's extent along its
  split dim).

A shard manifest (``<key>__writer_manifest``, ``<key>__parallelism_manifest``) is 96 bytes:
magic ``0x574d414e``, version 1, size 96, dtype, ndim, split dim, shard count, reserved (i32),
4 bytes of padding, global shape (8 x i64).

torch and numpy are imported only by the functions that need them.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
FULL = 0
SHARD = 1

_HEADER = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")
_AXIS = struct.Struct("<iiiiiiq")
_GLOBAL_AT = _HEADER.size
_LOCAL_AT = _GLOBAL_AT + _SHAPE.size
_COUNT_AT = _LOCAL_AT + _SHAPE.size
_AXES_AT = _COUNT_AT + 8
META_SIZE = _AXES_AT + MAX_AXES * _AXIS.size  # 304: sizeof(TensorMetadata)

MANIFEST_MAGIC = 0x574D414E
_MANIFEST = struct.Struct("<IHHiiiii4x")
MANIFEST_SIZE = _MANIFEST.size + _SHAPE.size  # 96: sizeof(WriterShardManifest)

#: Axis kinds by name (Mooncake's ``LayoutAxisKind``), and the order of canonical key names.
AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
AXIS_NAMES = {v: k for k, v in AXIS_KINDS.items()}
TP = AXIS_KINDS["tp"]

# Mooncake's dtype codes: (torch dtype name, numpy type the bytes are read as, element size).
DTYPES: list[tuple[str, str, int]] = [
    ("float32", "float32", 4), ("float64", "float64", 8), ("int8", "int8", 1), ("uint8", "uint8", 1),
    ("int16", "int16", 2), ("uint16", "uint16", 2), ("int32", "int32", 4), ("uint32", "uint32", 4),
    ("int64", "int64", 8), ("uint64", "uint64", 8), ("bool", "bool", 1), ("float16", "uint16", 2),
    ("bfloat16", "uint16", 2), ("float8_e4m3fn", "uint8", 1), ("float8_e5m2", "uint8", 1),
]
_CODES = {name: i for i, (name, _, _) in enumerate(DTYPES)}


def torch_module() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError("kvpool.mooncake's tensor methods need PyTorch (pip install torch)") from e
    return torch


@dataclass
class Axis:
    kind: int
    axis_index: int
    rank: int
    count: int
    split_dim: int = -1
    reserved0: int = 0
    reserved1: int = 0


@dataclass
class Meta:
    dtype: int
    global_shape: list[int]
    local_shape: list[int]
    layout: int = FULL
    axes: list[Axis] = field(default_factory=list)
    data_bytes: int = 0
    data_offset: int = META_SIZE

    @property
    def ndim(self) -> int:
        return len(self.local_shape)

    def pack(self) -> bytes:
        out = bytearray(META_SIZE)
        _HEADER.pack_into(out, 0, MAGIC, VERSION, META_SIZE, self.dtype, self.ndim, self.layout, 0,
                          self.data_offset, self.data_bytes)
        _SHAPE.pack_into(out, _GLOBAL_AT, *(list(self.global_shape) + [-1] * (MAX_DIMS - self.ndim)))
        _SHAPE.pack_into(out, _LOCAL_AT, *(list(self.local_shape) + [-1] * (MAX_DIMS - self.ndim)))
        struct.pack_into("<II", out, _COUNT_AT, len(self.axes), 0)
        for i, a in enumerate(self.axes):
            _AXIS.pack_into(out, _AXES_AT + i * _AXIS.size, a.kind, a.axis_index, a.rank, a.count, a.split_dim,
                            a.reserved0, a.reserved1)
        return bytes(out)

    def axis(self, kind: int) -> Optional[Axis]:
        return next((a for a in self.axes if a.kind == kind), None)


def element_size(dtype: int) -> Optional[int]:
    return DTYPES[dtype][2] if 0 <= dtype < len(DTYPES) else None


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parse(buf: Any, length: int) -> Optional[Meta]:
    """The metadata of a tensor object of ``length`` bytes at the start of ``buf``, or None when
    Mooncake's ``ValidateTensorMetadata`` would refuse it (the payload must fill the rest
    exactly)."""
    if length < META_SIZE:
        return None
    raw = memoryview(buf).cast("B")[:META_SIZE] if not isinstance(buf, (bytes, bytearray)) else buf
    magic, version, size, dtype, ndim, layout, _flags, offset, nbytes = _HEADER.unpack_from(raw, 0)
    count = struct.unpack_from("<I", raw, _COUNT_AT)[0]
    if (magic, version, size) != (MAGIC, VERSION, META_SIZE) or element_size(dtype) is None:
        return None
    if not 0 <= ndim <= MAX_DIMS or count > MAX_AXES or layout > SHARD:
        return None
    if offset < META_SIZE or offset > length or nbytes != length - offset:
        return None
    gshape = list(_SHAPE.unpack_from(raw, _GLOBAL_AT))
    lshape = list(_SHAPE.unpack_from(raw, _LOCAL_AT))
    if any(d < 0 for d in gshape[:ndim] + lshape[:ndim]) or any(d != -1 for d in gshape[ndim:] + lshape[ndim:]):
        return None
    if numel(lshape[:ndim]) * (element_size(dtype) or 0) != nbytes:
        return None
    axes = [Axis(*_AXIS.unpack_from(raw, _AXES_AT + i * _AXIS.size)) for i in range(count)]
    for a in axes:
        if not 0 <= a.kind <= 4 or a.count <= 0 or not 0 <= a.rank < a.count or not -1 <= a.split_dim < ndim:
            return None
    return Meta(dtype, gshape[:ndim], lshape[:ndim], layout, axes, nbytes, offset)


def shard_meta(dtype: int, global_shape: list[int], local_shape: list[int], specs: list[Any],
               data_bytes: int) -> Optional[Meta]:
    """Mooncake's ``build_shard_metadata_from_shapes``: a shard's metadata from its layout axes
    (``ParallelAxis``-like objects, in the order given)."""
    if not specs or len(specs) > MAX_AXES or len(global_shape) != len(local_shape):
        return None
    axes = []
    for i, s in enumerate(specs):
        kind = AXIS_KINDS.get(str(s.kind).lower())
        if kind is None:
            return None
        extent = 0
        if s.split_dim is not None:
            if not 0 <= s.split_dim < len(local_shape):
                return None
            extent = local_shape[s.split_dim]
        reserved0 = 0
        if kind == AXIS_KINDS["ep"] and s.expert_id is not None:
            reserved0 = s.expert_id
        if kind == AXIS_KINDS["pp"] and s.stage_id is not None:
            reserved0 = s.stage_id
        axes.append(Axis(kind, i, s.rank, s.size, -1 if s.split_dim is None else s.split_dim, reserved0, extent))
    return Meta(dtype, list(global_shape), list(local_shape), SHARD, axes, data_bytes)


def pack_manifest(global_shape: list[int], dtype: int, split_dim: int, shard_count: int) -> bytes:
    shape = list(global_shape) + [-1] * (MAX_DIMS - len(global_shape))
    return _MANIFEST.pack(MANIFEST_MAGIC, VERSION, MANIFEST_SIZE, dtype, len(global_shape), split_dim,
                          shard_count, 0) + _SHAPE.pack(*shape)


@dataclass
class Manifest:
    dtype: int
    split_dim: int
    shard_count: int
    global_shape: list[int]


def parse_manifest(buf: Optional[bytes]) -> Optional[Manifest]:
    if not buf or len(buf) < MANIFEST_SIZE:
        return None
    magic, version, size, dtype, ndim, split, count, _ = _MANIFEST.unpack_from(buf, 0)
    if (magic, version, size) != (MANIFEST_MAGIC, VERSION, MANIFEST_SIZE) or not 0 <= ndim <= MAX_DIMS:
        return None
    if count <= 0 or not 0 <= split < ndim:
        return None
    shape = list(_SHAPE.unpack_from(buf, _MANIFEST.size))[:ndim]
    if any(d < 0 for d in shape):
        return None
    return Manifest(dtype, split, count, shape)


# ---- tensors ----------------------------------------------------------------------------------


def dtype_code(tensor: Any) -> Optional[int]:
    """Mooncake's dtype code of a torch tensor, None for a dtype it does not store."""
    return _CODES.get(str(getattr(tensor, "dtype", "")).removeprefix("torch."))


def is_tensor(obj: Any) -> bool:
    """Mooncake's test: the object's class name contains ``Tensor``."""
    return "Tensor" in type(obj).__name__


def host_bytes(tensor: Any) -> Any:
    """The tensor's bytes in C order as a numpy uint8 array (a GPU tensor is copied to host)."""
    torch = torch_module()
    t = tensor.detach().contiguous()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else _empty_bytes()


def _empty_bytes() -> Any:
    import numpy as np

    return np.empty(0, dtype=np.uint8)


def full_meta(tensor: Any) -> Optional[Meta]:
    """The metadata Mooncake writes for a whole tensor; None for what its ``put_tensor`` refuses
    (not a tensor, an unknown dtype, more than 8 dimensions)."""
    if not is_tensor(tensor):
        return None
    code = dtype_code(tensor)
    if code is None or tensor.dim() > MAX_DIMS:
        return None
    shape = list(tensor.shape)
    return Meta(code, shape, shape, FULL, [], numel(shape) * DTYPES[code][2])


def encode(tensor: Any, meta: Optional[Meta] = None) -> Optional[bytes]:
    """Header and bytes of ``tensor`` as Mooncake stores them (``meta`` for a shard)."""
    meta = meta or full_meta(tensor)
    if meta is None:
        return None
    data = host_bytes(tensor)
    meta.data_bytes = int(data.nbytes)
    return meta.pack() + data.tobytes()


def decode(buf: Any, length: int) -> Any:
    """The tensor in the first ``length`` bytes of ``buf`` (writable: the tensor shares its
    memory), or None when they do not hold one (as Mooncake's ``get_tensor``). A 0-dim tensor
    comes back with shape (1,), as Mooncake's."""
    torch = torch_module()
    import numpy as np  # torch's own dependency

    meta = parse(buf, length)
    if meta is None:
        return None
    name, np_type, _ = DTYPES[meta.dtype]
    tdtype = getattr(torch, name)
    if meta.data_bytes == 0:
        return torch.empty(tuple(meta.local_shape), dtype=tdtype)
    arr = np.frombuffer(buf, dtype=np_type, count=meta.data_bytes // np.dtype(np_type).itemsize,
                        offset=meta.data_offset)
    if meta.ndim > 0:
        arr = arr.reshape(meta.local_shape)
    t = torch.from_numpy(arr)
    return t.view(tdtype) if t.dtype != tdtype else t


def at(ptr: int, length: int) -> Any:
    """Writable memory at a caller's address (a tensor over it shares it)."""
    return (ctypes.c_uint8 * length).from_address(ptr)


def shard_range(dim: int, rank: int, count: int) -> tuple[int, int]:
    """Mooncake's ``calculate_shard_range``: (start, extent) of shard ``rank`` of ``count``."""
    if dim < 0 or count <= 0 or not 0 <= rank < count:
        return 0, 0
    start = dim * rank // count
    return start, dim * (rank + 1) // count - start


def uniform(shape: list[int], split_dim: int, count: int) -> bool:
    """Mooncake shards only evenly: ``shape[split_dim]`` divisible by ``count``."""
    return 0 <= split_dim < len(shape) and count > 0 and shape[split_dim] >= 0 and shape[split_dim] % count == 0
