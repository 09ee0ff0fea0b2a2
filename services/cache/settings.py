"""The `cache` section of ballast.yaml: the KV-cache store service's address and bounds."""

from __future__ import annotations

from pydantic import Field

from services.common.config import Section


class CacheConfig(Section):
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(50061, ge=0, le=65535, description="Port; 0 picks one.")
    key_prefix: str = Field("ballast:kv:", min_length=1, description="Prefix of every block key in Redis.")
    ttl_s: int = Field(3600, ge=1, description="TTL of a block unless Put asks less; reads refresh it.")
    max_ttl_s: int = Field(86400, ge=1, description="Longest TTL a Put may ask.")
    max_block_bytes: int = Field(16 << 20, ge=1, description="Largest block accepted (bytes).")
    max_blocks_per_call: int = Field(16384, ge=1, description="Most blocks one call may name.")
    chunk_bytes: int = Field(1 << 20, ge=4096, le=4 << 20, description="Largest data chunk in one Get message (bytes).")
    batch_bytes: int = Field(8 << 20, ge=1, description="Block bytes per Redis pipeline batch.")
