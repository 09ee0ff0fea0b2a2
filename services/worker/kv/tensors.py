"""KV tensors <-> stored blocks, for transformers' DynamicCache (the torch engine).

A block holds tokens [i*B, (i+1)*B) of every layer, laid out as
[layers, 2 (keys, values), kv_heads, B, head_dim] in the model's dtype, little-endian as in
memory. Encoding copies the blocks out once, block-major, so each block is one contiguous
slice; decoding reads the fetched buffer in place and copies once into per-layer tensors.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch

from services.cache.client import FetchedBlocks
from services.cache.types import KVLayout

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
NAMED_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]


def model_layout(config: Any, dtype: torch.dtype, block_tokens: int) -> KVLayout | None:
    """The block layout of a decoder whose every layer keeps full-attention KV; None for
    models this format cannot hold (sliding-window or recurrent layers, odd dtypes)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return None
    if dtype not in DTYPE_NAMES:
        return None
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return KVLayout(DTYPE_NAMES[dtype], (layers, 2, heads, block_tokens, head_dim), layers, block_tokens)


def cache_pairs(cache: Any) -> KVPairs:
    """(keys, values) of each layer of a DynamicCache: [1, kv_heads, tokens, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def fits(pairs: KVPairs, layout: KVLayout, tokens: int) -> bool:
    """Whether the tensors hold `tokens` tokens in exactly this layout."""
    layers, _two, heads, _b, head_dim = layout.shape
    if len(pairs) != layers:
        return False
    want_dtype = NAMED_DTYPES[layout.dtype]
    return all(
        t.dim() == 4
        and t.shape[0] == 1
        and t.shape[1] == heads
        and t.shape[2] == tokens
        and t.shape[3] == head_dim
        and t.dtype == want_dtype
        for pair in pairs
        for t in pair
    )


def encode_blocks(pairs: KVPairs, layout: KVLayout, first: int, end: int) -> list[tuple[memoryview, int]]:
    """Blocks [first, end) as (bytes, CRC-32) pairs; each view is one contiguous block."""
    count = end - first
    if count <= 0:
        return []
    layers, _two, heads, block, head_dim = layout.shape
    start, stop = first * block, end * block
    out = torch.empty((count, layers, 2, heads, block, head_dim), dtype=pairs[0][0].dtype)
    with torch.inference_mode():
        for layer, (keys, values) in enumerate(pairs):
            for kind, tensor in enumerate((keys, values)):
                window = tensor[0, :, start:stop, :].reshape(heads, count, block, head_dim)
                out[:, layer, kind].copy_(window.permute(1, 0, 2, 3))
    raw = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
    size = layout.block_bytes
    blocks = []
    for i in range(count):
        view = raw[i * size : (i + 1) * size]
        blocks.append((view, zlib.crc32(view)))
    return blocks


def decode_blocks(fetched: FetchedBlocks, blocks: int, device: torch.device) -> KVPairs:
    """Per-layer (keys, values) of the first `blocks` fetched blocks, on `device`."""
    layout = fetched.layout
    layers, two, heads, block, head_dim = layout.shape
    size = layout.block_bytes * blocks
    flat = torch.frombuffer(fetched.buffer, dtype=torch.uint8, count=size)
    grid = flat.view(NAMED_DTYPES[layout.dtype]).view(blocks, layers, two, heads, block, head_dim)
    # One copy into sequence order: [layers, 2, heads, blocks*block, head_dim].
    merged = grid.permute(1, 2, 3, 0, 4, 5).reshape(layers, two, heads, blocks * block, head_dim)
    merged = merged.to(device)
    return [(merged[i, 0].unsqueeze(0), merged[i, 1].unsqueeze(0)) for i in range(layers)]


def verify_and_decode(fetched: FetchedBlocks, device: torch.device) -> tuple[int, KVPairs | None]:
    """Checks every fetched block's checksum; decodes the leading good ones."""
    good = fetched.verified_prefix()
    if good == 0:
        return 0, None
    return good, decode_blocks(fetched, good, device)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
