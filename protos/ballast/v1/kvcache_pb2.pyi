from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVScope(_message.Message):
    __slots__ = ("model_version", "tenant")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    tenant: str
    def __init__(self, model_version: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "shape", "layers", "block_tokens")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    layers: int
    block_tokens: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., layers: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class KVBlockHeader(_message.Message):
    __slots__ = ("block_hash", "block_index", "layout", "size", "crc32")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    block_index: int
    layout: KVLayout
    size: int
    crc32: int
    def __init__(self, block_hash: _Optional[bytes] = ..., block_index: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., size: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVPutOpen(_message.Message):
    __slots__ = ("scope", "ttl_s")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    scope: KVScope
    ttl_s: int
    def __init__(self, scope: _Optional[_Union[KVScope, _Mapping]] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class KVPutRequest(_message.Message):
    __slots__ = ("open", "headers", "data")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    open: KVPutOpen
    headers: _containers.RepeatedCompositeFieldContainer[KVBlockHeader]
    data: bytes
    def __init__(self, open: _Optional[_Union[KVPutOpen, _Mapping]] = ..., headers: _Optional[_Iterable[_Union[KVBlockHeader, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVPutReply(_message.Message):
    __slots__ = ("stored_blocks", "stored_bytes", "rejected_blocks")
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    stored_blocks: int
    stored_bytes: int
    rejected_blocks: int
    def __init__(self, stored_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., rejected_blocks: _Optional[int] = ...) -> None: ...

class KVGetRequest(_message.Message):
    __slots__ = ("scope", "block_hashes", "layout")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    scope: KVScope
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: KVLayout
    def __init__(self, scope: _Optional[_Union[KVScope, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class KVGetReply(_message.Message):
    __slots__ = ("headers", "data")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[KVBlockHeader]
    data: bytes
    def __init__(self, headers: _Optional[_Iterable[_Union[KVBlockHeader, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVLookupRequest(_message.Message):
    __slots__ = ("scope", "block_hashes")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    scope: KVScope
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, scope: _Optional[_Union[KVScope, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVLookupReply(_message.Message):
    __slots__ = ("cached_blocks",)
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    def __init__(self, cached_blocks: _Optional[int] = ...) -> None: ...

class KVDeleteRequest(_message.Message):
    __slots__ = ("scope", "block_hashes")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    scope: KVScope
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, scope: _Optional[_Union[KVScope, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVDeleteReply(_message.Message):
    __slots__ = ("deleted_blocks",)
    DELETED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    deleted_blocks: int
    def __init__(self, deleted_blocks: _Optional[int] = ...) -> None: ...

class KVStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStatsReply(_message.Message):
    __slots__ = ("blocks", "used_memory_bytes", "max_memory_bytes", "evicted_keys", "hits", "misses", "checksum_failures", "bytes_stored", "bytes_served", "redis_cluster")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    REDIS_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    used_memory_bytes: int
    max_memory_bytes: int
    evicted_keys: int
    hits: int
    misses: int
    checksum_failures: int
    bytes_stored: int
    bytes_served: int
    redis_cluster: RedisClusterHealth
    def __init__(self, blocks: _Optional[int] = ..., used_memory_bytes: _Optional[int] = ..., max_memory_bytes: _Optional[int] = ..., evicted_keys: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., bytes_served: _Optional[int] = ..., redis_cluster: _Optional[_Union[RedisClusterHealth, _Mapping]] = ...) -> None: ...

class RedisClusterHealth(_message.Message):
    __slots__ = ("state_ok", "slots_ok", "masters", "masters_reachable", "known_nodes")
    STATE_OK_FIELD_NUMBER: _ClassVar[int]
    SLOTS_OK_FIELD_NUMBER: _ClassVar[int]
    MASTERS_FIELD_NUMBER: _ClassVar[int]
    MASTERS_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_NODES_FIELD_NUMBER: _ClassVar[int]
    state_ok: bool
    slots_ok: int
    masters: int
    masters_reachable: int
    known_nodes: int
    def __init__(self, state_ok: _Optional[bool] = ..., slots_ok: _Optional[int] = ..., masters: _Optional[int] = ..., masters_reachable: _Optional[int] = ..., known_nodes: _Optional[int] = ...) -> None: ...
