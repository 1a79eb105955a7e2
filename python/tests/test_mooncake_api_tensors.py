"""kvpool's Mooncake tensor methods (kvpool only; ``test_mooncake_parity.py`` compares them with
real Mooncake byte for byte). Needs torch: skipped without it (CI's plain interpreter)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool.mooncake import (  # noqa: E402
    FILE_NOT_FOUND,
    INVALID_PARAMS,
    MooncakeDistributedStore,
    ParallelAxis,
    ReadTarget,
    ReplicateConfig,
    TensorParallelism,
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)




def _axis(kind: str, rank: int, size: int, split_dim: Any = None, expert_id: Any = None, stage_id: Any = None) -> Any:
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id = kind, rank, size, split_dim, expert_id, stage_id
    return a


def _par(*axes: Any) -> TensorParallelism:
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def _target(mode: str, parallelism: Any = None) -> ReadTarget:
    t = ReadTarget()
    t.mode = mode
    t.parallelism = parallelism
    return t


class _Writer:
    def __init__(self, rank: int, size: int, split_dim: int) -> None:
        self.rank, self.size, self.split_dim = rank, size, split_dim


GRID = torch.arange(48, dtype=torch.float32).reshape(4, 12)


def _header(b: bytes) -> tuple[Any, ...]:
    """The fields of Mooncake's tensor header: magic, version, size, dtype, ndim, layout, offset,
    data bytes, global shape, local shape, axis count, first axis."""
    magic, version, size, dtype, ndim, layout, _, off, nbytes = struct.unpack_from("<IHHiiIIQQ", b)
    g = struct.unpack_from("<8q", b, 40)[:ndim]
    loc = struct.unpack_from("<8q", b, 104)[:ndim]
    count = struct.unpack_from("<I", b, 168)[0]
    return magic, version, size, dtype, ndim, layout, off, nbytes, g, loc, count, struct.unpack_from("<iiiiiiq", b, 176)


def test_whole_tensors_every_dtype_and_form(store: MooncakeDistributedStore) -> None:
    for i, dtype in enumerate([torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.uint16,
                               torch.int32, torch.uint32, torch.int64, torch.uint64, torch.bool, torch.float16,
                               torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]):
        t = (torch.arange(6) % 2).to(dtype).reshape(2, 3)
        assert store.put_tensor(f"wt/{i}", t) == 0
        back = store.get_tensor(f"wt/{i}")
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
        assert _header(store.get(f"wt/{i}"))[:9] == (0x4D4F4F4E, 1, 304, i, 2, 0, 304, 6 * t.element_size(),
                                                      (2, 3))
    assert store.upsert_tensor("wt/0", GRID) == 0 and torch.equal(store.get_tensor("wt/0"), GRID)
    assert store.batch_upsert_tensor(["wt/1", "wt/new"], [GRID, GRID * 2]) == [0, 0]
    pin = ReplicateConfig()
    pin.with_hard_pin = True
    assert store.pub_tensor("wt/pub", GRID, pin) == 0 and store.batch_pub_tensor(["wt/pub2"], [GRID], pin) == [0]
    assert store.upsert_pub_tensor("wt/pub", GRID + 1, pin) == 0 and store.get_tensor("wt/pub")[0, 0] == 1
    bad = ReplicateConfig()
    bad.preferred_segments = ["a", "b"]  # not one per replica
    assert store.pub_tensor("wt/bad", GRID, bad) == INVALID_PARAMS and store.is_exist("wt/bad") == 0
    assert store.batch_upsert_pub_tensor(["wt/bad"], [GRID], bad) == [INVALID_PARAMS]


def test_tensor_objects_from_and_into_registered_memory(store: MooncakeDistributedStore) -> None:
    buf = store.alloc_buffer(1 << 16)
    assert store.register_buffer(buf.address, buf.size) == 0
    a = buf.address
    assert store.put_tensor("to/src", GRID) == 0
    t = store.get_tensor_into("to/src", a, 4096)
    assert torch.equal(t, GRID) and t.data_ptr() == a + 304
    n = 304 + GRID.numel() * 4
    assert store.put_tensor_from("to/copy", a, n) == 0 and torch.equal(store.get_tensor("to/copy"), GRID)
    assert store.put_tensor_from("to/bad", a + 1, n) == INVALID_PARAMS and store.put_tensor_from("to/bad", a, 100) == \
        INVALID_PARAMS
    assert store.batch_put_tensor_from(["to/c1", "to/c2"], [a, a], [n, n]) == [0, 0]
    assert store.batch_put_tensor_from(["to/c3", "to/c4"], [a, a + 1], [n, n]) == [INVALID_PARAMS] * 2
    t[0, 0] = 99  # the tensor is a view of the buffer: the object there changes with it
    assert store.upsert_tensor_from("to/copy", a, n) == 0 and store.get_tensor("to/copy")[0, 0] == 99
    assert store.batch_upsert_tensor_from(["to/c1"], [a], [n]) == [0]
    got = store.batch_get_tensor_into(["to/c2", "to/missing"], [a + 8192, a + 12288], [4096, 4096])
    assert torch.equal(got[0], GRID) and got[1] is None
    assert store.unregister_buffer(a) == 0


def test_tensor_parallel_shards(store: MooncakeDistributedStore) -> None:
    assert store.put_tensor_with_tp("tp/w", GRID, tp_rank=1, tp_size=3, split_dim=1) == 0
    assert store.batch_is_exist(["tp/w_tp_0", "tp/w_tp_1", "tp/w_tp_2", "tp/w"]) == [1, 1, 1, 0]
    for r in range(3):
        assert torch.equal(store.get_tensor_with_tp("tp/w", r, 3, 1), GRID[:, 4 * r:4 * r + 4])
    h = _header(store.get("tp/w_tp_2"))
    assert h[5:] == (1, 304, 64, (4, 12), (4, 4), 1, (1, 0, 2, 3, 1, 0, 4))  # a shard: tp axis rank 2 of 3, dim 1
    assert store.put_tensor_with_tp("tp/u", GRID, tp_size=5, split_dim=1) == INVALID_PARAMS  # uneven
    assert store.put_tensor_with_tp("tp/u", GRID, tp_size=2, split_dim=2) == INVALID_PARAMS
    assert store.put_tensor_with_tp("tp/one", GRID) == 0 and torch.equal(store.get_tensor_with_tp("tp/one"), GRID)
    assert store.batch_put_tensor_with_tp(["tp/b1", "tp/b2", "tp/b3"], [GRID, GRID[:3], b"x"], tp_size=2) == \
        [0, INVALID_PARAMS, INVALID_PARAMS]
    got = store.batch_get_tensor_with_tp(["tp/b1", "tp/missing"], tp_rank=1, tp_size=2)
    assert torch.equal(got[0], GRID[2:]) and got[1] is None
    cfg = ReplicateConfig()
    assert store.pub_tensor_with_tp("tp/p", GRID, cfg, 0, 4, 0) == 0 and store.is_exist("tp/p_tp_3") == 1
    assert store.batch_pub_tensor_with_tp(["tp/p2"], [GRID], cfg, 0, 2, 1) == [0]
    buf = store.alloc_buffer(1 << 16)
    a = buf.address
    assert store.register_buffer(a, buf.size) == 0
    assert torch.equal(store.get_tensor_with_tp_into("tp/b1", a, 4096, 0, 2), GRID[:2])
    got = store.batch_get_tensor_with_tp_into(["tp/b1", "tp/b1"], [a, a + 4096], [4096, 4096], tp_rank=1, tp_size=2)
    assert torch.equal(got[0], GRID[2:]) and torch.equal(got[1], GRID[2:])
    assert store.put_tensor("tp/src", GRID) == 0 and store.get_tensor_into("tp/src", a, 4096) is not None
    n = 304 + 48 * 4
    assert store.put_tensor_with_tp_from("tp/f", a, n, 0, 2, 1) == 0
    assert torch.equal(store.get_tensor_with_tp("tp/f", 1, 2), GRID[:, 6:])
    assert store.batch_put_tensor_with_tp_from(["tp/f2", "tp/f3"], [a, a + 1], [n, n], 0, 2, 0) == [0, INVALID_PARAMS]
    assert store.unregister_buffer(a) == 0


def test_parallel_io_writes_and_reads(store: MooncakeDistributedStore) -> None:
    for r in range(2):  # a single tp axis: each rank writes its own shard
        assert store.put_tensor_with_parallelism("pi/tp", GRID[:, 6 * r:6 * r + 6], _par(_axis("tp", r, 2, 1))) == 0
    man = store.get("pi/tp__parallelism_manifest")
    assert len(man) == 96 and struct.unpack_from("<IHHiiiii", man) == (0x574D414E, 1, 96, 0, 2, 1, 2, 0)
    assert struct.unpack_from("<2q", man, 32) == (4, 12)
    full = store.get_tensor_with_parallelism("pi/tp", _target("full", _par(_axis("tp", 0, 2, 1))))
    assert torch.equal(full, GRID)
    assert torch.equal(store.get_tensor_with_parallelism("pi/tp", _target("shard", _par(_axis("tp", 1, 2, 1)))),
                       GRID[:, 6:])
    assert torch.equal(store.get_tensor_with_parallelism("pi/tp", _target("shard", _par(_axis("tp", 1, 4, 1)))),
                       GRID[:, 3:6])  # resharded from the stored tp=2
    for r in range(2):  # writer partitions of a whole tensor
        assert store.put_tensor_with_parallelism("pi/wp", GRID, writer_partition=_Writer(r, 2, 0)) == 0
    assert store.batch_is_exist(["pi/wp__writer_0of2_sd0", "pi/wp__writer_1of2_sd0", "pi/wp__writer_manifest"]) == \
        [1, 1, 1]
    assert torch.equal(store.get_tensor_with_parallelism("pi/wp", _target("full")), GRID)
    assert torch.equal(store.get_tensor_with_parallelism("pi/wp", _target("shard", _par(_axis("tp", 0, 2, 0)))),
                       GRID[:2])
    # tp with another axis: the tensor is whole, the tp rank's shard is stored under the canonical name.
    assert store.put_tensor_with_parallelism("pi/mx", GRID, _par(_axis("tp", 1, 3, 1), _axis("dp", 0, 2))) == 0
    assert torch.equal(store.get_tensor("pi/mx__dp_0of2__tp_1of3_sd1"), GRID[:, 4:8])
    # No tp axis: the tensor is that shard.
    assert store.put_tensor_with_parallelism("pi/g", GRID, _par(_axis("pp", 1, 4, stage_id=2),
                                                                _axis("ep", 0, 2, expert_id=5))) == 0
    got = store.get_tensor_with_parallelism("pi/g", _target("shard", _par(_axis("ep", 0, 2, expert_id=5),
                                                                          _axis("pp", 1, 4, stage_id=2))))
    assert torch.equal(got, GRID) and store.is_exist("pi/g__ep_0of2_eid5__pp_1of4_sid2") == 1
    assert store.put_tensor_with_parallelism("pi/whole", GRID) == 0
    assert torch.equal(store.get_tensor_with_parallelism("pi/whole"), GRID)
    assert store.get_tensor_with_parallelism("pi/missing", _target("full", _par(_axis("tp", 0, 2, 1)))) is None
    for bad in (_par(), _par(_axis("tp", 0, 2)), _par(_axis("dp", 0, 2, 1)), _par(_axis("ep", 0, 2)),
                _par(_axis("tp", 2, 2, 0)), _par(_axis("xx", 0, 1))):
        assert store.put_tensor_with_parallelism("pi/bad", GRID, bad) == INVALID_PARAMS
    assert store.put_tensor_with_parallelism("pi/bad", GRID, _par(_axis("tp", 0, 2, 0)), None,
                                             _Writer(0, 2, 0)) == INVALID_PARAMS
    assert store.is_exist("pi/bad") == 0
    assert store.upsert_tensor_with_parallelism("pi/whole", GRID + 1) == 0
    assert store.get_tensor("pi/whole")[0, 0] == 1
    targets = [None, _target("full", _par(_axis("tp", 0, 2, 1)))]
    got = store.batch_get_tensor_with_parallelism(["pi/whole", "pi/tp"], targets)
    assert torch.equal(got[1], GRID) and store.batch_get_tensor_with_parallelism(["pi/tp"], (None,)) == [None]


def test_parallel_io_into_and_from_registered_memory(store: MooncakeDistributedStore) -> None:
    for r in range(2):
        assert store.put_tensor_with_parallelism("px/tp", GRID[:, 6 * r:6 * r + 6], _par(_axis("tp", r, 2, 1))) == 0
    buf = store.alloc_buffer(1 << 16)
    a = buf.address
    assert store.register_buffer(a, buf.size) == 0
    full = store.get_tensor_with_parallelism_into("px/tp", a, 4096, _target("full", _par(_axis("tp", 0, 2, 1))))
    assert torch.equal(full, GRID) and full.data_ptr() == a + 304
    assert _header(bytes(np.frombuffer(buf, np.uint8)[:304]))[5] == 0  # whole again: a full object
    assert store.get_tensor_with_parallelism_into("px/tp", a, 100, _target("full", _par(_axis("tp", 0, 2, 1)))) is None
    plain = np.zeros(4096, np.uint8)
    assert store.get_tensor_with_parallelism_into("px/tp", plain.ctypes.data, 4096) is None  # not registered
    got = store.batch_get_tensor_with_parallelism_into(["px/tp", "px/tp"], [a, a + 4096], [4096, 4096],
                                                       [_target("shard", _par(_axis("tp", 1, 2, 1))), None])
    assert torch.equal(got[0], GRID[:, 6:]) and got[1] is None
    assert store.put_tensor("px/src", GRID) == 0 and store.get_tensor_into("px/src", a, 4096) is not None
    n = 304 + 48 * 4
    assert store.put_tensor_with_parallelism_from("px/d", a, n) == 0 and torch.equal(store.get_tensor("px/d"), GRID)
    assert store.put_tensor_with_parallelism_from("px/t", a, n, _par(_axis("tp", 0, 2, 1))) == 0  # every rank's shard
    assert torch.equal(store.get_tensor("px/t_tp_1"), GRID[:, 6:]) and store.is_exist("px/t__parallelism_manifest") == 0
    assert store.put_tensor_with_parallelism_from("px/w", a, n, writer_partition=_Writer(1, 2, 0)) == 0
    assert torch.equal(store.get_tensor("px/w__writer_1of2_sd0"), GRID[2:])
    assert store.put_tensor_with_parallelism_from("px/bad", a + 1, n) == INVALID_PARAMS
    assert store.batch_put_tensor_with_parallelism_from(["px/b1", "px/b2"], [a, a], [n, n],
                                                        [_par(_axis("dp", 0, 2)), None]) == [0, 0]
    assert store.batch_upsert_tensor_with_parallelism_from(["px/b1"], [a], [n]) == [0]
    assert store.batch_put_tensor_with_parallelism(["px/c1", "px/c2"], [GRID, GRID], None, None,
                                                   [_Writer(0, 2, 1), _Writer(1, 2, 1)]) == [0, 0]
    assert store.batch_upsert_tensor_with_parallelism(["px/c3"], [GRID], [_par(_axis("tp", 0, 2, 0))]) == [0]
    assert store.batch_put_tensor_with_parallelism(["px/c4"], [GRID], [None], None, [None]) == [INVALID_PARAMS]
    assert store.unregister_buffer(a) == 0


def test_safetensors_cuda_copies_and_serialization(store: MooncakeDistributedStore, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("safetensors")
    assert store.put_tensor("sf/t", GRID) == 0
    f = str(tmp_path / "t.safetensors")
    assert store.save_tensor_to_safetensor("sf/t", f) == 0
    assert store.save_tensor_to_safetensor("sf/missing", f) == FILE_NOT_FOUND
    assert store.save_tensor_to_safetensor("sf/t", str(tmp_path / "no" / "dir" / "x")) == INVALID_PARAMS
    assert torch.equal(store.load_tensor_from_safetensor("sf/loaded", f), GRID)  # not in the file: its first tensor
    assert torch.equal(store.get_tensor("sf/loaded"), GRID)
    assert store.load_tensor_from_safetensor("sf/x", f + ".missing") is None
    with pytest.raises(TypeError):
        store.load_tensor_from_safetensor("only-a-key")
    # *_into_cuda: any destination torch can copy into (a CPU tensor stands in for a GPU one here).
    dst = torch.zeros(4, 12)
    assert store.get_tensor_into_cuda("sf/t", dst) == 192 and torch.equal(dst, GRID)
    assert store.get_tensor_into_cuda("sf/t", torch.zeros(4, 11)) == INVALID_PARAMS
    assert store.batch_get_tensor_into_cuda(["sf/t", "sf/missing"], [torch.zeros(4, 12), torch.zeros(1)]) == \
        [192, INVALID_PARAMS]
    meta, ptr, size, owner = _serialize_tensor(GRID)
    assert len(meta) == _tensor_metadata_size() == 304 and size == 192 and ptr == owner.data_ptr()
    assert torch.equal(_deserialize_tensor(meta + owner.numpy().tobytes()), GRID)
    with pytest.raises(ValueError):
        _serialize_tensor(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError):
        _deserialize_tensor(b"x" * 400)
