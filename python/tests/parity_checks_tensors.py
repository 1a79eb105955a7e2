"""Parity checks of the tensor methods (need torch; see ``test_mooncake_parity.py``)."""

from __future__ import annotations

from typing import Any

from parity_registry import DELIBERATE, Key, _Buffer, _replicate_config, digest, impl, tensor_check

# ---- tensors (need torch) ---------------------------------------------------------------------
DELIBERATE.update({
    "tensor_into_cuda": "get_tensor_into_cuda reads into a destination tensor after setup too (the payload is "
    "read to host, then copied with torch); Mooncake's needs setup_dummy and answers -600 otherwise",
})


def _t(x: Any) -> Any:
    """What a caller sees of a tensor result: dtype, shape, values (codes and None as they are)."""
    if x is None or isinstance(x, int):
        return x
    return str(x.dtype), tuple(x.shape), x.float().reshape(-1).tolist()


@tensor_check
def put_tensor_and_get_tensor(s: Any, k: Key) -> Any:
    import torch

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return s.put_tensor(k("t"), t), s.get_size(k("t")), _t(s.get_tensor(k("t"))), s.put_tensor(k("t"), t * 2), \
        _t(s.get_tensor(k("t"))), s.get_tensor(k("missing"))


@tensor_check
def tensor_dtypes_and_shapes(s: Any, k: Key) -> Any:
    import torch

    tensors = {
        "bf16": torch.ones(2, 3, dtype=torch.bfloat16), "f16": torch.full((4,), 1.5, dtype=torch.float16),
        "i64": torch.arange(6, dtype=torch.int64).reshape(3, 2).t(), "bool": torch.tensor([True, False]),
        "u8": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(5), "empty": torch.empty(0, 3),
        "f8": torch.ones(3, dtype=torch.float8_e4m3fn), "f64": torch.tensor([[1.25]], dtype=torch.float64),
    }
    out = {}
    for name, t in tensors.items():
        out[name] = (s.put_tensor(k(name), t), s.get_size(k(name)), _t(s.get_tensor(k(name))))
    return out


@tensor_check
def put_tensor_of_wrong_values(s: Any, k: Key) -> Any:
    import torch

    return s.put_tensor(k("b"), b"abc"), s.put_tensor(k("c"), torch.ones(2, dtype=torch.complex64)), \
        s.put_tensor(k("d"), torch.ones([1] * 9)), s.batch_is_exist([k("b"), k("c"), k("d")])


@tensor_check
def get_tensor_of_plain_bytes(s: Any, k: Key) -> Any:
    s.put(k("raw"), b"x" * 400)
    return s.get_tensor(k("raw")), s.batch_get_tensor([k("raw"), k("missing")])


@tensor_check
def batch_put_tensor_and_batch_get_tensor(s: Any, k: Key) -> Any:
    import torch

    put = s.batch_put_tensor([k("a"), k("b"), k("c")], [torch.ones(2), torch.zeros(3, dtype=torch.int8), b"x"])
    got = [_t(x) for x in s.batch_get_tensor([k("a"), k("b"), k("c")])]
    return put, got, s.batch_put_tensor([], []), s.batch_put_tensor([k("x")], [])


@tensor_check
def get_tensor_into(s: Any, k: Key) -> Any:
    import torch

    with _Buffer(s, 1 << 16, fill=False) as b:
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        s.put_tensor(k("t"), t)
        got = s.get_tensor_into(k("t"), b.addr, 4096)
        shares = got is not None and got.data_ptr() - b.addr
        return (_t(got), shares, s.get_tensor_into(k("t"), b.addr, 100), s.get_tensor_into(k("missing"), b.addr, 4096),
                s.get_tensor_into(k("t"), 0, 4096))


@tensor_check
def batch_get_tensor_into(s: Any, k: Key) -> Any:
    import torch

    with _Buffer(s, 1 << 16, fill=False) as b:
        s.batch_put_tensor([k("a"), k("b")], [torch.ones(2, 2), torch.arange(3)])
        got = s.batch_get_tensor_into([k("a"), k("missing"), k("b")], [b.addr, b.addr + 4096, b.addr + 8192],
                                      [4096, 4096, 10])
        return [_t(x) for x in got], s.batch_get_tensor_into([k("a")], [], [])




# ---- raw layout, tensor parallelism, parallel IO --------------------------------------------


def _raw(s: Any, keys: list[str]) -> list[Any]:
    """What is stored under ``keys``, byte for byte (length and hash)."""
    return [digest(v) if v else None for v in s.get_batch(keys)]


