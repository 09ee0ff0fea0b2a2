import datetime

from ballast.v1 import common_pb2 as _common_pb2
from ballast.v1 import backfill_answers_pb2 as _backfill_answers_pb2
from ballast.v1 import inference_pb2 as _inference_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union
from ballast.v1.backfill_answers_pb2 import SubscribeRequest as SubscribeRequest
from ballast.v1.backfill_answers_pb2 import GetAnswerRequest as GetAnswerRequest
from ballast.v1.backfill_answers_pb2 import BackfilledAnswer as BackfilledAnswer

DESCRIPTOR: _descriptor.FileDescriptor

class DegradedRequest(_message.Message):
    __slots__ = ("ticket", "tenant", "session_id", "request", "tier", "level", "reason", "degraded_text", "degraded_by", "received_at", "degraded_at", "origin")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_BY_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_AT_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    tenant: str
    session_id: str
    request: _inference_pb2.GenerateRequest
    tier: _common_pb2.Tier
    level: _common_pb2.DegradationLevel
    reason: str
    degraded_text: str
    degraded_by: str
    received_at: _timestamp_pb2.Timestamp
    degraded_at: _timestamp_pb2.Timestamp
    origin: str
    def __init__(self, ticket: _Optional[str] = ..., tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., level: _Optional[_Union[_common_pb2.DegradationLevel, str]] = ..., reason: _Optional[str] = ..., degraded_text: _Optional[str] = ..., degraded_by: _Optional[str] = ..., received_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., degraded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., origin: _Optional[str] = ...) -> None: ...
