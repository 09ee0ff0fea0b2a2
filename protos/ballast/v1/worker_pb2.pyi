from ballast.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "session_id", "prompt_ids", "generated_ids", "sampling", "response_format", "tier", "flush_interval_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    response_format: str
    tier: _common_pb2.Tier
    flush_interval_ms: int
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., generated_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., response_format: _Optional[str] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., flush_interval_ms: _Optional[int] = ...) -> None: ...

class WorkerFinished(_message.Message):
    __slots__ = ("reason", "usage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    def __init__(self, reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class WorkerGenerateEvent(_message.Message):
    __slots__ = ("tokens", "finished")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.Tokens
    finished: WorkerFinished
    def __init__(self, tokens: _Optional[_Union[_common_pb2.Tokens, _Mapping]] = ..., finished: _Optional[_Union[WorkerFinished, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "model_version", "max_context", "tokenizer_json", "chat_template", "bos_token", "eos_token", "eos_token_ids", "worker_id", "pool")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: str
    max_context: int
    tokenizer_json: bytes
    chat_template: str
    bos_token: str
    eos_token: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    worker_id: str
    pool: str
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[str] = ..., max_context: _Optional[int] = ..., tokenizer_json: _Optional[bytes] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., worker_id: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class RelayActions(_message.Message):
    __slots__ = ("actions",)
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[RelayAction]
    def __init__(self, actions: _Optional[_Iterable[_Union[RelayAction, _Mapping]]] = ...) -> None: ...

class RelayAction(_message.Message):
    __slots__ = ("stream_id", "start", "cancel", "confirm")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    start: RelayStart
    cancel: RelayCancel
    confirm: RelayConfirm
    def __init__(self, stream_id: _Optional[int] = ..., start: _Optional[_Union[RelayStart, _Mapping]] = ..., cancel: _Optional[_Union[RelayCancel, _Mapping]] = ..., confirm: _Optional[_Union[RelayConfirm, _Mapping]] = ...) -> None: ...

class RelayStart(_message.Message):
    __slots__ = ("request", "timeout_ms", "traceparent", "tracestate", "confirm_accepted")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    request: WorkerGenerateRequest
    timeout_ms: int
    traceparent: str
    tracestate: str
    confirm_accepted: bool
    def __init__(self, request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., confirm_accepted: _Optional[bool] = ...) -> None: ...

class RelayCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayConfirm(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayEvents(_message.Message):
    __slots__ = ("events", "engine")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[RelayEvent]
    engine: EngineProgress
    def __init__(self, events: _Optional[_Iterable[_Union[RelayEvent, _Mapping]]] = ..., engine: _Optional[_Union[EngineProgress, _Mapping]] = ...) -> None: ...

class EngineProgress(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class RelayEvent(_message.Message):
    __slots__ = ("stream_id", "accepted", "tokens", "finished", "error")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    accepted: RelayAccepted
    tokens: _common_pb2.Tokens
    finished: WorkerFinished
    error: RelayError
    def __init__(self, stream_id: _Optional[int] = ..., accepted: _Optional[_Union[RelayAccepted, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tokens, _Mapping]] = ..., finished: _Optional[_Union[WorkerFinished, _Mapping]] = ..., error: _Optional[_Union[RelayError, _Mapping]] = ...) -> None: ...

class RelayAccepted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayError(_message.Message):
    __slots__ = ("code", "message", "reason", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...