def _axis(s: Any, kind: str, rank: int, size: int, split_dim: Any = None, expert_id: Any = None,
          stage_id: Any = None) -> Any:
    a = impl(s).ParallelAxis()
    a.kind, a.rank, a.size = kind, rank, size
    a.split_dim, a.expert_id, a.stage_id = split_dim, expert_id, stage_id
    return a


def _par(s: Any, *axes: Any) -> Any:
    p = impl(s).TensorParallelism()
    p.axes = list(axes)
    return p


def _target(s: Any, mode: str, parallelism: Any = None) -> Any:
    t = impl(s).ReadTarget()
    t.mode = mode
    t.parallelism = parallelism
    return t


class _Writer:
    def __init__(self, rank: int, size: int, split_dim: int) -> None:
        self.rank, self.size, self.split_dim = rank, size, split_dim


def _grid() -> Any:
    import torch

    return torch.arange(48, dtype=torch.float32).reshape(4, 12)


@tensor_check
def stored_layout_of_whole_tensors(s: Any, k: Key) -> Any:
    import torch

    tensors = [_grid(), torch.ones(2, 3, dtype=torch.bfloat16), torch.tensor(7), torch.empty(0, 2, dtype=torch.int16)]
    keys = [k(f"t{i}") for i in range(len(tensors))]
    codes = [s.put_tensor(key, t) for key, t in zip(keys, tensors)]
    up = s.upsert_tensor(keys[0], tensors[0] * 2), s.batch_upsert_tensor(keys[1:2], [tensors[1] * 3])
    c = _replicate_config(s)
    c.with_hard_pin = True
    pub = s.pub_tensor(k("pub"), tensors[0], c), s.batch_pub_tensor([k("pub2")], [tensors[1]], c), \
        s.upsert_pub_tensor(k("pub"), tensors[0] + 1, c), s.batch_upsert_pub_tensor([k("pub3")], [tensors[0]], c)
    bad = _replicate_config(s)
    bad.preferred_segments = ["a", "b"]
    return codes, up, pub, s.pub_tensor(k("bad"), tensors[0], bad), s.batch_pub_tensor([k("bad")], [tensors[0]], bad), \
        _raw(s, keys + [k("pub"), k("pub2"), k("pub3")])


@tensor_check
def serialize_helpers(s: Any, k: Key) -> Any:
    import torch

    mod = impl(s)
    meta, _ptr, size, owner = mod._serialize_tensor(_grid())
    try:
        mod._serialize_tensor(torch.ones(2, dtype=torch.complex64))
        bad: Any = "no error"
    except ValueError as e:
        bad = type(e).__name__
    back = mod._deserialize_tensor(meta + owner.numpy().tobytes())
    try:
        mod._deserialize_tensor(b"x" * 400)
        worse: Any = "no error"
    except ValueError as e:
        worse = type(e).__name__
    return digest(meta), size, mod._tensor_metadata_size(), bad, _t(back), worse


@tensor_check
def tensors_with_tp(s: Any, k: Key) -> Any:
    t = _grid()
    put = s.put_tensor_with_tp(k("w"), t, tp_rank=1, tp_size=3, split_dim=1)
    raw = _raw(s, [k("w_tp_0"), k("w_tp_1"), k("w_tp_2"), k("w")])
    got = [_t(s.get_tensor_with_tp(k("w"), r, 3, 1)) for r in range(3)], _t(s.get_tensor_with_tp(k("w"), 0, 1))
    uneven = s.put_tensor_with_tp(k("u"), t, tp_size=5, split_dim=1), s.put_tensor_with_tp(k("u"), t, tp_size=2,
                                                                                          split_dim=4)
    batch = s.batch_put_tensor_with_tp([k("b1"), k("b2")], [t, t[:3]], tp_rank=0, tp_size=2, split_dim=0)
    bget = [_t(x) for x in s.batch_get_tensor_with_tp([k("b1"), k("b2"), k("missing")], tp_rank=1, tp_size=2)]
    c = _replicate_config(s)
    pub = s.pub_tensor_with_tp(k("p"), t, c, 0, 2, 1), s.batch_pub_tensor_with_tp([k("p2")], [t], c, 0, 4, 0)
    return put, raw, got, uneven, batch, bget, pub, _raw(s, [k("p_tp_1"), k("p2_tp_3")]), \
        s.put_tensor_with_tp(k("one"), t, 0, 1, 0), _raw(s, [k("one")])


