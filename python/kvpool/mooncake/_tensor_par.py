"""Mooncake's unified parallel tensor IO (``*_with_parallelism``): tensors stored whole, as writer
partitions or as shards of a ``TensorParallelism`` (``tp``/``dp``/``ep``/``pp`` axes), read as
stored, as one shard, or whole again, under Mooncake's key names, objects and manifests.

Key names, as Mooncake forms them: a single ``tp`` axis ``<key>_tp_<rank>``; other layouts
``<key>__<axis>...`` with the axes in the order dp, tp, ep, pp, each ``<kind>_<rank>of<size>``
plus ``_sd<split_dim>``, ``_eid<expert_id>``, ``_sid<stage_id>`` where given; writer partitions
``<key>__writer_<rank>of<size>_sd<split_dim>`` with ``<key>__writer_manifest``; a ``tp`` write
records ``<key>__parallelism_manifest``. Shards split evenly only, as Mooncake's."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any, Optional

from kvpool._native import KvpoolError
from kvpool.mooncake import _tensor_format as fmt
from kvpool.mooncake._codes import INVALID_PARAMS, OK, Key
from kvpool.mooncake._tensor import config_for, config_ok
from kvpool.mooncake._tensor_format import META_SIZE
from kvpool.mooncake._tensor_tp import axis, narrow, tp_key, tp_shards, with_rank
from kvpool.mooncake._types import ParallelAxis, SoftPinAction

log = logging.getLogger("kvpool.mooncake")

_ORDER = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}


def _cat(key: Key, suffix: str) -> Key:
    return key + suffix.encode() if isinstance(key, bytes) else key + suffix


def parse_axes(obj: Any) -> Optional[list[ParallelAxis]]:
    """A ``TensorParallelism``-like object -> its axes (kinds lower-cased), None when malformed."""
    if obj is None or not hasattr(obj, "axes"):
        return None
    out = []
    for a in list(obj.axes):
        if not all(hasattr(a, f) for f in ("kind", "rank", "size")) or str(a.kind).lower() not in _ORDER:
            return None
        out.append(axis(str(a.kind).lower(), int(a.rank), int(a.size), getattr(a, "split_dim", None),
                        getattr(a, "expert_id", None), getattr(a, "stage_id", None)))
    return out


def valid_axes(axes: Optional[list[ParallelAxis]]) -> bool:
    """Mooncake's ``validate_parallelism_spec``."""
    if not axes or len(axes) > fmt.MAX_AXES or len({a.kind for a in axes}) != len(axes):
        return False
    for a in axes:
        if a.size <= 0 or not 0 <= a.rank < a.size:
            return False
        if a.kind == "tp" and a.split_dim is None:
            return False
        if a.kind in ("dp", "ep", "pp") and a.split_dim is not None:
            return False
        if (a.kind == "ep" and a.expert_id is None) or (a.kind == "pp" and a.stage_id is None):
            return False
    return True


def canonical(axes: Sequence[ParallelAxis]) -> list[ParallelAxis]:
    return sorted(axes, key=lambda a: _ORDER[a.kind])


def single_tp(axes: Sequence[ParallelAxis]) -> bool:
    return len(axes) == 1 and axes[0].kind == "tp"


def tp_of(axes: Sequence[ParallelAxis]) -> Optional[ParallelAxis]:
    return next((a for a in axes if a.kind == "tp"), None)


def key_name(key: Key, axes: Sequence[ParallelAxis]) -> Key:
    """Mooncake's ``get_parallelism_key_name``."""
    if single_tp(axes):
        return tp_key(key, axes[0].rank)
    parts = []
    for a in canonical(axes):
        s = f"__{a.kind}_{a.rank}of{a.size}"
        s += "" if a.split_dim is None else f"_sd{a.split_dim}"
        s += "" if a.expert_id is None else f"_eid{a.expert_id}"
        s += "" if a.stage_id is None else f"_sid{a.stage_id}"
        parts.append(s)
    return _cat(key, "".join(parts))


def writer_key(key: Key, rank: int, size: int, split_dim: int) -> Key:
    return _cat(key, f"__writer_{rank}of{size}_sd{split_dim}")


