from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamCall(_message.Message):
    __slots__ = ("key", "caller", "params_json", "handle_token", "handle_epoch")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    key: str
    caller: str
    params_json: str
    handle_token: bytes
    handle_epoch: int
    def __init__(self, key: _Optional[str] = ..., caller: _Optional[str] = ..., params_json: _Optional[str] = ..., handle_token: _Optional[bytes] = ..., handle_epoch: _Optional[int] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("chunk", "complete", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    complete: Complete
    error: Error
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("ids", "text")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("reason", "worker_id", "stats_json", "handle")
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    worker_id: str
    stats_json: str
    handle: Handle
    def __init__(self, reason: _Optional[str] = ..., worker_id: _Optional[str] = ..., stats_json: _Optional[str] = ..., handle: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class Handle(_message.Message):
    __slots__ = ("token", "epoch")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    epoch: int
    def __init__(self, token: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