@tensor_check
def tensors_with_tp_into_and_from(s: Any, k: Key) -> Any:
    t = _grid()
    s.put_tensor_with_tp(k("w"), t, tp_size=2, split_dim=0)
    with _Buffer(s, 1 << 16, fill=False) as b:
        one = s.get_tensor_with_tp_into(k("w"), b.addr, 4096, 1, 2, 0)
        whole = s.get_tensor_into(k("w_tp_0"), b.addr + 8192, 4096)
        batch = s.batch_get_tensor_with_tp_into([k("w"), k("missing")], [b.addr + 16384, b.addr + 20480], [4096, 4096],
                                                tp_rank=0, tp_size=2)
        s.put_tensor(k("full"), t)
        s.get_tensor_into(k("full"), b.addr + 24576, 4096)
        n = 304 + 48 * 4
        frm = s.put_tensor_from(k("copy"), b.addr + 24576, n), s.put_tensor_from(k("bad"), b.addr + 24577, n), \
            s.batch_put_tensor_from([k("c2"), k("c3")], [b.addr + 24576] * 2, [n, n]), \
            s.upsert_tensor_from(k("copy"), b.addr + 8192, 304 + 24 * 4), \
            s.batch_upsert_tensor_from([k("c2")], [b.addr + 8192], [304 + 24 * 4]), s.batch_put_tensor_from([], [], [])
        tp_from = s.put_tensor_with_tp_from(k("tf"), b.addr + 24576, n, 0, 4, 1), \
            s.batch_put_tensor_with_tp_from([k("tf2"), k("tf3")], [b.addr + 24576, b.addr + 24577], [n, n], 0, 2, 0)
        return _t(one), _t(whole), [_t(x) for x in batch], frm, _raw(s, [k("copy"), k("c2"), k("c3")]), tp_from, \
            _raw(s, [k("tf_tp_0"), k("tf_tp_3"), k("tf2_tp_1"), k("tf3_tp_0")])


@tensor_check
def parallelism_writes(s: Any, k: Key) -> Any:
    t = _grid()
    out = []
    for r in range(2):  # a single tp axis: each rank writes its own shard
        out.append(s.put_tensor_with_parallelism(k("tp"), t[:, r * 6:(r + 1) * 6], _par(s, _axis(s, "tp", r, 2, 1))))
    out.append(s.put_tensor_with_parallelism(k("wp"), t, writer_partition=_Writer(1, 2, 0)))
    out.append(s.put_tensor_with_parallelism(k("wp"), t, writer_partition=_Writer(0, 2, 0)))
    out.append(s.put_tensor_with_parallelism(k("mx"), t, _par(s, _axis(s, "tp", 1, 3, 1), _axis(s, "dp", 0, 2))))
    out.append(s.put_tensor_with_parallelism(k("gen"), t, _par(s, _axis(s, "pp", 1, 4, stage_id=2),
                                                              _axis(s, "ep", 0, 2, expert_id=5))))
    out.append(s.put_tensor_with_parallelism(k("whole"), t))
    bad = [s.put_tensor_with_parallelism(k("bad"), t, p) for p in (
        _par(s), _par(s, _axis(s, "tp", 0, 2)), _par(s, _axis(s, "dp", 0, 2, 1)), _par(s, _axis(s, "ep", 0, 2)),
        _par(s, _axis(s, "tp", 2, 2, 0)), _par(s, _axis(s, "xx", 0, 1)), _par(s, _axis(s, "tp", 0, 2, 0),
                                                                                _axis(s, "tp", 1, 2, 0)))]
    bad.append(s.put_tensor_with_parallelism(k("bad"), t, _par(s, _axis(s, "tp", 0, 2, 0)), _replicate_config(s),
                                             _Writer(0, 2, 0)))
    bad.append(s.put_tensor_with_parallelism(k("bad"), t, writer_partition=_Writer(0, 5, 0)))
    keys = [k("tp_tp_0"), k("tp_tp_1"), k("tp__parallelism_manifest"), k("wp__writer_0of2_sd0"),
            k("wp__writer_1of2_sd0"), k("wp__writer_manifest"), k("mx__dp_0of2__tp_1of3_sd1"),
            k("mx__parallelism_manifest"), k("gen__ep_0of2_eid5__pp_1of4_sid2"), k("whole"), k("bad")]
    return out, bad, _raw(s, keys)


