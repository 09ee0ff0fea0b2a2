from ballast.v1 import backfill_answers_pb2 as _backfill_answers_pb2
from ballast.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ClientSignals(_message.Message):
    __slots__ = ("platform", "regenerate", "business_tag")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    REGENERATE_FIELD_NUMBER: _ClassVar[int]
    BUSINESS_TAG_FIELD_NUMBER: _ClassVar[int]
    platform: str
    regenerate: bool
    business_tag: str
    def __init__(self, platform: _Optional[str] = ..., regenerate: _Optional[bool] = ..., business_tag: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "conversation", "prompt", "model", "sampling", "tier", "signals", "response_format", "allow_degraded", "context", "flush_interval_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    conversation: Conversation
    prompt: str
    model: str
    sampling: _common_pb2.SamplingParams
    tier: _common_pb2.Tier
    signals: ClientSignals
    response_format: str
    allow_degraded: bool
    context: ContextOptions
    flush_interval_ms: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., conversation: _Optional[_Union[Conversation, _Mapping]] = ..., prompt: _Optional[str] = ..., model: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., signals: _Optional[_Union[ClientSignals, _Mapping]] = ..., response_format: _Optional[str] = ..., allow_degraded: _Optional[bool] = ..., context: _Optional[_Union[ContextOptions, _Mapping]] = ..., flush_interval_ms: _Optional[int] = ...) -> None: ...

class ContextOptions(_message.Message):
    __slots__ = ("policy", "max_turns")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    max_turns: int
    def __init__(self, policy: _Optional[str] = ..., max_turns: _Optional[int] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("request_id", "tier", "tier_reason", "model", "model_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIER_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: _common_pb2.Tier
    tier_reason: str
    model: str
    model_version: str
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., tier_reason: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage", "degradation", "backfill_ticket", "structured_status", "structured_repairs", "resumes", "dropped_messages", "structured_output", "structured_errors")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DEGRADATION_FIELD_NUMBER: _ClassVar[int]
    BACKFILL_TICKET_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_STATUS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_REPAIRS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_ERRORS_FIELD_NUMBER: _ClassVar[int]
    reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    degradation: _common_pb2.DegradationLevel
    backfill_ticket: str
    structured_status: _common_pb2.StructuredStatus
    structured_repairs: _containers.RepeatedScalarFieldContainer[str]
    resumes: int
    dropped_messages: _containers.RepeatedScalarFieldContainer[int]
    structured_output: str
    structured_errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., degradation: _Optional[_Union[_common_pb2.DegradationLevel, str]] = ..., backfill_ticket: _Optional[str] = ..., structured_status: _Optional[_Union[_common_pb2.StructuredStatus, str]] = ..., structured_repairs: _Optional[_Iterable[str]] = ..., resumes: _Optional[int] = ..., dropped_messages: _Optional[_Iterable[int]] = ..., structured_output: _Optional[str] = ..., structured_errors: _Optional[_Iterable[str]] = ...) -> None: ...

class Resumed(_message.Message):
    __slots__ = ("next_index", "reason", "resumes")
    NEXT_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    next_index: int
    reason: str
    resumes: int
    def __init__(self, next_index: _Optional[int] = ..., reason: _Optional[str] = ..., resumes: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("started", "tokens", "finished", "resumed")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    started: Started
    tokens: _common_pb2.Tokens
    finished: Finished
    resumed: Resumed
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tokens, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., resumed: _Optional[_Union[Resumed, _Mapping]] = ...) -> None: ...
