"""KV caches as vLLM 0.32 builds them for each attention backend, on CPU tensors, with vLLM's own
functions: the backend's spec customisation (``customize_attention_spec``: ROCm's two head
slots, Triton's inline scales, TurboQuant's packed slots, ...), its supported layouts, the KV
cache config (``get_kv_cache_config_from_groups``: strides, padding), kernel block sizes
(``prepare_kernel_block_sizes``) and the allocation (``allocate_kv_cache``: the strided per-layer
views a connector gets). Real attention layers need a GPU; only the layer's spec is built here.

vllm-ascend is not installed here (it needs CANN): :func:`ascend_caches` builds the per-layer
``(k, v)`` / ``(nope, rope)`` tuples its NPU model runner hands connectors (each
``[blocks, block_size, heads, dim]`` in its own 2 MiB-aligned allocation), from its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch

LAYERS = 3
HEADS = 4
HEAD = 16
MLA_HEAD = 576  # DeepSeek's latent (512) and rope (64) parts


@dataclass
class Case:
    """One engine's KV cache: a backend, a layout, a cache dtype, a block size."""

    backend: str
    layout: str
    cache_dtype: str
    block_size: int
    model_dtype: torch.dtype = torch.bfloat16
    num_blocks: int = 6
    heads: int = HEADS
    name: str = "m"
    built: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.layout}-{self.cache_dtype}-b{self.block_size}"

    def build(self) -> tuple[Any, Any, dict[str, Any], int]:
        """(vllm_config, kv_cache_config, kv_caches, kernel block size), caches zeroed."""
        from vllm.config import CacheConfig, ModelConfig, VllmConfig
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheGroupSpec,
            MLAAttentionSpec,
            get_kv_quant_mode,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec, prepare_kernel_block_sizes

        cls = AttentionBackendEnum[self.backend].get_class()
        model = SimpleNamespace(dtype=self.model_dtype, hf_config=None)
        dtype = kv_cache_dtype_str_to_dtype(self.cache_dtype, model)  # type: ignore[arg-type]
        quant = get_kv_quant_mode(self.cache_dtype)
        if cls.is_mla():
            spec: Any = MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=MLA_HEAD, dtype=dtype,
                                         cache_dtype_str=None if self.cache_dtype == "auto" else self.cache_dtype,
                                         kv_quant_mode=quant)
        else:
            spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.heads, head_size=HEAD, dtype=dtype,
                                     kv_quant_mode=quant)
        spec = customize_attention_spec(cls, spec)
        cache = CacheConfig(block_size=self.block_size, cache_dtype=self.cache_dtype)
        cache.kv_cache_layout = self.layout
        vc = VllmConfig(cache_config=cache)
        # The model config is not built (no model here): what the connector reads of it.
        object.__setattr__(vc, "model_config", _Model(self.model_dtype, self.name))
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        groups = [KVCacheGroupSpec(names, spec)]
        layout = KVCacheLayout[self.layout]
        per_block = _bytes_per_block(groups, layout)
        kcfg = get_kv_cache_config_from_groups(vc, groups, self.num_blocks * per_block)
        kcfg.kv_cache_layout = self.layout
        vc.cache_config.num_gpu_blocks = kcfg.num_blocks
        kernel = prepare_kernel_block_sizes(kcfg, [[SimpleNamespace(backend=cls, kv_cache_spec=spec)]])
        kv = allocate_kv_cache(kcfg, torch.device("cpu"), layout, kernel)
        return vc, kcfg, kv, kernel[0]


class _Model:
    """The parts of vLLM's ModelConfig the connector reads."""

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype = dtype
        self.model = f"/models/{name}"
        self.hf_config = None
        self.is_moe = False

    def get_total_num_kv_heads(self) -> int:
        return HEADS


def _bytes_per_block(groups: list[Any], layout: Any) -> int:
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block

    return _get_kv_cache_bytes_per_block(groups, layout)


# Layouts tried for a backend that declares none (any layout works for it; vLLM picks LBNHC,
# a connector or VLLM_KV_CACHE_LAYOUT may pick another).
UNDECLARED = ("LBNHC", "LBHNC", "BLHNC", "LHBNC")


