"""KV tensors <-> block bytes: round trips, dtypes, layouts, and checksums on the way back."""

import pytest
import torch
from transformers import LlamaConfig

from services.cache.client import FetchedBlocks
from services.cache.types import BlockHeader
from services.worker.kv.tensors import (
    common_prefix,
    encode_blocks,
    fits,
    model_layout,
    verify_and_decode,
)
from services.worker.kv.session import restorable_blocks

CONFIG = LlamaConfig(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    intermediate_size=128,
    vocab_size=100,
)
BLOCK = 8


def pairs_for(tokens: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, 2, tokens, 16, generator=g).to(dtype), torch.randn(1, 2, tokens, 16, generator=g).to(dtype))
        for _ in range(3)
    ]


def fetched_from(pairs, layout, first, end) -> FetchedBlocks:
    encoded = encode_blocks(pairs, layout, first, end)
    fetched = FetchedBlocks(layout, bytearray(b"".join(bytes(p) for p, _ in encoded)))
    fetched.headers = [BlockHeader(bytes(16), i, layout, len(p), crc) for i, (p, crc) in enumerate(encoded)]
    return fetched


def test_layout_from_model_config():
    layout = model_layout(CONFIG, torch.float32, BLOCK)
    assert layout.shape == (3, 2, 2, BLOCK, 16) and layout.layers == 3 and layout.dtype == "float32"
    assert layout.block_bytes == 3 * 2 * 2 * BLOCK * 16 * 4
    mixed = LlamaConfig(
        **{**CONFIG.to_dict(), "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    )
    mixed.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    assert model_layout(mixed, torch.float32, BLOCK) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_of_whole_blocks(dtype):
    layout = model_layout(CONFIG, dtype, BLOCK)
    pairs = pairs_for(5 * BLOCK + 3, dtype)  # the partial block is never stored
    assert fits(pairs, layout, 5 * BLOCK + 3) and not fits(pairs, layout, 5 * BLOCK)
    fetched = fetched_from(pairs, layout, 0, 5)
    good, restored = verify_and_decode(fetched, torch.device("cpu"))
    assert good == 5
    for (k, v), (rk, rv) in zip(pairs, restored):
        assert rk.shape == (1, 2, 5 * BLOCK, 16) and rk.dtype == dtype
        assert torch.equal(rk, k[:, :, : 5 * BLOCK]) and torch.equal(rv, v[:, :, : 5 * BLOCK])


def test_blocks_from_the_middle_hold_their_own_tokens():
    layout = model_layout(CONFIG, torch.float32, BLOCK)
    pairs = pairs_for(4 * BLOCK)
    encoded = encode_blocks(pairs, layout, 2, 4)
    whole = encode_blocks(pairs, layout, 0, 4)
    assert [bytes(p) for p, _ in encoded] == [bytes(p) for p, _ in whole[2:]]
    assert [c for _, c in encoded] == [c for _, c in whole[2:]]


def test_corrupt_block_cuts_the_restored_prefix():
    layout = model_layout(CONFIG, torch.float32, BLOCK)
    pairs = pairs_for(4 * BLOCK)
    fetched = fetched_from(pairs, layout, 0, 4)
    fetched.buffer[2 * layout.block_bytes + 17] ^= 0x01  # block 2
    good, restored = verify_and_decode(fetched, torch.device("cpu"))
    assert good == 2 and restored[0][0].shape[2] == 2 * BLOCK
    fetched.buffer[5] ^= 0x01  # block 0
    assert verify_and_decode(fetched, torch.device("cpu")) == (0, None)


def test_the_last_token_is_never_restored():
    assert restorable_blocks(16, 8) == 1 and restorable_blocks(17, 8) == 2 and restorable_blocks(8, 8) == 0
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
