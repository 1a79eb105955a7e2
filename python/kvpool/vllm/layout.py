"""What one block of vLLM's paged KV cache is as bytes in the pool, and what makes those bytes
mean something.

**The block image.** vLLM 0.32 hands a connector one *strided view* per layer, logically
``[B, H, N, C]`` (blocks, head slots, token states, content) whatever the physical layout: LBNHC
(FlashAttention, Triton, Flex), LBHNC (CPU, FlashInfer), LHBNC (ROCm), block-outermost BLHNC /
BLNHC / BHLNC, padded pages, and kernel-block splitting, where the view has ``ratio`` rows per
block of ``N / ratio`` states each. vllm-ascend hands each layer a tuple of separate tensors
(``(k, v)``, or MLA's ``(nope, rope)``), each ``[B, N, H, D]``. The pool object of a block is
its *logical* KV, independent of all that: for each layer of the group, in the group's order,
the layer's page as ``[H][N][C]`` bytes, where ``C`` is the layer's tensors' content side by
side (K then V; MLA's latent then its rope part) and ``N`` counts the block's states across its
kernel blocks. Page padding is not part of it. A CPU engine's LBHNC page is that image as it lies
in memory (moved with no copy of ours); other layouts are gathered through the tensors' strides
(:meth:`BlockImage.gather`, :meth:`BlockImage.scatter`). Two engines whose layouts differ but
whose KV means the same thing therefore share blocks, correctly.

**The format.** What the bytes mean is not in them: fp16 and bf16 pages have the same size, fp8
e4m3 and e5m2 are both ``uint8`` to vLLM, a ROCm engine packs K and V as two head slots, Triton's
per-token-head quantisation appends scales to ``C``. :func:`kv_format` collects everything that
decides the meaning of the image (dtype and cache dtype, the platform's fp8 encoding, the
quantisation mode, head slots, KV heads, head sizes, states per block, content bytes, the spec's
kind) from vLLM's own configuration, so the scheduler (which never sees a tensor) and the
workers compute the same digest; keys carry it (see :mod:`kvpool.vllm.keys`), and an engine
whose bytes mean something else finds nothing.

**Mooncake's format** (``kvpool_key_format: mooncake``): keys exactly as vLLM's
``MooncakeStoreConnector`` forms them, and objects as it lays them out: each registered region's
physical bytes of the block (:func:`mooncake_image`, its ``RankLocalStoreLayout`` rules), so
that engines of either connector share blocks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Blocks whose image lies in memory in at most this many runs per layer are moved straight
# from the KV tensors when they are host memory (each run is one range of a multi-range put).
DIRECT_RUNS_PER_LAYER = 2

_ALIASES = {"half": "float16", "float": "float32", "fp8": "fp8_e4m3"}


@dataclass(frozen=True)
class KVFormat:
    """What decides the meaning of a block image (see the module docs)."""

    kind: str  # "attention" or "mla"
    dtype: str  # the KV cache tensor's dtype as vLLM's spec says
    cache_dtype: str  # vLLM's kv_cache_dtype, resolved ("auto" -> dtype)
    fp8: str  # the platform's fp8 encoding where cache_dtype is an fp8 kind, else ""
    quant: str  # vLLM's KVQuantMode
    heads: int  # head slots H of the page
    kv_heads: int
    head_size: int
    head_size_v: int
    block_size: int  # tokens per block
    states: int  # N: stored states per block
    content: int  # C: bytes per (head slot, state)
    extra: str = ""  # MLA's cache_dtype_str and model_version

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page in the image (no padding)."""
        return self.heads * self.states * self.content

    @property
    def digest(self) -> str:
        """16 hex digits: the part of a key that names this format."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (f"{self.kind} {self.cache_dtype}"
                f"{'/' + self.fp8 if self.fp8 else ''} ({self.dtype}, {self.quant}), H={self.heads} "
                f"(kv heads {self.kv_heads}, head {self.head_size}/{self.head_size_v}), N={self.states} "
                f"of {self.block_size} tokens, C={self.content} B{', ' + self.extra if self.extra else ''}")


def group_spec(kv_cache_config: "KVCacheConfig") -> Any:
    """The spec of the one group the connector stores (a uniform-type group's per-layer specs
    must agree on everything the image depends on)."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    specs = list(getattr(spec, "kv_cache_specs", {}).values())
    if specs:
        first = _spec_fields(specs[0])
        for s in specs[1:]:
            if _spec_fields(s) != first:
                raise ValueError("KVPoolConnector needs one KV page format for every layer of the group; "
                                 f"found {first} and {_spec_fields(s)}")
        return specs[0]
    return spec