@tensor_check
def parallelism_reads(s: Any, k: Key) -> Any:
    t = _grid()
    for r in range(2):
        s.put_tensor_with_parallelism(k("tp"), t[:, r * 6:(r + 1) * 6], _par(s, _axis(s, "tp", r, 2, 1)))
    for r in range(2):
        s.put_tensor_with_parallelism(k("wp"), t, writer_partition=_Writer(r, 2, 0))
    s.put_tensor(k("whole"), t)
    tp = lambda r, n: _par(s, _axis(s, "tp", r, n, 1))  # noqa: E731
    reads = [
        s.get_tensor_with_parallelism(k("whole")),
        s.get_tensor_with_parallelism(k("whole"), _target(s, "as_stored")),
        s.get_tensor_with_parallelism(k("tp"), _target(s, "full", tp(0, 2))),
        s.get_tensor_with_parallelism(k("tp"), _target(s, "shard", tp(1, 2))),
        s.get_tensor_with_parallelism(k("tp"), _target(s, "shard", tp(2, 3))),
        s.get_tensor_with_parallelism(k("tp"), _target(s, "shard", tp(1, 4))),
        s.get_tensor_with_parallelism(k("wp"), _target(s, "full")),
        s.get_tensor_with_parallelism(k("wp"), _target(s, "shard", _par(s, _axis(s, "tp", 1, 2, 0)))),
        s.get_tensor_with_parallelism(k("whole"), _target(s, "full")),
        s.get_tensor_with_parallelism(k("missing"), _target(s, "full", tp(0, 2))),
        s.get_tensor_with_parallelism(k("tp"), _target(s, "shard", _par(s, _axis(s, "dp", 0, 2)))),
        s.get_tensor_with_parallelism(k("tp"), _target(s, "as_stored", tp(0, 2))),
    ]
    batch = s.batch_get_tensor_with_parallelism([k("whole"), k("tp")], [None, _target(s, "full", tp(0, 2))])
    odd = s.batch_get_tensor_with_parallelism([k("whole")], (None,)), \
        s.batch_get_tensor_with_parallelism([k("whole"), k("tp")])
    return [_t(x) for x in reads], [_t(x) for x in batch], [[_t(x) for x in y] for y in odd]


@tensor_check
def parallelism_reads_into(s: Any, k: Key) -> Any:
    t = _grid()
    for r in range(2):
        s.put_tensor_with_parallelism(k("tp"), t[:, r * 6:(r + 1) * 6], _par(s, _axis(s, "tp", r, 2, 1)))
    s.put_tensor(k("whole"), t)
    with _Buffer(s, 1 << 16, fill=False) as b:
        full = s.get_tensor_with_parallelism_into(k("tp"), b.addr, 4096, _target(s, "full", _par(s, _axis(s, "tp", 0, 2, 1))))
        head = digest(bytes(b.a[:304 + 48 * 4]))
        shard = s.get_tensor_with_parallelism_into(k("tp"), b.addr + 4096, 4096,
                                                   _target(s, "shard", _par(s, _axis(s, "tp", 0, 2, 1))))
        plain = s.get_tensor_with_parallelism_into(k("whole"), b.addr + 8192, 4096)
        small = s.get_tensor_with_parallelism_into(k("whole"), b.addr + 12288, 100)
        batch = s.batch_get_tensor_with_parallelism_into([k("whole"), k("missing")], [b.addr + 16384, b.addr + 20480],
                                                         [4096, 4096])
        return _t(full), full is not None and full.data_ptr() - b.addr, head, _t(shard), _t(plain), small, \
            [_t(x) for x in batch], s.batch_get_tensor_with_parallelism_into([k("whole")], [b.addr], [])


