"""Mooncake's tensor methods: ``put_tensor``/``get_tensor`` and their batch, ``_into``, ``_from``,
``upsert_``, ``pub_``, ``_into_cuda`` and safetensors forms.

Tensors are stored in Mooncake's byte layout (:mod:`kvpool.mooncake._tensor_format`), so tensors
written by real Mooncake read on kvpool and back. torch is imported when a tensor method is
called, never at import: kvpool works without it. Differences from Mooncake: a tensor on a GPU
is copied to host memory before it is stored (Mooncake moves device memory itself), tensors come
back on the CPU, and ``get_tensor_into_cuda`` works after ``setup`` too (Mooncake's needs
``setup_dummy``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from kvpool.mooncake import _tensor_format as fmt
from kvpool.mooncake._codes import FILE_NOT_FOUND, INVALID_PARAMS, OK, Key
from kvpool.mooncake._tensor_format import META_SIZE, torch_module

log = logging.getLogger("kvpool.mooncake")


def config_for(config: Any, indices: Sequence[int], repeat: int = 1) -> Any:
    """``config`` for a subset of a batch's keys (each repeated ``repeat`` times): its
    ``group_ids`` picked to match, as Mooncake's ``MakeIndexedConfig``."""
    groups = getattr(config, "group_ids", None) if config is not None else None
    if groups is None:
        return config
    import copy

    sub = copy.copy(config)
    sub.group_ids = [groups[i] for i in indices for _ in range(repeat)]
    return sub


def config_ok(config: Any) -> bool:
    """Mooncake's ``validate_replicate_config``: ``preferred_segments``, when given, has one entry
    per replica."""
    segs = getattr(config, "preferred_segments", None) if config is not None else None
    return not segs or len(segs) == getattr(config, "replica_num", 1)


def _raw(ptr: int, size: int) -> Optional[fmt.Meta]:
    """The metadata of a tensor object in caller memory (Mooncake's ``ParseTensorMetadata`` of a
    ``_from`` buffer), None when there is none."""
    if not ptr or size < META_SIZE:
        return None
    return fmt.parse(fmt.at(int(ptr), int(size)), int(size))


class TensorMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its byte methods."""

    # ---- writing tensors --------------------------------------------------------------------

    def _write_tensors(self, keys: Sequence[Key], tensors: Sequence[Any], upsert: bool, config: Any,
                       metas: Optional[Sequence[Optional[fmt.Meta]]] = None) -> list[int]:
        """Store tensors (or shards with their ``metas``) in one request: one code per key, -600
        for what is not a storable tensor."""
        groups = getattr(config, "group_ids", None) if config is not None else None
        if len(keys) != len(tensors) or (groups is not None and len(groups) != len(keys)):
            return [INVALID_PARAMS] * len(keys)
        values = []
        for i, t in enumerate(tensors):
            meta = metas[i] if metas is not None else None
            values.append(fmt.encode(t, meta) if fmt.is_tensor(t) else None)
        live = [i for i, v in enumerate(values) if v is not None]
        out = [INVALID_PARAMS] * len(keys)
        if live:
            codes = self._put([keys[i] for i in live], [values[i] for i in live], upsert, config_for(config, live))
            for i, c in zip(live, codes):
                out[i] = c
        return out

    def _batch_write(self, keys: Sequence[Key], tensors: Sequence[Any], upsert: bool, config: Any) -> list[int]:
        fmt.torch_module()
        if self._c() is None or len(keys) != len(tensors) or not keys:
            return [INVALID_PARAMS] * len(keys)
        if not config_ok(config):
            return [INVALID_PARAMS] * len(keys)
        return self._write_tensors(keys, list(tensors), upsert, config)

    def put_tensor(self, key: Key, tensor: Any) -> int:
        """Store a tensor with its dtype and shape; 0, -600 for anything but a tensor of a
        supported dtype (or before ``setup``), or the put's code. A key that exists answers 0
        and keeps its value, as ``put``."""
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: Sequence[Key], tensors_list: Sequence[Any]) -> list[int]:
        """``put_tensor`` of many in one request; one code per key (-600 for every key when the
        lists differ in length)."""
        return self._batch_write(keys, tensors_list, False, None)

    def upsert_tensor(self, key: Key, tensor: Any) -> int:
        """``put_tensor`` that replaces an existing value (also one a read has leased)."""
        return self.batch_upsert_tensor([key], [tensor])[0]

    def batch_upsert_tensor(self, keys: Sequence[Key], tensors_list: Sequence[Any]) -> list[int]:
        return self._batch_write(keys, tensors_list, True, None)

    def pub_tensor(self, key: Key, tensor: Any, config: Any = None) -> int:
        """``put_tensor`` with a ``ReplicateConfig`` (its pins apply; -600 when
        ``preferred_segments`` does not have ``replica_num`` entries, as Mooncake)."""
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def batch_pub_tensor(self, keys: Sequence[Key], tensors_list: Sequence[Any], config: Any = None) -> list[int]:
        return self._batch_write(keys, tensors_list, False, config)

    def upsert_pub_tensor(self, key: Key, tensor: Any, config: Any = None) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_upsert_pub_tensor(self, keys: Sequence[Key], tensors_list: Sequence[Any], config: Any = None) -> list[int]:
        return self._batch_write(keys, tensors_list, True, config)

    def put_tensor_from(self, key: Key, buffer_ptr: int, size: int) -> int:
        """Store a tensor object already laid out in registered memory (``[metadata][data]``, as
        ``get_tensor_into`` leaves it); -600 when the buffer holds no valid tensor object."""
        return self._tensor_from([key], [buffer_ptr], [size], False, None, single=True)[0]

    def batch_put_tensor_from(self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``put_tensor_from`` of many; -600 for every key when one buffer is not a tensor object."""
        return self._tensor_from(keys, buffer_ptrs, sizes, False, None)

    def upsert_tensor_from(self, key: Key, buffer_ptr: int, size: int) -> int:
        return self._tensor_from([key], [buffer_ptr], [size], True, None, single=True)[0]

    def batch_upsert_tensor_from(self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._tensor_from(keys, buffer_ptrs, sizes, True, None)

    def _tensor_from(self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int], upsert: bool,
                     config: Any, single: bool = False) -> list[int]:
        if self._c() is None:
            return [INVALID_PARAMS] * len(keys)
        if not keys and not single:
            return []
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if any(_raw(p, s) is None for p, s in zip(ptrs, sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._put_from(keys, [[int(p)] for p in ptrs], [[int(s)] for s in sizes], upsert, config)

    # ---- reading tensors --------------------------------------------------------------------

    def get_tensor(self, key: Key) -> Any:
        """The tensor stored under ``key`` (on the CPU), or None when it is missing or not a
        tensor."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[Key]) -> list[Any]:
        """``get_tensor`` of many in one request; None for each missing one."""
        torch_module()  # missing torch is an error whatever the keys hold
        if self._c() is None:
            return [None] * len(keys)
        # A private copy: the tensor is writable and outlives the reply.
        return [fmt.decode(bytearray(v), len(v)) if v else None for v in self.get_batch(keys)]

    def get_tensor_into(self, key: Key, buffer_ptr: int, size: int) -> Any:
        """Read a stored tensor into the registered range ``[buffer_ptr, buffer_ptr + size)`` and
        return a tensor over that memory (its data starts 304 bytes in, after the header), or
        None when missing, not a tensor, or larger than ``size``."""
        torch_module()
        if self._c() is None or not buffer_ptr:
            return None
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        """``get_tensor_into`` of many in one request: a tensor or None per key; -600 for every
        key when the lists differ in length or an address is 0 (Mooncake's codes)."""
        torch_module()
        if self._c() is None or not (len(keys) == len(buffer_ptrs) == len(sizes)) or 0 in buffer_ptrs:
            return [INVALID_PARAMS] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [fmt.decode(fmt.at(int(p), n), n) if n >= META_SIZE else None for p, n in zip(buffer_ptrs, got)]

    def get_tensor_into_cuda(self, key: Key, tensor: Any) -> int:
        """Read the stored tensor's payload into ``tensor`` (a contiguous tensor of the same dtype
        and shape, on any device: the payload is read to host memory, then copied with torch).
        The bytes copied, or -600 when the key is missing, holds no tensor, or the destination
        does not match (Mooncake's code for all of these)."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Sequence[Key], tensors_list: Sequence[Any]) -> list[int]:
        """``get_tensor_into_cuda`` of many, one read request."""
        torch_module()
        out = [INVALID_PARAMS] * len(keys)
        if self._c() is None or len(keys) != len(tensors_list):
            return out
        for i, (src, dst) in enumerate(zip(self.batch_get_tensor(keys), tensors_list)):
            if src is None or not fmt.is_tensor(dst) or not dst.is_contiguous():
                continue
            if dst.dtype != src.dtype or list(dst.shape) != list(src.shape):
                continue
            if dst.numel():
                dst.copy_(src)
            out[i] = int(src.numel() * src.element_size())
        return out

    # ---- safetensors ------------------------------------------------------------------------

    def save_tensor_to_safetensor(self, key: Key, file_name: Optional[str] = None) -> int:
        """Write the tensor under ``key`` to a safetensors file named ``file_name`` (``key``
        without one), the tensor named ``key`` in it: 0, -1100 (``FILE_NOT_FOUND``) when the key
        holds no tensor, -600 when the file cannot be written or ``safetensors`` is missing."""
        if self._c() is None:
            return INVALID_PARAMS
        tensor = self.get_tensor(key)
        if tensor is None:
            log.error("save_tensor_to_safetensor: no tensor under %r", key)
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({str(key): tensor}, str(key) if file_name is None else str(file_name))
            return OK
        except Exception as e:  # as Mooncake: any Python error of the save is -600
            log.error("save_tensor_to_safetensor: %s", e)
            return INVALID_PARAMS

    def load_tensor_from_safetensor(self, key: Optional[Key] = None, file_name: Optional[str] = None) -> Any:
        """Store a tensor of a safetensors file under ``key`` (the file name without one) and
        return it; the file's tensor named ``key``, else its first (logged). None when the file
        cannot be read, holds no tensor, or the put fails."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() missing required argument: 'file_name'")
        if self._c() is None:
            return None
        try:
            from safetensors.torch import load_file

            loaded = load_file(str(file_name))
        except Exception as e:
            log.error("load_tensor_from_safetensor: %s", e)
            return None
        if not loaded:
            log.error("load_tensor_from_safetensor: no tensors in %s", file_name)
            return None
        target = str(file_name) if key is None else key
        name = str(key) if key is not None and str(key) in loaded else next(iter(loaded))
        if key is not None and name != str(key):
            log.warning("load_tensor_from_safetensor: %r not in %s; using its first tensor", key, file_name)
        tensor = loaded[name]
        rc = self.put_tensor(target, tensor)
        if rc != OK:
            log.error("load_tensor_from_safetensor: put of %r failed: %d", target, rc)
            return None
        return tensor


# ---- module-level helpers of mooncake.store -----------------------------------------------------


def _serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """Mooncake's ``_serialize_tensor``: (304 bytes of metadata, data address, data bytes, the
    contiguous tensor owning them); ``ValueError`` for a tensor Mooncake does not store."""
    meta = fmt.full_meta(tensor)
    if meta is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization")
    owner = tensor.contiguous()
    return meta.pack(), int(owner.data_ptr()), int(meta.data_bytes), owner


def _tensor_metadata_size() -> int:
    return META_SIZE


def _deserialize_tensor(payload: bytes) -> Any:
    """Mooncake's ``_deserialize_tensor``: the tensor of metadata plus payload bytes (a private
    copy); ``ValueError`` when they hold none."""
    data = bytearray(payload)
    t = fmt.decode(data, len(data))
    if t is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return t
