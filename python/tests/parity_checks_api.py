"""Parity checks of the methods beyond bytes in and out: replicas, buffers, ranges, sessions,
group ids, tasks, segments, the module's value types (see ``test_mooncake_parity.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from parity_registry import DELIBERATE, Key, _Buffer, _replicate_config, check, impl

#: Every method of Mooncake's ``MooncakeDistributedStore`` (0.3.13.post1 and main, Aug 2026).
MOONCAKE_METHODS = """
_get_pyclient_capsule alloc_from_mem_pool allocate_and_mount_segment batch_get_buffer batch_get_into
batch_get_into_multi_buffer_ranges batch_get_into_multi_buffers batch_get_replica_desc batch_get_session_end
batch_get_session_start batch_get_tensor batch_get_tensor_into batch_get_tensor_into_cuda
batch_get_tensor_with_parallelism batch_get_tensor_with_parallelism_into batch_get_tensor_with_tp
batch_get_tensor_with_tp_into batch_is_exist batch_pub_tensor batch_pub_tensor_with_tp batch_put_from
batch_put_from_multi_buffer_ranges batch_put_from_multi_buffers batch_put_session_end batch_put_session_revoke
batch_put_session_start batch_put_tensor batch_put_tensor_from batch_put_tensor_with_parallelism
batch_put_tensor_with_parallelism_from batch_put_tensor_with_tp batch_put_tensor_with_tp_from batch_remove
batch_replica_clear batch_upsert_from batch_upsert_pub_tensor batch_upsert_tensor batch_upsert_tensor_from
batch_upsert_tensor_with_parallelism batch_upsert_tensor_with_parallelism_from close create_copy_task
create_move_task get get_batch get_buffer get_hostname get_into get_into_ranges get_offload_rpc_read_count
get_replica_desc get_size get_tensor get_tensor_into get_tensor_into_cuda get_tensor_with_parallelism
get_tensor_with_parallelism_into get_tensor_with_tp get_tensor_with_tp_into health_check init_all is_exist
load_tensor_from_safetensor mount_segment pub_tensor pub_tensor_with_tp put put_batch put_from
put_from_with_metadata put_parts put_tensor put_tensor_from put_tensor_with_parallelism
put_tensor_with_parallelism_from put_tensor_with_tp put_tensor_with_tp_from query_task register_buffer remove
remove_all remove_by_regex save_tensor_to_safetensor setup setup_dummy unmount_and_free_segment
unmount_local_disk_segment unmount_segment unregister_buffer upsert upsert_batch upsert_from upsert_parts
upsert_pub_tensor upsert_tensor upsert_tensor_from upsert_tensor_with_parallelism
upsert_tensor_with_parallelism_from
""".split()

#: The module-level names of ``mooncake.store`` that consumers import.
MODULE_NAMES = """
MooncakeDistributedStore ReplicateConfig ReplicaDescriptor MemoryDescriptor DiskDescriptor Descriptor BufferHandle
MooncakeHostMemAllocator ObjectDataType SoftPinAction ReplicaStatus TaskType TaskStatus QueryTaskResponse
ParallelAxis TensorParallelism ReadTarget bind_to_numa_node get_alloc_func_addr get_free_func_addr
_serialize_tensor _deserialize_tensor _tensor_metadata_size UNKNOWN KVCACHE TENSOR COMPLETE PENDING PROCESSING
SUCCESS FAILED REPLICA_COPY REPLICA_MOVE
""".split()

DELIBERATE.update({
    "put_from_with_metadata_of_no_data": "a put_from_with_metadata of 0 data bytes answers -600 and stores "
    "nothing, as put_from of 0 bytes; Mooncake answers 0 and stores nothing",
    "allocate_and_mount_segment": "a kvpool client lends no memory to the pool: mounting answers -1012 "
    "(NOT_SUPPORTED); Mooncake mounts a segment of the client's memory",
    "pyclient_capsule": "there is no C++ PyClient behind kvpool's store: _get_pyclient_capsule answers None, "
    "as Mooncake before setup",
    "copy_task_of_a_stored_key": "kvpool keeps one copy of a block in one pool: create_copy_task answers -1012 "
    "(NOT_SUPPORTED); Mooncake queues a copy to another segment",
})


@check
def every_method_and_module_name(s: Any, k: Key) -> Any:
    mod = impl(s)
    return [n for n in MOONCAKE_METHODS if not callable(getattr(s, n, None))], \
        [n for n in MODULE_NAMES if not hasattr(mod, n)]


@check
def value_types_and_enums(s: Any, k: Key) -> Any:
    mod = impl(s)
    c = mod.ReplicateConfig()
    fields = (c.replica_num, c.nof_replica_num, c.dfs_replica_num, int(c.soft_pin_action), c.soft_pin_ttl_ms,
              c.with_hard_pin, list(c.preferred_segments), list(c.preferred_nof_segments), c.preferred_segment,
              c.prefer_alloc_in_same_node, int(c.data_type), c.group_ids)
    c.soft_pin_action = mod.SoftPinAction.ENABLE
    c.soft_pin_ttl_ms = 1000
    enums = {e: {n: int(v) for n, v in getattr(mod, e).__members__.items()}
             for e in ("ObjectDataType", "SoftPinAction", "ReplicaStatus", "TaskType", "TaskStatus")}
    a, t, r = mod.ParallelAxis(), mod.TensorParallelism(), mod.ReadTarget()
    axis = (a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id)
    modes = [r.mode]
    for m in ("FULL", "shard", "bad"):
        try:
            r.mode = m
            modes.append(r.mode)
        except RuntimeError as e:
            modes.append(("raised", type(e).__name__))
    return fields, str(c), enums, axis, list(t.axes), modes, r.parallelism, int(mod.PROCESSING), int(mod.COMPLETE)


@check
def replica_desc(s: Any, k: Key) -> Any:
    s.put(k("a"), b"hello")
    descs = s.get_replica_desc(k("a"))
    seen = [(int(d.status), d.is_memory_replica(), d.is_disk_replica(), d.is_local_disk_replica(),
             d.get_memory_descriptor().buffer_descriptor.size) for d in descs]
    try:
        descs[0].get_disk_descriptor()
        disk: Any = "no error"
    except RuntimeError as e:
        disk = type(e).__name__
    batch = s.batch_get_replica_desc([k("a"), k("missing")])
    return seen, disk, s.get_replica_desc(k("missing")), sorted(batch), [len(v) for v in batch.values()], \
        s.remove(k("a"))


@check
def get_buffer_and_batch(s: Any, k: Key) -> Any:
    s.put_batch([k("a"), k("b")], [b"world!", b"x" * 5000])
    h = s.get_buffer(k("a"))
    view = memoryview(h)
    seen = (type(h).__name__, h.size(), len(h), bytes(view), view.ndim, view.itemsize, h.ptr() != 0,
            str(np.array(h, copy=False).dtype))
    got = s.batch_get_buffer([k("b"), k("missing"), k("a")])
    return seen, s.get_buffer(k("missing")), [None if x is None else bytes(x) == v for x, v in
                                              zip(got, [b"x" * 5000, None, b"world!"])], s.remove(k("a"))


@check
def put_from_with_metadata(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        rc = s.put_from_with_metadata(k("m"), b.addr + 100, b.addr, 50, 10)
        same = s.get(k("m")) == bytes(b.a[:10]) + bytes(b.a[100:150])
        again = s.put_from_with_metadata(k("m"), b.addr, b.addr, 20, 20)
        no_meta = s.put_from_with_metadata(k("n"), b.addr + 7, b.addr, 30, 0)
        return rc, same, s.get_size(k("m")), again, s.get_size(k("m")), no_meta, s.get(k("n")) == bytes(b.a[7:37])


@check
def put_from_with_metadata_of_no_data(s: Any, k: Key) -> Any:
    with _Buffer(s, 1 << 16) as b:
        return s.put_from_with_metadata(k("z"), b.addr, b.addr, 0, 10), s.is_exist(k("z"))


@check
def get_into_ranges(s: Any, k: Key) -> Any:
    s.put(k("r"), bytes(range(200)))
    with _Buffer(s, 1 << 16, fill=False) as d:
        got = s.get_into_ranges([d.addr, d.addr + 4096], [[k("r"), k("missing")], [k("r")]],
                                [[[0, 10], [100]], [[0, 30]]], [[[5, 50], [0]], [[150, 150]]], [[[3, 4], [5]], [[20, 5]]])
        data = bytes(d.a[:14]), bytes(d.a[4096:4126])
        bad = (s.get_into_ranges([d.addr], [[k("r")]], [[[0]]], [[[199]]], [[[5]]]),
               s.get_into_ranges([d.addr], [[k("r")]], [[[0, 1]]], [[[0]]], [[[5]]]),
               s.get_into_ranges([], [], [], [], []))
        return got, data, bad


@check
def get_session_ranges(s: Any, k: Key) -> Any:
    s.put(k("r"), bytes(range(200)))
    with _Buffer(s, 1 << 16, fill=False) as d:
        start = s.batch_get_session_start([k("r"), k("missing"), k("r")])
        got = s.batch_get_into_multi_buffer_ranges([k("r"), k("missing"), k("none")],
                                                   [[d.addr, d.addr + 100], [d.addr], [d.addr]],
                                                   [[10, 5], [1], [1]], [[0, 190], [0], [0]])
        data = bytes(d.a[:10]), bytes(d.a[100:105])
        odd = (s.batch_get_into_multi_buffer_ranges([k("r")], [[d.addr]], [[10]], [[195]]),
               s.batch_get_into_multi_buffer_ranges([k("r")], [[d.addr]], [[10, 1]], [[0]]),
               s.batch_get_into_multi_buffer_ranges([k("r")], [[d.addr]], [[0]], [[0]]),
               s.batch_get_into_multi_buffer_ranges([k("r")], [[]], [[]], [[]]),
               s.batch_get_session_start([]))
        during = s.remove(k("r"))
        end = s.batch_get_session_end([k("r"), k("missing")])
        after = s.batch_get_into_multi_buffer_ranges([k("r")], [[d.addr]], [[10]], [[0]])
        return start, got, data, odd, during, end, after


@check
def put_session_ranges(s: Any, k: Key) -> Any:
    s.put(k("stored"), b"x" * 10)
    with _Buffer(s, 1 << 16) as b:
        start = s.batch_put_session_start([k("p1"), k("p2"), k("stored")], [100, 50, 10])
        again = s.batch_put_session_start([k("p1"), k("p0")], [100, 0])
        during = s.is_exist(k("p1")), s.get(k("p1"))
        put = s.batch_put_from_multi_buffer_ranges([k("p1"), k("p2"), k("none")], [[b.addr, b.addr + 1000], [b.addr],
                                                   [b.addr]], [[60, 40], [50], [1]], [[0, 60], [0], [0]])
        over = s.batch_put_from_multi_buffer_ranges([k("p2")], [[b.addr]], [[10]], [[45]])
        end = s.batch_put_session_end([k("p1"), k("none")])
        value = s.get(k("p1")) == bytes(b.a[:60]) + bytes(b.a[1000:1040])
        revoke = s.batch_put_session_revoke([k("p2"), k("p1")]), s.is_exist(k("p2"))
        partial = (s.batch_put_session_start([k("p3")], [100]),
                   s.batch_put_from_multi_buffer_ranges([k("p3")], [[b.addr]], [[10]], [[0]]),
                   s.batch_put_session_end([k("p3")]), s.get_size(k("p3")))
        after = s.batch_put_from_multi_buffer_ranges([k("p1")], [[b.addr]], [[10]], [[0]])
        return start, again, during, put, over, end, value, revoke, partial, after


@check
def group_ids(s: Any, k: Key) -> Any:
    two, one = _replicate_config(s), _replicate_config(s)
    two.group_ids = ["g", ""]
    one.group_ids = ["g"]
    out = [s.put_batch([k("a"), k("b")], [b"a", b"b"], two), s.put_batch([k("c"), k("d")], [b"c", b"d"], one),
           s.put(k("e"), b"e", two), s.put(k("f"), b"f", one), s.upsert_batch([k("g"), k("h")], [b"g", b"h"], one),
           s.batch_is_exist([k(x) for x in "abcdefgh"])]
    with _Buffer(s, 1 << 16) as b:
        out += [s.batch_put_from([k("i"), k("j")], [b.addr, b.addr], [10, 10], one),
                s.batch_put_from_multi_buffers([k("l"), k("m")], [[b.addr], [b.addr]], [[10], [10]], one),
                s.batch_put_from([k("n"), k("o")], [b.addr, b.addr], [10, 10], two),
                s.batch_put_session_start([k("p"), k("q")], [10, 10], one)]
    return out


@check
def soft_pin_action(s: Any, k: Key) -> Any:
    c = _replicate_config(s)
    c.soft_pin_action = impl(s).SoftPinAction.ENABLE
    return s.put(k("sp"), b"pinned", c), s.get(k("sp"))


@check
def replica_clear(s: Any, k: Key) -> Any:
    s.put_batch([k("a"), k("b"), k("c")], [b"1", b"2", b"3"])
    s.get(k("c"))
    return sorted(s.batch_replica_clear([k("a"), k("missing"), k("c")], "")), \
        s.batch_replica_clear([k("b")], "other-segment:1"), s.batch_is_exist([k("a"), k("b"), k("c")])


@check
def tasks(s: Any, k: Key) -> Any:
    return s.create_copy_task(k("missing"), ["seg"]), s.query_task((1, 2))


@check
def copy_task_of_a_stored_key(s: Any, k: Key) -> Any:
    s.put(k("a"), b"x")
    return s.create_copy_task(k("a"), [s.get_hostname()])[1]


@check
def segments(s: Any, k: Key) -> Any:
    return (s.unmount_segment(["no-such-segment"]), s.unmount_and_free_segment(["no-such-segment"]),
            s.unmount_local_disk_segment(), s.get_offload_rpc_read_count(), s.alloc_from_mem_pool(1 << 20),
            s.init_all("tcp", "", 16 << 20))


@check
def allocate_and_mount_segment(s: Any, k: Key) -> Any:
    r = s.allocate_and_mount_segment(16 << 20)
    if r["ret"] == 0:
        s.unmount_and_free_segment(list(r["segment_ids"]))
    return r["ret"], r["allocated_size"] > 0


@check
def pyclient_capsule(s: Any, k: Key) -> Any:
    return type(s._get_pyclient_capsule()).__name__


@check
def host_allocator_and_process_calls(s: Any, k: Key) -> Any:
    mod = impl(s)
    a = mod.MooncakeHostMemAllocator()
    p = a.alloc(1 << 20)
    out = [p != 0, a.free(p), a.free(p), mod.bind_to_numa_node(0), mod.get_alloc_func_addr() != 0,
           mod.get_free_func_addr() != 0]
    return out
