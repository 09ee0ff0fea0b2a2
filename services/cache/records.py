"""The byte format of one stored block, and the checks that make a bad entry a miss.

    b"BKV1" | u32 header length | header (JSON) | u32 CRC-32 of the header | block bytes

The header names the model version, the tenant (as a tag), the block hash and index, the
layout and the CRC-32 of the block bytes. Reading verifies both checksums, the length and
that the header is the one the asker expects; any failure raises RecordMiss with a reason,
so a corrupt, partial or foreign entry is never served.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass

from services.cache.types import BlockHeader, KVLayout, KVScope

MAGIC = b"BKV1"
_U32 = struct.Struct("<I")


class RecordMiss(Exception):
    """A stored entry cannot be served. `reason`: corrupt, partial or mismatch."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def tenant_tag(tenant: str) -> str:
    # Keys carry a digest, not the tenant itself, so any tenant string makes a safe key.
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


def record_key(prefix: str, scope: KVScope, block_hash: bytes) -> str:
    return f"{prefix}{scope.model_version}:{tenant_tag(scope.tenant)}:{block_hash.hex()}"


def scope_pattern(prefix: str, scope: KVScope | None = None) -> str:
    """A SCAN pattern for every block of `scope` (or every block)."""
    if scope is None:
        return f"{prefix}*"
    return f"{prefix}{scope.model_version}:{tenant_tag(scope.tenant)}:*"


def encode_record(scope: KVScope, header: BlockHeader, payload: bytes | memoryview) -> bytes:
    meta = json.dumps(
        {
            "model_version": scope.model_version,
            "tenant": tenant_tag(scope.tenant),
            "block_hash": header.block_hash.hex(),
            "block_index": header.block_index,
            "layout": header.layout.to_dict(),
            "size": header.size,
            "crc32": header.crc32,
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()
    return b"".join((MAGIC, _U32.pack(len(meta)), meta, _U32.pack(zlib.crc32(meta)), payload))


@dataclass(frozen=True)
class Record:
    header: BlockHeader
    # The block bytes, a view into the stored value (no copy).
    payload: memoryview


def decode_record(
    raw: bytes, scope: KVScope, block_hash: bytes, block_index: int, layout: KVLayout | None = None
) -> Record:
    """The verified record, or RecordMiss. `layout` None accepts any valid layout."""
    view = memoryview(raw)
    if len(view) < len(MAGIC) + 8 or bytes(view[:4]) != MAGIC:
        raise RecordMiss("corrupt", "bad magic or too short")
    (meta_len,) = _U32.unpack_from(view, 4)
    meta_end = 8 + meta_len
    if meta_end + 4 > len(view):
        raise RecordMiss("partial", "header cut short")
    meta = view[8:meta_end]
    (meta_crc,) = _U32.unpack_from(view, meta_end)
    if zlib.crc32(meta) != meta_crc:
        raise RecordMiss("corrupt", "header checksum")
    try:
        fields = json.loads(bytes(meta))
        header = BlockHeader(
            bytes.fromhex(fields["block_hash"]),
            int(fields["block_index"]),
            KVLayout.from_dict(fields["layout"]),
            int(fields["size"]),
            int(fields["crc32"]),
        )
        stored_version, stored_tenant = fields["model_version"], fields["tenant"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordMiss("corrupt", f"header unreadable: {exc}") from None
    if (
        stored_version != scope.model_version
        or stored_tenant != tenant_tag(scope.tenant)
        or header.block_hash != block_hash
        or header.block_index != block_index
    ):
        raise RecordMiss("mismatch", "entry belongs to another model version, tenant or position")
    if layout is not None and header.layout != layout:
        raise RecordMiss("mismatch", f"layout {header.layout} is not the asked {layout}")
    payload = view[meta_end + 4 :]
    if len(payload) != header.size:
        reason = "partial" if len(payload) < header.size else "corrupt"
        raise RecordMiss(reason, f"{len(payload)} bytes where the header says {header.size}")
    if zlib.crc32(payload) != header.crc32:
        raise RecordMiss("corrupt", "block checksum")
    return Record(header, payload)
