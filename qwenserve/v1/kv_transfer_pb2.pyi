from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("handoff_id", "chunk_bytes", "handoff_token")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TOKEN_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    chunk_bytes: int
    handoff_token: str
    def __init__(self, handoff_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., handoff_token: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handoff_id", "reason", "handoff_token")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TOKEN_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    reason: str
    handoff_token: str
    def __init__(self, handoff_id: _Optional[str] = ..., reason: _Optional[str] = ..., handoff_token: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