def stored_axes(meta: fmt.Meta) -> Optional[list[ParallelAxis]]:
    """Mooncake's ``parallelism_from_metadata`` (canonical order), None for a whole tensor."""
    if meta.layout != fmt.SHARD:
        return None
    out = []
    for a in meta.axes:
        kind = fmt.AXIS_NAMES.get(a.kind, "unknown")
        out.append(axis(kind, a.rank, a.count, a.split_dim if a.split_dim >= 0 else None,
                        a.reserved0 if kind == "ep" else None, a.reserved0 if kind == "pp" else None))
    return sorted(out, key=lambda a: _ORDER.get(a.kind, 4))


def _same(a: ParallelAxis, b: ParallelAxis, ignore_rank: bool = False) -> bool:
    return (a.kind == b.kind and (ignore_rank or a.rank == b.rank) and a.size == b.size and a.split_dim == b.split_dim
            and a.expert_id == b.expert_id and a.stage_id == b.stage_id)


def matches(axes: Sequence[ParallelAxis], meta: fmt.Meta, ignore_tp_rank: bool = False) -> bool:
    stored = stored_axes(meta)
    want = canonical(axes)
    return stored is not None and len(stored) == len(want) and all(
        _same(w, s, ignore_tp_rank and w.kind == "tp") for w, s in zip(want, stored))


def is_default_config(c: Any) -> bool:
    """Mooncake's ``is_default_replicate_config``."""
    if c is None:
        return True
    return (getattr(c, "replica_num", 1) == 1 and not getattr(c, "nof_replica_num", 0)
            and not getattr(c, "dfs_replica_num", 0)
            and int(getattr(c, "soft_pin_action", 0) or 0) == SoftPinAction.PRESERVE
            and getattr(c, "soft_pin_ttl_ms", None) is None and not getattr(c, "with_hard_pin", False)
            and not getattr(c, "preferred_segments", None) and not getattr(c, "preferred_segment", "")
            and not getattr(c, "prefer_alloc_in_same_node", False) and getattr(c, "group_ids", None) is None)


def _route(parallelism: Any, writer_partition: Any) -> tuple[str, Any]:
    """Mooncake's ``resolve_parallelism_write_request``: (route, axes or writer (rank, size, dim))."""
    if writer_partition is not None:
        if parallelism is not None or not all(hasattr(writer_partition, f) for f in ("rank", "size", "split_dim")):
            return "invalid", None
        w = (int(writer_partition.rank), int(writer_partition.size), int(writer_partition.split_dim))
        if w[1] <= 0 or not 0 <= w[0] < w[1] or w[2] < 0:
            return "invalid", None
        return "writer", w
    if parallelism is None:
        return "direct", None
    axes = parse_axes(parallelism)
    if axes is None or not valid_axes(axes):
        return "invalid", None
    return ("tp" if tp_of(axes) is not None else "generic"), axes


class ParallelismMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its tensor and byte methods."""

    # ---- writes -----------------------------------------------------------------------------

    def _shard_then_manifest(self, shard: Key, tensor: Any, meta: fmt.Meta, manifest: Key, mbytes: bytes,
                             upsert: bool, config: Any) -> int:
        rc = self._write_tensors([shard], [tensor], upsert, config, [meta])[0]
        if rc != OK:
            return rc
        return self._put([manifest], [mbytes], upsert, config)[0]

    def _par_write(self, key: Key, tensor: Any, parallelism: Any, config: Any, writer: Any, upsert: bool) -> int:
        fmt.torch_module()
        route, spec = _route(parallelism, writer)
        if route == "invalid" or self._c() is None:
            return INVALID_PARAMS
        if route == "direct":
            return self._write_tensors([key], [tensor], upsert, config)[0] if config_ok(config) else INVALID_PARAMS
        if not fmt.is_tensor(tensor) or fmt.dtype_code(tensor) is None:
            return INVALID_PARAMS
        code, shape = fmt.dtype_code(tensor), list(tensor.shape)
        try:
            if route == "writer":
                rank, size, dim = spec
                if not fmt.uniform(shape, dim, size):
                    return INVALID_PARAMS
                chunk = narrow(tensor, dim, rank, size)
                meta = fmt.shard_meta(code, shape, list(chunk.shape), [axis("tp", rank, size, dim)], 0)
                return self._shard_then_manifest(writer_key(key, rank, size, dim), chunk, meta,
                                                 _cat(key, "__writer_manifest"), fmt.pack_manifest(shape, code, dim, size),
                                                 upsert, config)
            tp = tp_of(spec)
            if route == "tp" and len(spec) == 1:
                # The tensor is this rank's shard; the whole one is inferred.
                dim = tp.split_dim
                if not 0 <= dim < len(shape):
                    return INVALID_PARAMS
                whole = list(shape)
                whole[dim] *= tp.size
                meta = fmt.shard_meta(code, shape, shape, spec, 0)
                meta.global_shape = whole
                return self._shard_then_manifest(key_name(key, spec), tensor.contiguous(), meta,
                                                 _cat(key, "__parallelism_manifest"),
                                                 fmt.pack_manifest(whole, code, dim, tp.size), upsert, config)
            if route == "tp":
                # The tensor is whole; this rank's shard of it is stored.
                dim = tp.split_dim
                if not fmt.uniform(shape, dim, tp.size):
                    return INVALID_PARAMS
                chunk = narrow(tensor, dim, tp.rank, tp.size)
                meta = fmt.shard_meta(code, shape, list(chunk.shape), spec, 0)
                return self._shard_then_manifest(key_name(key, spec), chunk, meta, _cat(key, "__parallelism_manifest"),
                                                 fmt.pack_manifest(shape, code, dim, tp.size), upsert, config)
            meta = fmt.shard_meta(code, shape, shape, spec, 0)  # dp/ep/pp only: the tensor as this shard
        except (TypeError, ValueError, RuntimeError, IndexError):
            return INVALID_PARAMS
        if meta is None:
            return INVALID_PARAMS
        return self._write_tensors([key_name(key, spec)], [tensor], upsert, config, [meta])[0]

    def _par_write_from(self, key: Key, ptr: int, size: int, parallelism: Any, config: Any, writer: Any,
                        upsert: bool) -> int:
        route, spec = _route(parallelism, writer)
        if route == "invalid" or self._c() is None:
            return INVALID_PARAMS
        if route == "direct":
            if is_default_config(config):
                return self._tensor_from([key], [ptr], [size], upsert, None, single=True)[0]
            if not config_ok(config):
                return INVALID_PARAMS
            return self._tensor_from([key], [ptr], [size], upsert, config, single=True)[0]
        meta = fmt.parse(fmt.at(int(ptr), int(size)), int(size)) if ptr and size >= META_SIZE else None
        if meta is None:
            return INVALID_PARAMS
        if route == "generic":
            shard = fmt.shard_meta(meta.dtype, meta.global_shape, meta.local_shape, spec, meta.data_bytes)
            if shard is None:
                return INVALID_PARAMS
            data = ctypes.string_at(int(ptr) + meta.data_offset, meta.data_bytes)
            return self._put([key_name(key, spec)], [shard.pack() + data], upsert, config)[0]
        if meta.global_shape != meta.local_shape:
            return INVALID_PARAMS  # Mooncake slices a whole tensor object only
        tensor = fmt.decode(fmt.at(int(ptr), int(size)), int(size))
        if route == "writer":
            return self._par_write(key, tensor, None, config, _Writer(*spec), upsert)
        tp = tp_of(spec)
        shards = tp_shards(tensor, tp.size, tp.split_dim, spec)
        if shards is None:
            return INVALID_PARAMS
        keys = [key_name(key, with_rank(spec, "tp", r)) for r in range(tp.size)]
        codes = self._write_tensors(keys, [c for c, _ in shards], upsert, config_for(config, [0], tp.size),
                                    [m for _, m in shards])
        return next((c for c in codes if c != OK), OK)

    def _par_batch(self, keys: Sequence[Key], values: Sequence[Any], parallelisms: Any, config: Any, writers: Any,
                   one: Any, direct: Any) -> list[int]:
        groups = getattr(config, "group_ids", None) if config is not None else None
        bad = [INVALID_PARAMS] * len(keys)
        if (groups is not None and len(groups) != len(keys)) or (parallelisms is not None and writers is not None):
            return bad
        if len(values) != len(keys):
            return bad
        if parallelisms is None and writers is None:
            return direct()
        requests = parallelisms if parallelisms is not None else writers
        if not isinstance(requests, list) or len(requests) != len(keys):
            return bad
        return [one(i, requests[i] if parallelisms is not None else None,
                    requests[i] if writers is not None else None, config_for(config, [i])) for i in range(len(keys))]

    def put_tensor_with_parallelism(self, key: Key, tensor: Any, parallelism: Any = None, config: Any = None,
                                    writer_partition: Any = None) -> int:
        """Store ``tensor`` whole (no ``parallelism``), as writer partition ``writer_partition``
        (``rank``/``size``/``split_dim``: its shard of the whole tensor, plus the writer
        manifest), or under a ``TensorParallelism``: with a single ``tp`` axis the tensor is that
        rank's shard (the manifest records the whole shape); with ``tp`` and other axes the
        tensor is whole and the ``tp`` rank's shard is stored; without ``tp`` it is stored as the
        shard the axes name. 0 or a code (-600 for a malformed request)."""
        return self._par_write(key, tensor, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism(self, key: Key, tensor: Any, parallelism: Any = None, config: Any = None,
                                       writer_partition: Any = None) -> int:
        return self._par_write(key, tensor, parallelism, config, writer_partition, True)

    def batch_put_tensor_with_parallelism(self, keys: Sequence[Key], tensors_list: Sequence[Any],
                                          parallelisms: Any = None, config: Any = None,
                                          writer_partitions: Any = None) -> list[int]:
        """``put_tensor_with_parallelism`` per key (``parallelisms`` or ``writer_partitions``: a
        list with one entry per key; neither: one batch of whole tensors)."""
        return self._par_batch(keys, tensors_list, parallelisms, config, writer_partitions,
                               lambda i, p, w, c: self._par_write(keys[i], tensors_list[i], p, c, w, False),
                               lambda: self._par_direct(keys, tensors_list, config, False))

    def batch_upsert_tensor_with_parallelism(self, keys: Sequence[Key], tensors_list: Sequence[Any],
                                             parallelisms: Any = None, config: Any = None,
                                             writer_partitions: Any = None) -> list[int]:
        return self._par_batch(keys, tensors_list, parallelisms, config, writer_partitions,
                               lambda i, p, w, c: self._par_write(keys[i], tensors_list[i], p, c, w, True),
                               lambda: self._par_direct(keys, tensors_list, config, True))

    def _par_direct(self, keys: Sequence[Key], tensors: Sequence[Any], config: Any, upsert: bool) -> list[int]:
        fmt.torch_module()
        if self._c() is None or not config_ok(config):
            return [INVALID_PARAMS] * len(keys)
        return self._write_tensors(keys, list(tensors), upsert, config)

    def put_tensor_with_parallelism_from(self, key: Key, buffer_ptr: int, size: int, parallelism: Any = None,
                                         config: Any = None, writer_partition: Any = None) -> int:
        """``put_tensor_with_parallelism`` of a whole tensor object in registered memory; with a
        ``tp`` axis every rank's shard is stored (no manifest), as Mooncake's ``_from`` form."""
        return self._par_write_from(key, buffer_ptr, size, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism_from(self, key: Key, buffer_ptr: int, size: int, parallelism: Any = None,
                                            config: Any = None, writer_partition: Any = None) -> int:
        return self._par_write_from(key, buffer_ptr, size, parallelism, config, writer_partition, True)

    def batch_put_tensor_with_parallelism_from(self, keys: Sequence[Key], buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int], parallelisms: Any = None, config: Any = None,
                                               writer_partitions: Any = None) -> list[int]:
        return self._par_batch(keys, buffer_ptrs, parallelisms, config, writer_partitions,
                               lambda i, p, w, c: self._par_write_from(keys[i], buffer_ptrs[i], sizes[i], p, c, w, False),
                               lambda: self._par_direct_from(keys, buffer_ptrs, sizes, config, False))

    def batch_upsert_tensor_with_parallelism_from(self, keys: Sequence[Key], buffer_ptrs: Sequence[int],
                                                  sizes: Sequence[int], parallelisms: Any = None, config: Any = None,
                                                  writer_partitions: Any = None) -> list[int]:
        return self._par_batch(keys, buffer_ptrs, parallelisms, config, writer_partitions,
                               lambda i, p, w, c: self._par_write_from(keys[i], buffer_ptrs[i], sizes[i], p, c, w, True),
                               lambda: self._par_direct_from(keys, buffer_ptrs, sizes, config, True))

    def _par_direct_from(self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int], config: Any,
                         upsert: bool) -> list[int]:
        if is_default_config(config):
            return self._tensor_from(keys, ptrs, sizes, upsert, None)
        if self._c() is None or not config_ok(config):
            return [INVALID_PARAMS] * len(keys)
        return self._tensor_from(keys, ptrs, sizes, upsert, config)

    # ---- reads ------------------------------------------------------------------------------

    def _get_meta(self, key: Key) -> tuple[Optional[fmt.Meta], Optional[bytearray]]:
        v = self.get_batch([key])[0]
        if not v:
            return None, None
        data = bytearray(v)
        return fmt.parse(data, len(data)), data

    def _writer_full(self, key: Key) -> Any:
        """A tensor written as writer partitions, whole again; None when ``key`` has none."""
        man = fmt.parse_manifest(self.get_batch([_cat(key, "__writer_manifest")])[0] or None)
        if man is None:
            return None
        keys = [writer_key(key, r, man.shard_count, man.split_dim) for r in range(man.shard_count)]
        parts = []
        for r, v in enumerate(self.get_batch(keys)):
            data = bytearray(v)
            meta = fmt.parse(data, len(data)) if v else None
            tp = meta.axis(fmt.TP) if meta is not None else None
            if meta is None or len(meta.axes) != 1 or tp is None or (tp.rank, tp.count, tp.split_dim) != (
                    r, man.shard_count, man.split_dim):
                return None
            parts.append(fmt.decode(data, len(data)))
        return fmt.torch_module().cat(parts, dim=man.split_dim) if parts else None

    def _tp_sources(self, key: Key, axes: list[ParallelAxis]) -> Optional[tuple[list[Any], int]]:
        """The shards a whole ``tp``-split tensor is made of, in rank order, and the split dim
        (Mooncake's ``load_parallelism_full_reconstruction_sources``), or None."""
        want = tp_of(axes)
        man = fmt.parse_manifest(self.get_batch([_cat(key, "__parallelism_manifest")])[0] or None)
        routes = []
        if man is not None and (want.split_dim in (None, man.split_dim)) and fmt.uniform(
                man.global_shape, man.split_dim, want.size) and fmt.uniform(man.global_shape, man.split_dim,
                                                                            man.shard_count):
            routes.append([key_name(key, with_rank(canonical(axes), "tp", r, man.shard_count))
                           for r in range(man.shard_count)])
        if single_tp(axes):
            first, _ = self._get_meta(key if want.size <= 1 else tp_key(key, 0))
            tp0 = first.axis(fmt.TP) if first is not None and first.layout == fmt.SHARD else None
            if tp0 is not None:
                routes.append([tp_key(key, r) if tp0.count > 1 else key for r in range(tp0.count)])
        else:
            routes.append([key_name(key, with_rank(canonical(axes), "tp", r)) for r in range(want.size)])
        for keys in routes:
            parts, dim, ok = [], None, True
            for r, v in enumerate(self.get_batch(keys)):
                data = bytearray(v)
                meta = fmt.parse(data, len(data)) if v else None
                tp = meta.axis(fmt.TP) if meta is not None and meta.layout == fmt.SHARD else None
                if tp is None or tp.rank != r or tp.count != len(keys) or (dim is not None and tp.split_dim != dim):
                    ok = False
                    break
                others = [a for a in (stored_axes(meta) or []) if a.kind != "tp"]
                if [(a.kind, a.rank, a.size) for a in others] != [(a.kind, a.rank, a.size) for a in canonical(axes)
                                                                   if a.kind != "tp"]:
                    ok = False
                    break
                dim = tp.split_dim
                parts.append(fmt.decode(data, len(data)))
            if ok and parts and dim is not None and want.split_dim in (None, dim):
                return parts, dim
        return None

    def _par_read(self, key: Key, target: Any) -> Optional[tuple[Any, Any]]:
        """(stored key to read as is, or None; else the materialized tensor and its metadata)."""
        fmt.torch_module()
        if target is not None and not (hasattr(target, "mode") and hasattr(target, "parallelism")):
            return None
        mode = "as_stored" if target is None else str(target.mode).lower()
        if mode not in ("as_stored", "shard", "full"):
            return None
        raw = None if target is None else target.parallelism
        axes = parse_axes(raw) if raw is not None else None
        if raw is not None and axes is None:
            return None
        if mode == "as_stored" and axes is None:
            return key, None
        if mode == "full" and axes is None:
            t = self._writer_full(key)
            return (key, None) if t is None else (None, (t, None))
        if axes is None or not valid_axes(axes):
            return None
        tp = tp_of(axes)
        if mode == "shard":
            for read in [key_name(key, axes)] + ([writer_key(key, tp.rank, tp.size, tp.split_dim or 0)]
                                                 if single_tp(axes) else []):
                meta, _ = self._get_meta(read)
                if meta is not None and matches(axes, meta):
                    return read, None
            if tp is not None:
                src = self._tp_sources(key, axes)
                if src is not None:
                    whole = fmt.torch_module().cat(src[0], dim=src[1])
                    if fmt.uniform(list(whole.shape), src[1], tp.size):
                        shard = narrow(whole, src[1], tp.rank, tp.size)
                        meta = fmt.shard_meta(fmt.dtype_code(shard), list(whole.shape), list(shard.shape), axes, 0)
                        return None, (shard, meta)
            if single_tp(axes):
                return tp_key(key, tp.rank), None
            return None
        if mode == "full" and tp is not None:
            src = self._tp_sources(key, axes)
            return None if src is None else (None, (fmt.torch_module().cat(src[0], dim=src[1]), None))
        return None

    def get_tensor_with_parallelism(self, key: Key, target: Any = None) -> Any:
        """Read per a ``ReadTarget``: ``as_stored`` (no parallelism) the object under ``key``;
        ``shard`` the shard its ``parallelism`` names (stored under that name, or a writer
        partition of the same split, or cut from the whole tensor the stored shards make);
        ``full`` the whole tensor (from writer partitions without ``parallelism``, from the ``tp``
        shards with it). None when there is nothing to read or the request is malformed."""
        got = self._par_read(key, target)
        if got is None:
            return None
        read, made = got
        return self.get_tensor(read) if read is not None else made[0]

    def batch_get_tensor_with_parallelism(self, keys: Sequence[Key], targets: Any = None) -> list[Any]:
        if targets is None:
            return self.batch_get_tensor(keys)
        if not isinstance(targets, list) or len(targets) != len(keys):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key: Key, buffer_ptr: int, size: int, target: Any = None) -> Any:
        """``get_tensor_with_parallelism`` into registered memory: the tensor object (header and
        data) is written at ``buffer_ptr`` and a tensor over it returned; None when it does not
        fit in ``size`` bytes or the memory is not registered (Mooncake needs store-managed
        memory too)."""
        c = self._c()
        if c is None or not buffer_ptr:
            return None
        try:
            regions = [(int(a), int(n)) for a, n, *_ in c.registered()]
        except KvpoolError:
            return None
        if not any(a <= buffer_ptr and buffer_ptr + size <= a + n for a, n in regions):
            log.error("get_tensor_with_parallelism_into: %#x is not inside a registered buffer", buffer_ptr)
            return None
        got = self._par_read(key, target)
        if got is None:
            return None
        read, made = got
        if read is not None:
            return self.get_tensor_into(read, buffer_ptr, size)
        tensor, meta = made
        meta = meta or fmt.full_meta(tensor)
        if meta is None:
            return None
        data = fmt.host_bytes(tensor)
        meta.data_bytes = int(data.nbytes)
        total = META_SIZE + meta.data_bytes
        if total > size:
            return None
        ctypes.memmove(int(buffer_ptr), meta.pack(), META_SIZE)
        if meta.data_bytes:
            ctypes.memmove(int(buffer_ptr) + META_SIZE, data.ctypes.data, meta.data_bytes)
        return fmt.decode(fmt.at(int(buffer_ptr), total), total)

    def batch_get_tensor_with_parallelism_into(self, keys: Sequence[Key], buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int], targets: Any = None) -> list[Any]:
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [None] * len(keys)
        if targets is not None and (not isinstance(targets, list) or len(targets) != len(keys)):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, s, None if targets is None else targets[i])
                for i, (k, p, s) in enumerate(zip(keys, buffer_ptrs, sizes))]


class _Writer:
    def __init__(self, rank: int, size: int, split_dim: int) -> None:
        self.rank, self.size, self.split_dim = rank, size, split_dim
