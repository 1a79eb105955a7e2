"""Mooncake's tensor-parallel methods (``*_with_tp``): a tensor split evenly along ``split_dim``
into ``tp_size`` shards, shard ``r`` stored under ``<key>_tp_<r>`` as a shard object (global
shape the whole tensor's, one ``tp`` layout axis), as Mooncake names and lays them out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from kvpool.mooncake import _tensor_format as fmt
from kvpool.mooncake._codes import INVALID_PARAMS, OK, Key
from kvpool.mooncake._tensor import config_for, config_ok
from kvpool.mooncake._tensor_format import META_SIZE
from kvpool.mooncake._types import ParallelAxis


def tp_key(key: Key, rank: int) -> Key:
    """Mooncake's ``get_tp_key_name``: ``<key>_tp_<rank>``."""
    return key + b"_tp_%d" % rank if isinstance(key, bytes) else f"{key}_tp_{rank}"


def axis(kind: str, rank: int, size: int, split_dim: Optional[int] = None, expert_id: Optional[int] = None,
         stage_id: Optional[int] = None) -> ParallelAxis:
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id = kind, rank, size, split_dim, expert_id, stage_id
    return a


def with_rank(axes: Sequence[Any], kind: str, rank: int, size: Optional[int] = None) -> list[ParallelAxis]:
    """A copy of ``axes`` whose axis of ``kind`` has ``rank`` (and ``size``)."""
    out = []
    for a in axes:
        b = axis(str(a.kind), a.rank, a.size, a.split_dim, a.expert_id, a.stage_id)
        if str(a.kind).lower() == kind:
            b.rank = rank
            if size is not None:
                b.size = size
        out.append(b)
    return out


def narrow(tensor: Any, split_dim: int, rank: int, count: int) -> Any:
    start, extent = fmt.shard_range(int(tensor.shape[split_dim]), rank, count)
    return tensor.narrow(split_dim, start, extent).contiguous()


def tp_shards(tensor: Any, tp_size: int, split_dim: int, axes: Optional[Sequence[Any]] = None
              ) -> Optional[list[tuple[Any, fmt.Meta]]]:
    """Mooncake's ``build_tp_shard_infos``: every shard of ``tensor`` with its metadata (the
    ``tp`` axis alone, or ``axes`` with the ``tp`` axis' rank set), None when Mooncake refuses."""
    if not fmt.is_tensor(tensor):
        return None
    code = fmt.dtype_code(tensor)
    shape = list(tensor.shape)
    if code is None or len(shape) > fmt.MAX_DIMS or not fmt.uniform(shape, split_dim, tp_size):
        return None
    out = []
    for rank in range(tp_size):
        chunk = narrow(tensor, split_dim, rank, tp_size)
        specs = with_rank(axes, "tp", rank) if axes else [axis("tp", rank, tp_size, split_dim)]
        meta = fmt.shard_meta(code, shape, list(chunk.shape), specs, 0)
        if meta is None:
            return None
        out.append((chunk, meta))
    return out


class TensorParallelMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its tensor methods."""

    # ---- writes -----------------------------------------------------------------------------

    def _put_tp(self, base_keys: Sequence[Key], tensors: Sequence[Any], config: Any, tp_size: int,
                split_dim: int, upsert: bool = False) -> list[int]:
        """Every shard of every tensor in one request; per base key 0 or its first shard's code."""
        out = [INVALID_PARAMS] * len(base_keys)
        keys, chunks, metas, done = [], [], [], []
        for i, (k, t) in enumerate(zip(base_keys, tensors)):
            try:
                shards = tp_shards(t, tp_size, split_dim) if t is not None else None
            except Exception:  # as Mooncake: whatever fails while splitting is -600
                shards = None
            if shards is None:
                continue
            done.append(i)
            for rank, (chunk, meta) in enumerate(shards):
                keys.append(tp_key(k, rank))
                chunks.append(chunk)
                metas.append(meta)
        if not keys:
            return out
        codes = self._write_tensors(keys, chunks, upsert, config_for(config, done, tp_size), metas)
        for n, i in enumerate(done):
            mine = codes[n * tp_size:(n + 1) * tp_size]
            out[i] = next((c for c in mine if c != OK), OK)
        return out

    def put_tensor_with_tp(self, key: Key, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """Split ``tensor`` along ``split_dim`` into ``tp_size`` even shards and store each under
        ``<key>_tp_<rank>`` (all of them, whatever ``tp_rank``); 0 or the first shard's code, -600
        when it does not split evenly. ``tp_size`` 1 is ``put_tensor``."""
        fmt.torch_module()
        if self._c() is None:
            return INVALID_PARAMS
        if tp_size <= 1:
            return self._batch_write([key], [tensor], False, None)[0]
        return self._put_tp([key], [tensor], None, tp_size, split_dim)[0]

    def pub_tensor_with_tp(self, key: Key, tensor: Any, config: Any = None, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """``put_tensor_with_tp`` with a ``ReplicateConfig``."""
        fmt.torch_module()
        if self._c() is None or not config_ok(config):
            return INVALID_PARAMS
        if tp_size <= 1:
            return self._batch_write([key], [tensor], False, config)[0]
        return self._put_tp([key], [tensor], config, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: Sequence[Key], tensors_list: Sequence[Any], tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        """``put_tensor_with_tp`` of many, one request for all shards; one code per key."""
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[Key], tensors_list: Sequence[Any], config: Any = None,
                                 tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> list[int]:
        fmt.torch_module()
        if tp_size <= 1:
            return self._batch_write(base_keys, tensors_list, False, config)
        if self._c() is None or len(base_keys) != len(tensors_list) or not base_keys or not config_ok(config):
            return [INVALID_PARAMS] * len(base_keys)
        groups = getattr(config, "group_ids", None) if config is not None else None
        if groups is not None and len(groups) != len(base_keys):
            return [INVALID_PARAMS] * len(base_keys)
        return self._put_tp(base_keys, list(tensors_list), config, tp_size, split_dim)

    def put_tensor_with_tp_from(self, key: Key, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> int:
        """``put_tensor_with_tp`` of the whole tensor object in registered memory at
        ``buffer_ptr`` (``[metadata][data]``); -600 when it holds none."""
        if self._c() is None or not buffer_ptr or size < META_SIZE:
            return INVALID_PARAMS
        if tp_size <= 1:
            return self._tensor_from([key], [buffer_ptr], [size], False, None, single=True)[0]
        tensor = fmt.decode(fmt.at(int(buffer_ptr), int(size)), int(size))
        if tensor is None:
            return INVALID_PARAMS
        return self._put_tp([key], [tensor], None, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[Key], buffer_ptrs: Sequence[int],
                                      sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        if self._c() is None:
            return [INVALID_PARAMS] * len(base_keys)
        if tp_size <= 1:
            return self._tensor_from(base_keys, buffer_ptrs, sizes, False, None)
        if not (len(base_keys) == len(buffer_ptrs) == len(sizes)) or not base_keys:
            return [INVALID_PARAMS] * len(base_keys)
        out = [OK] * len(base_keys)
        live, tensors = [], []
        for i, (p, n) in enumerate(zip(buffer_ptrs, sizes)):
            t = fmt.decode(fmt.at(int(p), int(n)), int(n)) if p and n >= META_SIZE else None
            if t is None:
                out[i] = INVALID_PARAMS
                continue
            live.append(i)
            tensors.append(t)
        if live:
            for i, code in zip(live, self._put_tp([base_keys[i] for i in live], tensors, None, tp_size, split_dim)):
                out[i] = code
        return out

    # ---- reads ------------------------------------------------------------------------------

    def get_tensor_with_tp(self, key: Key, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        """Shard ``tp_rank`` (``<key>_tp_<tp_rank>``), or the whole tensor for ``tp_size`` 1."""
        return self.get_tensor(key if tp_size <= 1 else tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[Key], tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        return self.batch_get_tensor(list(base_keys) if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: Key, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> Any:
        """``get_tensor_into`` of shard ``tp_rank``."""
        if self._c() is None:
            return None
        return self.get_tensor_into(key if tp_size <= 1 else tp_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[Key], buffer_ptrs: Sequence[int],
                                      sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        if self._c() is None:
            return [None] * len(base_keys)
        keys = list(base_keys) if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