def _spec_fields(spec: Any) -> tuple[Any, ...]:
    return (type(spec).__name__, spec.num_heads, spec.num_states, spec.state_content_size_bytes,
            str(getattr(spec, "dtype", "")), getattr(spec, "head_size", 0))


def _platform_fp8() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.fp8_dtype()).removeprefix("torch.")
    except Exception:  # a platform that cannot say: fp8 blocks then share a key only with its kind
        return "unknown"


def kv_format(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> KVFormat:
    """The format of this engine's blocks, from vLLM's configuration alone."""
    spec = group_spec(kv_cache_config)
    dtype = str(getattr(spec, "dtype", "")).removeprefix("torch.")
    cache = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    try:
        from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

        cache = resolve_kv_cache_dtype_string(cache, vllm_config.model_config)
    except Exception:  # no model config (unit tests): the string as given
        pass
    cache = _ALIASES.get(cache, cache)
    if cache == "auto":
        cache = dtype
    fp8 = _platform_fp8() if cache.startswith("fp8") and cache != "fp8_inc" else ""
    quant = getattr(spec, "kv_quant_mode", None)
    extra = ",".join(f"{k}={getattr(spec, k)}" for k in ("cache_dtype_str", "model_version")
                     if getattr(spec, k, None) is not None)
    return KVFormat(
        kind="mla" if "MLA" in type(spec).__name__ else "attention",
        dtype=dtype,
        cache_dtype=cache,
        fp8=fp8,
        quant=getattr(quant, "name", str(quant)),
        heads=int(spec.num_heads),
        kv_heads=int(getattr(spec, "num_kv_heads", spec.num_heads)),
        head_size=int(getattr(spec, "head_size", 0)),
        head_size_v=int(getattr(spec, "head_size_v", 0) or 0),
        block_size=int(spec.block_size),
        states=int(spec.num_states),
        content=int(spec.state_content_size_bytes),
        extra=extra,
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as ``uint8`` (the last dimension in bytes)."""
    if t.dtype == torch.uint8:
        return t
    if t.stride(-1) != 1:
        raise ValueError(f"a KV tensor's last dimension must be contiguous (strides {t.stride()})")
    return t.view(torch.uint8)


@dataclass
class _Layer:
    """One layer: its tensors as ``[B, r, H, Nk, Cp]`` byte views (``B`` blocks, ``r`` kernel
    blocks each), side by side along ``C``."""

    name: str
    parts: list[torch.Tensor]

    @property
    def content(self) -> int:
        return sum(int(p.shape[-1]) for p in self.parts)


class BlockImage:
    """The pool object of a block (see the module docs): how to address it in the KV tensors."""

    def __init__(self, layers: list[_Layer], num_blocks: int, fmt: Optional[KVFormat]) -> None:
        self.layers = layers
        self.num_blocks = num_blocks
        self.format = fmt
        p0 = layers[0].parts[0]
        self.device = p0.device
        self.ratio, self.heads, self.kstates = int(p0.shape[1]), int(p0.shape[2]), int(p0.shape[3])
        self.page = [self.heads * self.ratio * self.kstates * l.content for l in layers]
        self.block_bytes = sum(self.page)
        # All layers one strided tensor of vLLM's single backing buffer: one gather for all.
        self.fused = _fuse([l.parts[0] for l in layers]) if all(len(l.parts) == 1 for l in layers) else None
        self._runs = _runs(layers)

    # ---- parsing ---------------------------------------------------------------------------

    @staticmethod
    def from_kv_caches(kv_caches: dict[str, Any], num_blocks: int, fmt: Optional[KVFormat] = None,
                       order: Optional[Sequence[str]] = None) -> "BlockImage":
        """Read vLLM's (or vllm-ascend's) KV caches; ``fmt`` checks every tensor against the
        spec; ``order`` is the group's layer order (else the dict's)."""
        names = [n for n in (order or kv_caches) if n in kv_caches]
        missing = [n for n in (order or ()) if n not in kv_caches]
        if missing:
            raise ValueError(f"KV caches of layers {missing[:4]} were not handed to the connector")
        if not names:
            raise ValueError("no KV caches to register")
        layers: list[_Layer] = []
        seen: set[tuple[Any, ...]] = set()
        for name in names:
            parts = _parts(name, kv_caches[name], num_blocks, fmt)
            ident = tuple((p.data_ptr(), tuple(p.shape), p.stride()) for p in parts)
            if ident in seen:
                continue  # a layer that shares another's KV cache (vLLM's KV sharing)
            seen.add(ident)
            layers.append(_Layer(name, parts))
        shapes = {tuple(p.shape[1:4]) for l in layers for p in l.parts}
        contents = {l.content for l in layers}
        if len(shapes) != 1 or len(contents) != 1:
            raise ValueError(f"KVPoolConnector needs one page shape in every layer; found {sorted(shapes)} "
                             f"with {sorted(contents)} content bytes")
        devices = {str(p.device) for l in layers for p in l.parts}
        if len(devices) != 1:
            raise ValueError(f"KV caches on several devices: {sorted(devices)}")
        return BlockImage(layers, num_blocks, fmt)

    # ---- addressing ------------------------------------------------------------------------

    def storages(self) -> list[tuple[int, int]]:
        """Distinct memory regions behind the KV tensors (start, bytes)."""
        out: dict[int, int] = {}
        for l in self.layers:
            for p in l.parts:
                s = p.untyped_storage()
                out[s.data_ptr()] = s.nbytes()
        return sorted(out.items())

    @property
    def direct(self) -> bool:
        """Whether the image lies in few enough runs to be moved straight from the tensors."""
        return self._runs is not None

    def runs(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Address ranges of each block's image, in image order (only where :attr:`direct`)."""
        assert self._runs is not None
        start, size, stride = self._runs
        ids = np.asarray(list(block_ids), dtype=np.int64)
        ptrs = start[None, :] + ids[:, None] * stride[None, :]
        return ptrs.tolist(), [size.tolist()] * len(ids)

    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the images of blocks ``idx`` into ``out`` (``[k, block_bytes]`` uint8, on the
        caches' device), in the caches' current stream."""
        k = int(idx.numel())
        if self.fused is not None:
            l, _, r, h, n, c = self.fused.shape
            x = self.fused.index_select(1, idx)
            out.view(k, l, h, r, n, c).copy_(x.permute(1, 0, 3, 2, 4, 5))
            return
        at = 0
        for layer, page in zip(self.layers, self.page):
            dst = out[:, at : at + page].view(k, self.heads, self.ratio, self.kstates, layer.content)
            c0 = 0
            for p in layer.parts:
                cp = int(p.shape[-1])
                dst[..., c0 : c0 + cp].copy_(p.index_select(0, idx).permute(0, 2, 1, 3, 4))
                c0 += cp
            at += page

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        """Write the images in ``src`` (``[k, block_bytes]``, on the caches' device) into blocks
        ``idx``."""
        k = int(idx.numel())
        if self.fused is not None:
            l, _, r, h, n, c = self.fused.shape
            self.fused[:, idx] = src.view(k, l, h, r, n, c).permute(1, 0, 3, 2, 4, 5)
            return
        at = 0
        for layer, page in zip(self.layers, self.page):
            view = src[:, at : at + page].view(k, self.heads, self.ratio, self.kstates, layer.content)
            c0 = 0
            for p in layer.parts:
                cp = int(p.shape[-1])
                p[idx] = view[..., c0 : c0 + cp].permute(0, 2, 1, 3, 4)
                c0 += cp
            at += page


def _parts(name: str, value: Any, num_blocks: int, fmt: Optional[KVFormat]) -> list[torch.Tensor]:
    """One layer's tensors as ``[B, r, H, Nk, Cp]`` byte views."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 4:
            raise ValueError(f"KV cache of layer {name} has shape {tuple(value.shape)}; vLLM 0.32 hands a "
                             "[blocks, heads, states, content] view per layer")
        # vLLM 0.32: logical [B', H, N', C].
        views = [_bytes(value)]
    elif isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        # vllm-ascend: separate tensors, each [B', N', H, D]; seen as [B', H, N', D].
        if any(t.dim() != 4 for t in value):
            raise ValueError(f"KV caches of layer {name} have shapes {[tuple(t.shape) for t in value]}; "
                             "separate tensors must each be [blocks, states, heads, dim]")
        views = [_bytes(t).transpose(1, 2) for t in value]
    else:
        kinds = [type(t).__name__ for t in value] if isinstance(value, (tuple, list)) else type(value).__name__
        raise ValueError(f"KV cache of layer {name} is {kinds}: KVPoolConnector stores paged attention KV "
                         "caches (a tensor, or a tuple of tensors)")
    heads, states = int(views[0].shape[1]), int(views[0].shape[2])
    if any((int(v.shape[1]), int(v.shape[2])) != (heads, states) for v in views):
        raise ValueError(f"KV caches of layer {name} disagree on heads and states: "
                         f"{[tuple(v.shape) for v in views]}")
    content = sum(int(v.shape[3]) for v in views)
    want_states = fmt.states if fmt is not None else states
    if states <= 0 or want_states % states:
        raise ValueError(f"layer {name}: {states} states per kernel block do not divide the block's {want_states}")
    ratio = want_states // states
    if fmt is not None and (heads, content) != (fmt.heads, fmt.content):
        raise ValueError(f"layer {name}: a page of {heads} head slots x {content} bytes, but the KV cache spec "
                         f"says {fmt.heads} x {fmt.content} ({fmt.describe()})")
    out = []
    for v in views:
        rows = int(v.shape[0])
        if rows < num_blocks * ratio:
            raise ValueError(f"layer {name}: {rows} kernel blocks, fewer than {num_blocks} blocks x {ratio}")
        out.append(v[: num_blocks * ratio].unflatten(0, (num_blocks, ratio)))
    return out


def _fuse(parts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[L, B, r, H, Nk, C]`` over one storage when the layers are evenly spaced in it."""
    if len(parts) < 2:
        return parts[0].unsqueeze(0) if parts else None
    p0 = parts[0]
    storage = p0.untyped_storage().data_ptr()
    step = parts[1].data_ptr() - p0.data_ptr()
    for i, p in enumerate(parts):
        if (p.untyped_storage().data_ptr() != storage or p.shape != p0.shape or p.stride() != p0.stride()
                or p.data_ptr() - p0.data_ptr() != i * step or step <= 0):
            return None
    return torch.as_strided(p0, (len(parts), *p0.shape), (step, *p0.stride()), p0.storage_offset())


def _runs(layers: list[_Layer]) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Block 0's image as address runs (start, size, per-block stride), or None past
    ``DIRECT_RUNS_PER_LAYER`` runs per layer."""
    starts: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    strides: list[np.ndarray] = []
    for layer in layers:
        p0 = layer.parts[0]
        _, r, h, n, _ = p0.shape
        # Image order within a layer: h, r, n, then the parts side by side.
        addr = np.empty((h, r, n, len(layer.parts)), dtype=np.int64)
        for j, p in enumerate(layer.parts):
            sb, sr, sh, sn, _ = p.stride()
            hh, rr, nn = np.meshgrid(np.arange(h), np.arange(r), np.arange(n), indexing="ij")
            addr[..., j] = p.data_ptr() + hh * sh + rr * sr + nn * sn
        size = np.broadcast_to(np.array([int(p.shape[-1]) for p in layer.parts]), addr.shape)
        stride = np.broadcast_to(np.array([p.stride(0) for p in layer.parts]), addr.shape)
        starts.append(addr.reshape(-1))
        sizes.append(size.reshape(-1))
        strides.append(stride.reshape(-1))
    start, size, stride = np.concatenate(starts), np.concatenate(sizes), np.concatenate(strides)
    # A run continues where the previous one ends and moves with the block alike.
    cont = np.zeros(len(start), dtype=bool)
    cont[1:] = (start[1:] == start[:-1] + size[:-1]) & (stride[1:] == stride[:-1])
    heads = np.flatnonzero(~cont)
    if len(heads) > DIRECT_RUNS_PER_LAYER * len(layers):
        return None
    run_size = np.add.reduceat(size, heads)
    return start[heads], run_size, stride[heads]


class RegionImage:
    """Mooncake's block object: each region's physical bytes of the block in turn (see
    :func:`mooncake_image`); the same interface as :class:`BlockImage`."""

    direct = True

    def __init__(self, slabs: list[torch.Tensor], num_blocks: int, fmt: Optional[KVFormat]) -> None:
        # Each slab: [num_blocks, bytes] over a storage, row b at the block's region.
        self.slabs = slabs
        self.num_blocks = num_blocks
        self.format = fmt
        self.device = slabs[0].device
        self.block_bytes = sum(int(s.shape[1]) for s in slabs)
        self._start = np.array([s.data_ptr() for s in slabs], dtype=np.int64)
        self._size = np.array([int(s.shape[1]) for s in slabs], dtype=np.int64)
        self._stride = np.array([s.stride(0) for s in slabs], dtype=np.int64)

    def storages(self) -> list[tuple[int, int]]:
        out = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in self.slabs}
        return sorted(out.items())

    def runs(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        ids = np.asarray(list(block_ids), dtype=np.int64)
        ptrs = self._start[None, :] + ids[:, None] * self._stride[None, :]
        return ptrs.tolist(), [self._size.tolist()] * len(ids)

    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        at = 0
        for s in self.slabs:
            n = int(s.shape[1])
            out[:, at : at + n].copy_(s.index_select(0, idx))
            at += n

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        at = 0
        for s in self.slabs:
            n = int(s.shape[1])
            s[idx] = src[:, at : at + n]
            at += n


def mooncake_image(kv_caches: dict[str, Any], num_blocks: int, fmt: Optional[KVFormat] = None,
                   order: Optional[Sequence[str]] = None) -> RegionImage:
    """The regions vLLM's ``MooncakeStoreConnector`` registers for these caches (its
    ``RankLocalStoreLayout``, in its order): block ``b``'s object is each region's
    ``[start + b * len, + len)`` in turn."""
    from vllm.utils.torch_utils import is_non_overlapping_and_dense

    seen: set[int] = set()
    slabs: list[torch.Tensor] = []
    for name in [n for n in (order or kv_caches) if n in kv_caches]:
        value = kv_caches[name]
        tensors = [value] if isinstance(value, torch.Tensor) else list(value)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.shape[0] % num_blocks:
                raise ValueError(f"layer {name}: Mooncake's layout addresses only tensors of whole blocks")
            cache = t.unflatten(0, (num_blocks, -1)) if t.shape[0] != num_blocks else t
            storage = t.untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            base = storage.data_ptr()
            if not is_non_overlapping_and_dense(cache[0]):
                regions = [(cache[:, h].data_ptr(), cache[:, h].stride(0) * cache.element_size())
                           for h in range(cache.shape[1])]
            elif cache.stride(0) * cache.element_size() * num_blocks == storage.nbytes():
                regions = [(base, storage.nbytes() // num_blocks)]
            else:
                regions = [(cache.data_ptr(), cache.stride(0) * cache.element_size())]
            for addr, size in regions:
                if addr in seen:
                    continue
                seen.add(addr)
                if addr - base + num_blocks * size > storage.nbytes():
                    raise ValueError(f"layer {name}: Mooncake's region {addr:#x}+{num_blocks}x{size} "
                                     "runs past its storage")
                slabs.append(torch.as_strided(flat, (num_blocks, size), (size, 1), addr - base))
    if not slabs:
        raise ValueError("no KV caches to register")
    return RegionImage(slabs, num_blocks, fmt)
