"""Domain types of the KV-cache store (scope, layout, block header), their validation, and
their protobuf conversion, shared by the cache service and its clients.

Validation lives here so the service and a client agree on what a well-formed block is;
a malformed one raises InvalidArgument with a message naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ballast.v1 import kvcache_pb2
from services.common.errors import InvalidArgument

BLOCK_HASH_BYTES = 16
MAX_TENANT_BYTES = 256
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

_VERSION_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass(frozen=True)
class KVScope:
    """Whose blocks: the model version and the tenant."""

    model_version: str
    tenant: str

    def validate(self) -> "KVScope":
        if not _VERSION_RE.match(self.model_version):
            raise InvalidArgument("scope.model_version must be 1-128 characters of letters, digits, '.', '_' or '-'")
        if len(self.tenant.encode()) > MAX_TENANT_BYTES:
            raise InvalidArgument(f"scope.tenant is longer than {MAX_TENANT_BYTES} bytes")
        return self

    def to_pb(self) -> kvcache_pb2.KVScope:
        return kvcache_pb2.KVScope(model_version=self.model_version, tenant=self.tenant)

    @classmethod
    def from_pb(cls, pb: kvcache_pb2.KVScope) -> "KVScope":
        return cls(pb.model_version, pb.tenant).validate()


@dataclass(frozen=True)
class KVLayout:
    """How one block's bytes are laid out."""

    dtype: str
    shape: tuple[int, ...]
    layers: int
    block_tokens: int

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def validate(self, max_block_bytes: int | None = None) -> "KVLayout":
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"layout.dtype must be one of {sorted(DTYPE_SIZES)}, not {self.dtype!r}")
        if not self.shape or any(d <= 0 for d in self.shape) or len(self.shape) > 8:
            raise InvalidArgument("layout.shape must have 1 to 8 positive dimensions")
        if self.layers <= 0 or self.shape[0] != self.layers:
            raise InvalidArgument("layout.layers must be positive and equal shape[0]")
        if self.block_tokens <= 0 or self.block_tokens not in self.shape:
            raise InvalidArgument("layout.block_tokens must be positive and one of the shape's dimensions")
        if max_block_bytes is not None and self.block_bytes > max_block_bytes:
            raise InvalidArgument(
                f"a block of layout {self.shape} {self.dtype} is {self.block_bytes} bytes; "
                f"the store takes at most {max_block_bytes}"
            )
        return self

    def to_pb(self) -> kvcache_pb2.KVLayout:
        return kvcache_pb2.KVLayout(
            dtype=self.dtype, shape=list(self.shape), layers=self.layers, block_tokens=self.block_tokens
        )

    @classmethod
    def from_pb(cls, pb: kvcache_pb2.KVLayout) -> "KVLayout":
        return cls(pb.dtype, tuple(pb.shape), pb.layers, pb.block_tokens)

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "layers": self.layers,
            "block_tokens": self.block_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        return cls(
            str(data["dtype"]), tuple(int(d) for d in data["shape"]), int(data["layers"]), int(data["block_tokens"])
        )


@dataclass(frozen=True)
class BlockHeader:
    """What precedes a block's bytes on the wire and in the store."""

    block_hash: bytes
    block_index: int
    layout: KVLayout
    size: int
    crc32: int

    def validate(self, max_block_bytes: int | None = None) -> "BlockHeader":
        check_block_hash(self.block_hash, "header.block_hash")
        self.layout.validate(max_block_bytes)
        if self.size != self.layout.block_bytes:
            raise InvalidArgument(
                f"header.size is {self.size} but layout {self.layout.shape} {self.layout.dtype} "
                f"needs {self.layout.block_bytes} bytes"
            )
        if not 0 <= self.crc32 < 1 << 32:
            raise InvalidArgument("header.crc32 must be a 32-bit value")
        return self

    def to_pb(self) -> kvcache_pb2.KVBlockHeader:
        return kvcache_pb2.KVBlockHeader(
            block_hash=self.block_hash,
            block_index=self.block_index,
            layout=self.layout.to_pb(),
            size=self.size,
            crc32=self.crc32,
        )

    @classmethod
    def from_pb(cls, pb: kvcache_pb2.KVBlockHeader) -> "BlockHeader":
        return cls(bytes(pb.block_hash), pb.block_index, KVLayout.from_pb(pb.layout), pb.size, pb.crc32)


def check_block_hash(value: bytes, field: str = "block_hashes") -> bytes:
    if len(value) != BLOCK_HASH_BYTES:
        raise InvalidArgument(f"{field}: a block hash is {BLOCK_HASH_BYTES} bytes, got {len(value)}")
    return value


def check_block_hashes(values, max_blocks: int) -> list[bytes]:
    hashes = [bytes(v) for v in values]
    if len(hashes) > max_blocks:
        raise InvalidArgument(f"block_hashes: at most {max_blocks} per call, got {len(hashes)}")
    for h in hashes:
        check_block_hash(h)
    return hashes