def backend_cases() -> tuple[list[Case], list[tuple[str, str]]]:
    """Every backend vLLM ships that loads here, with each layout and KV cache dtype it
    supports; and the backends left out, with why."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cases: list[Case] = []
    skipped: list[tuple[str, str]] = []
    for e in AttentionBackendEnum:
        try:
            cls = e.get_class()
            layouts = cls.supported_kv_cache_layouts()
            kernel = cls.get_supported_kernel_block_sizes()
        except Exception as ex:  # needs a GPU library, or is registered by a plugin
            skipped.append((e.name, f"{type(ex).__name__}: {str(ex)[:80]}"))
            continue
        names = [x.name for x in layouts] if layouts else list(UNDECLARED)
        model_dtype = torch.bfloat16 if torch.bfloat16 in cls.supported_dtypes else cls.supported_dtypes[0]
        fixed = [k for k in kernel if isinstance(k, int)]
        sizes = [max(fixed)] if fixed else [64]
        if fixed:
            sizes.append(2 * max(fixed))  # split into kernel blocks
        dtypes = [d for d in getattr(cls, "supported_kv_cache_dtypes", ["auto"]) if d not in ("float16", "bfloat16")]
        for layout in names:
            for cache_dtype in dtypes:
                for bs in sizes:
                    cases.append(Case(e.name, layout, cache_dtype, bs, model_dtype=model_dtype))
    return cases, skipped


def buildable(cases: list[Case]) -> tuple[list[Case], list[tuple[str, str]]]:
    """The cases vLLM builds caches for (some dtypes need a model's quantisation config, some
    layouts a model's packing); and the rest, with vLLM's reason."""
    ok, refused = [], []
    for c in cases:
        try:
            c.build()
        except Exception as ex:
            refused.append((c.id, f"{type(ex).__name__}: {str(ex)[:100]}"))
            continue
        ok.append(c)
    return ok, refused


def ascend_caches(num_blocks: int, block_size: int, heads: int, dims: tuple[int, ...], dtype: torch.dtype,
                  layers: list[str]) -> dict[str, tuple[torch.Tensor, ...]]:
    """vllm-ascend's KV caches (its ``NPUModelRunner._allocate_kv_cache_tensors`` and
    ``_reshape_kv_cache_tensors``, vllm-ascend main of 2026-08): per layer one tensor per part
    (``(k, v)``, or MLA's ``(nope, rope)``), each ``[num_blocks, block_size, heads, dim]`` cut from
    its own int8 allocation at a 2 MiB-aligned address, with the allocation's slack before and
    after it (so ``data_ptr()`` is not the storage's start)."""
    align = 2 << 20
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in layers:
        parts = []
        for d in dims:
            numel = num_blocks * block_size * heads * d * torch.empty(0, dtype=dtype).element_size()
            raw = torch.zeros(numel + align, dtype=torch.int8)
            off = (-raw.data_ptr()) % align
            parts.append(raw[off : off + numel].view(dtype).view(num_blocks, block_size, heads, d))
        out[name] = tuple(parts)
    return out


def logical_blocks(kv: dict[str, Any], block_ids: list[int], num_blocks: int) -> list[bytes]:
    """Each block's KV as vLLM's logical views say it ([layer][head][state][content]), for
    comparing engines whatever their layout: what a block *means*."""
    out = []
    for b in block_ids:
        parts = []
        for name in sorted(kv):
            value = kv[name]
            if isinstance(value, torch.Tensor):
                v = value.view(torch.uint8) if value.dtype != torch.uint8 else value
                r = v.shape[0] // num_blocks
                x = v[b * r : (b + 1) * r].permute(1, 0, 2, 3).reshape(v.shape[1], -1, v.shape[3])
            else:  # [B, N, H, D] parts, side by side in content
                xs = [t.view(torch.uint8)[b].permute(1, 0, 2) for t in value]
                x = torch.cat(xs, dim=-1)
            parts.append(x.contiguous().numpy().tobytes())
        out.append(b"".join(parts))
    return out


def fill(kv: dict[str, Any], seed: int) -> None:
    """Random bytes in every KV tensor."""
    g = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for value in kv.values():
        for t in [value] if isinstance(value, torch.Tensor) else list(value):
            s = t.untyped_storage()
            if s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8).set_(s)
            flat.copy_(torch.randint(0, 256, (flat.numel(),), generator=g, dtype=torch.uint8))


def iter_tensors(kv: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in kv.values():
        yield from ([value] if isinstance(value, torch.Tensor) else list(value))


def describe(kv: dict[str, Any]) -> Optional[str]:
    t = next(iter_tensors(kv), None)
    return None if t is None else f"{tuple(t.shape)} strides {t.stride()} {t.dtype}"