@tensor_check
def parallelism_writes_from_buffers(s: Any, k: Key) -> Any:
    t = _grid()
    s.put_tensor(k("src"), t)
    n = 304 + 48 * 4
    with _Buffer(s, 1 << 16, fill=False) as b:
        s.get_tensor_into(k("src"), b.addr, 4096)
        out = [s.put_tensor_with_parallelism_from(k("d"), b.addr, n),
               s.put_tensor_with_parallelism_from(k("tp"), b.addr, n, _par(s, _axis(s, "tp", 0, 2, 1))),
               s.put_tensor_with_parallelism_from(k("wp"), b.addr, n, writer_partition=_Writer(1, 2, 1)),
               s.put_tensor_with_parallelism_from(k("gen"), b.addr, n, _par(s, _axis(s, "dp", 1, 2))),
               s.put_tensor_with_parallelism_from(k("bad"), b.addr + 1, n),
               s.upsert_tensor_with_parallelism_from(k("d"), b.addr, n, _par(s, _axis(s, "dp", 0, 2))),
               s.batch_put_tensor_with_parallelism_from([k("b1"), k("b2")], [b.addr, b.addr], [n, n]),
               s.batch_put_tensor_with_parallelism_from([k("b3")], [b.addr], [n], [_par(s, _axis(s, "tp", 1, 2, 0))]),
               s.batch_upsert_tensor_with_parallelism_from([k("b1")], [b.addr], [n], None, _replicate_config(s),
                                                           [_Writer(0, 2, 0)]),
               s.batch_put_tensor_with_parallelism_from([k("b4")], [b.addr], [n], (_par(s, _axis(s, "dp", 0, 2)),))]
    keys = [k("d"), k("tp_tp_0"), k("tp_tp_1"), k("tp__parallelism_manifest"), k("wp__writer_1of2_sd1"),
            k("wp__writer_manifest"), k("gen__dp_1of2"), k("d__dp_0of2"), k("b1"), k("b2"), k("b3_tp_0"), k("b3_tp_1"),
            k("b1__writer_0of2_sd0"), k("b1__writer_manifest")]
    return out, _raw(s, keys)


@tensor_check
def parallelism_batches_and_upserts(s: Any, k: Key) -> Any:
    t = _grid()
    c = _replicate_config(s)
    c.group_ids = ["g1", "g2"]
    out = [s.batch_put_tensor_with_parallelism([k("a"), k("b")], [t, t * 2]),
           s.batch_put_tensor_with_parallelism([k("c"), k("d")], [t, t], [_par(s, _axis(s, "tp", 0, 2, 0)),
                                                                          _par(s, _axis(s, "dp", 1, 2))], c),
           s.batch_put_tensor_with_parallelism([k("e")], [t], None, _replicate_config(s), [_Writer(0, 2, 1)]),
           s.batch_put_tensor_with_parallelism([k("f")], [t], [None], _replicate_config(s), [_Writer(0, 2, 1)]),
           s.batch_put_tensor_with_parallelism([k("g")], [t], [_par(s, _axis(s, "dp", 0, 2))] * 2),
           s.batch_put_tensor_with_parallelism([k("h"), k("i")], [t], None),
           s.batch_put_tensor_with_parallelism([k("j")], [t], None, c),
           s.upsert_tensor_with_parallelism(k("a"), t + 1),
           s.upsert_tensor_with_parallelism(k("c"), t + 1, _par(s, _axis(s, "tp", 0, 2, 0))),
           s.batch_upsert_tensor_with_parallelism([k("b"), k("k")], [t + 2, t], [_par(s, _axis(s, "dp", 0, 2)), None])]
    keys = [k("a"), k("b"), k("c_tp_0"), k("c__parallelism_manifest"), k("d__dp_1of2"), k("e__writer_0of2_sd1"),
            k("b__dp_0of2"), k("k")]
    return out, _raw(s, keys)


@tensor_check
def safetensors_round_trip(s: Any, k: Key) -> Any:
    import os
    import tempfile

    t = _grid()
    s.put_tensor(k("st"), t)
    d = tempfile.mkdtemp()
    f = os.path.join(d, "x.safetensors")
    out = [s.save_tensor_to_safetensor(k("st"), f), s.save_tensor_to_safetensor(k("missing"), f + "2"),
           s.save_tensor_to_safetensor(k("st"), os.path.join(d, "no", "such", "dir.st"))]
    loaded = [_t(s.load_tensor_from_safetensor(k("st"), f)), _t(s.load_tensor_from_safetensor(k("other"), f)),
              _t(s.load_tensor_from_safetensor(None, f)), s.load_tensor_from_safetensor(k("x"), f + "nope")]
    return out, loaded, _t(s.get_tensor(k("other"))), _t(s.get_tensor(f)), _raw(s, [k("other")])


@tensor_check
def tensor_into_cuda(s: Any, k: Key) -> Any:
    import torch

    s.put_tensor(k("t"), _grid())
    dst = torch.zeros(4, 12)
    return s.get_tensor_into_cuda(k("t"), dst), _t(dst), s.get_tensor_into_cuda(k("t"), torch.zeros(4, 11)), \
        s.batch_get_tensor_into_cuda([k("t"), k("missing")], [torch.zeros(4, 12), torch.zeros(1)])
