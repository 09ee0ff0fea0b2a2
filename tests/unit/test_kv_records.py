"""Stored block records and wire types: headers, checksums, and every way an entry is a miss."""

import zlib

import pytest

from services.cache.client import PutBlock, put_messages
from services.cache.framing import Unpacker, pack
from services.cache.records import RecordMiss, decode_record, encode_record, record_key
from services.cache.types import BlockHeader, KVLayout, KVScope, check_block_hashes
from services.common.errors import InvalidArgument

SCOPE = KVScope("abc123", "acme")
LAYOUT = KVLayout("float32", (2, 2, 4, 16, 8), 2, 16)
HASH = bytes(range(16))
PAYLOAD = bytes(i % 251 for i in range(LAYOUT.block_bytes))


def header(**changes) -> BlockHeader:
    fields = dict(block_hash=HASH, block_index=3, layout=LAYOUT, size=len(PAYLOAD), crc32=zlib.crc32(PAYLOAD))
    fields.update(changes)
    return BlockHeader(**fields)


def record() -> bytes:
    return encode_record(SCOPE, header(), PAYLOAD)


def test_round_trip():
    got = decode_record(record(), SCOPE, HASH, 3, LAYOUT)
    assert bytes(got.payload) == PAYLOAD and got.header == header()
    assert decode_record(record(), SCOPE, HASH, 3).header.layout == LAYOUT  # any layout accepted


@pytest.mark.parametrize("where", [0, 5, 20, -1, -len(PAYLOAD) // 2])
def test_any_flipped_byte_is_a_miss(where):
    raw = bytearray(record())
    raw[where] ^= 0x40
    with pytest.raises(RecordMiss) as miss:
        decode_record(bytes(raw), SCOPE, HASH, 3, LAYOUT)
    assert miss.value.reason in ("corrupt", "partial", "mismatch")


@pytest.mark.parametrize("keep", [0, 3, 12, 100, -1])
def test_truncated_entry_is_a_miss(keep):
    raw = record()
    with pytest.raises(RecordMiss) as miss:
        decode_record(raw[:keep] if keep >= 0 else raw[:keep], SCOPE, HASH, 3, LAYOUT)
    assert miss.value.reason in ("corrupt", "partial")


def test_longer_entry_is_a_miss():
    with pytest.raises(RecordMiss, match="corrupt"):
        decode_record(record() + b"x", SCOPE, HASH, 3, LAYOUT)


@pytest.mark.parametrize(
    "scope, block_hash, index, layout",
    [
        (KVScope("other", "acme"), HASH, 3, LAYOUT),
        (KVScope("abc123", "globex"), HASH, 3, LAYOUT),
        (SCOPE, bytes(16), 3, LAYOUT),
        (SCOPE, HASH, 4, LAYOUT),
        (SCOPE, HASH, 3, KVLayout("float16", (2, 2, 4, 16, 8), 2, 16)),
        (SCOPE, HASH, 3, KVLayout("float32", (2, 2, 4, 16, 4), 2, 16)),
    ],
)
def test_foreign_header_is_a_mismatch(scope, block_hash, index, layout):
    with pytest.raises(RecordMiss, match="mismatch"):
        decode_record(record(), scope, block_hash, index, layout)


def test_keys_bind_version_and_tenant_but_not_the_tenant_text():
    key = record_key("p:", SCOPE, HASH)
    assert key.startswith("p:abc123:") and key.endswith(HASH.hex()) and "acme" not in key
    assert key != record_key("p:", KVScope("abc123", "globex"), HASH)
    assert key != record_key("p:", KVScope("abc124", "acme"), HASH)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: KVScope("", "t").validate(),
        lambda: KVScope("v 1", "t").validate(),
        lambda: KVScope("v1", "x" * 300).validate(),
        lambda: KVLayout("int8", (2, 2, 4, 16, 8), 2, 16).validate(),
        lambda: KVLayout("float32", (2, 0, 4, 16, 8), 2, 16).validate(),
        lambda: KVLayout("float32", (2, 2, 4, 16, 8), 3, 16).validate(),
        lambda: KVLayout("float32", (2, 2, 4, 16, 8), 2, 5).validate(),
        lambda: LAYOUT.validate(max_block_bytes=100),
        lambda: header(size=10).validate(),
        lambda: header(block_hash=b"short").validate(),
        lambda: check_block_hashes([HASH] * 5, max_blocks=4),
        lambda: check_block_hashes([b"x" * 32], max_blocks=4),
    ],
)
def test_bad_input_is_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        bad()


def test_put_stream_is_chunked_below_the_limit():
    blocks = [PutBlock(i, bytes([i]) * 16, PAYLOAD, zlib.crc32(PAYLOAD)) for i in range(3)]
    messages = list(put_messages(SCOPE, LAYOUT, blocks, 60, chunk_bytes=1000))
    assert messages[0].HasField("open") and messages[0].open.ttl_s == 60
    assert not any(m.HasField("open") for m in messages[1:])
    assert all(len(m.data) <= 1000 and m.ByteSize() < 1200 for m in messages)
    unpacker = Unpacker(lambda h: h.size, max_blocks=10)
    got = [(h, bytes(b)) for m in messages for h, b in unpacker.feed(m.headers, m.data)]
    assert unpacker.pending() is None
    assert [h.block_index for h, _ in got] == [0, 1, 2] and all(b == PAYLOAD for _, b in got)


@pytest.mark.parametrize("sizes, chunk", [([100] * 7, 256), ([1000], 256), ([10, 500, 3], 64), ([256] * 3, 256)])
def test_framing_packs_small_blocks_and_splits_large_ones(sizes, chunk):
    blocks = [(f"h{i}", bytes([i]) * n) for i, n in enumerate(sizes)]
    messages = list(pack(blocks, chunk))
    assert all(len(data) <= chunk for _h, data in messages)
    assert len(messages) == -(-sum(sizes) // chunk)  # as few messages as the bytes need
    unpacker = Unpacker(lambda h: sizes[int(h[1:])], max_blocks=10)
    got = [(h, bytes(b)) for headers, data in messages for h, b in unpacker.feed(headers, data)]
    assert got == blocks and unpacker.pending() is None


def test_framing_rules_are_enforced():
    unpacker = Unpacker(lambda h: 10, max_blocks=2)
    with pytest.raises(InvalidArgument, match="header"):
        unpacker.feed([], b"x")
    unpacker = Unpacker(lambda h: 10, max_blocks=2)
    assert unpacker.feed(["a"], b"12345") == []
    assert "5 of 10" in unpacker.pending()
    with pytest.raises(InvalidArgument, match="header"):
        unpacker.feed([], b"1234567890")  # overruns the only announced block
    with pytest.raises(InvalidArgument, match="at most 2"):
        Unpacker(lambda h: 10, max_blocks=2).feed(["a", "b", "c"], b"")
