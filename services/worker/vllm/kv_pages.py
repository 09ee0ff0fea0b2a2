"""vLLM's paged KV on CPUs <-> Ballast's stored blocks.

The cache service stores a block of B tokens as [layers, 2 (keys, values), kv_heads, B,
head_dim] (`services.worker.kv.tensors`, the torch engine's encoder). vLLM's CPU attention
keeps one tensor per layer, [pages, kv_heads, page_tokens, 2 * head_dim], and with its
"vec" kernels (x86 without AMX for this dtype, a page a multiple of 32 tokens) each
(page, head) slice holds the keys first, transposed ([head_dim, page_tokens]: one SIMD
load reads one dimension of many tokens), then the values in token order ([page_tokens,
head_dim]). That layout was read from vLLM's CPU backend (`cpu_attn.py` views the cache as
[pages, heads, 2 * page_tokens, head_dim] and chunks keys from values) and is checked in the
vLLM tier against transformers' own cache for the same tokens, key for key. Other CPU
kernels (amx, vec16, neon) pack keys differently: `VEC_ISA` is the only one served.

A block spans `len(page_ids)` whole pages; `skip_pages` leaves the leading pages of a block
untouched on scatter (vLLM's own prefix cache already holds them).
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

VEC_ISA = "vec"


def _paired(cache: Any) -> Any:
    """A layer's cache as [pages, heads, 2, page_tokens * head_dim]: keys, then values."""
    pages, heads, _page_tokens, _double = cache.shape
    return cache.view(pages, heads, 2, -1)


def gather_block(layer_caches: Sequence[Any], page_ids: Sequence[int], head_dim: int) -> Any:
    """One stored block [layers, 2, kv_heads, tokens, head_dim], copied out of the pages
    `page_ids` (in token order) of every layer."""
    import torch

    first = layer_caches[0]
    _pages, heads, page_tokens, _double = first.shape
    count = len(page_ids)
    index = torch.as_tensor(list(page_ids), device=first.device)
    out = torch.empty((len(layer_caches), 2, heads, count * page_tokens, head_dim), dtype=first.dtype)
    for layer, cache in enumerate(layer_caches):
        picked = _paired(cache).index_select(0, index)  # [count, heads, 2, page_tokens * head_dim]
        keys = picked[:, :, 0].reshape(count, heads, head_dim, page_tokens).permute(1, 0, 3, 2)
        values = picked[:, :, 1].reshape(count, heads, page_tokens, head_dim).permute(1, 0, 2, 3)
        out[layer, 0].copy_(keys.reshape(heads, count * page_tokens, head_dim))
        out[layer, 1].copy_(values.reshape(heads, count * page_tokens, head_dim))
    return out


def scatter_block(
    block: Any, layer_caches: Sequence[Any], page_ids: Sequence[int], head_dim: int, skip_pages: int = 0
) -> None:
    """Writes a stored block into the pages `page_ids[skip_pages:]` of every layer."""
    import torch

    first = layer_caches[0]
    _pages, heads, page_tokens, _double = first.shape
    count = len(page_ids)
    keep = list(page_ids)[skip_pages:]
    if not keep:
        return
    index = torch.as_tensor(keep, device=first.device)
    for layer, cache in enumerate(layer_caches):
        source = block[layer].to(device=cache.device, dtype=cache.dtype)  # [2, heads, tokens, head_dim]
        keys = source[0].reshape(heads, count, page_tokens, head_dim).permute(1, 0, 3, 2)
        values = source[1].reshape(heads, count, page_tokens, head_dim).permute(1, 0, 2, 3)
        paired = torch.stack([keys.reshape(count, heads, -1), values.reshape(count, heads, -1)], dim=2)
        _paired(cache).index_copy_(0, index, paired[skip_pages:])


def block_payload(block: Any) -> tuple[memoryview, int]:
    """A gathered block as the cache service stores it: its bytes (CPU) and their CRC-32."""
    import torch

    flat = block.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    view = memoryview(flat.numpy()).cast("B")
    return view, zlib.crc32(view)


def block_from_payload(payload: Any, shape: Sequence[int], dtype: Any) -> Any:
    """A fetched block's bytes as a tensor of the stored layout (no copy)."""
    import torch

    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(tuple(shape))
