from qwenserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_SIDE_UNSPECIFIED: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_RIGHT: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_LEFT: _ClassVar[TruncationSide]
TRUNCATION_SIDE_UNSPECIFIED: TruncationSide
TRUNCATION_SIDE_RIGHT: TruncationSide
TRUNCATION_SIDE_LEFT: TruncationSide

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "text_bytes", "chat", "add_special_tokens", "max_length", "truncation_side", "reject_if_longer")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    REJECT_IF_LONGER_FIELD_NUMBER: _ClassVar[int]
    text: str
    text_bytes: bytes
    chat: _common_pb2.ChatInput
    add_special_tokens: bool
    max_length: int
    truncation_side: TruncationSide
    reject_if_longer: bool
    def __init__(self, text: _Optional[str] = ..., text_bytes: _Optional[bytes] = ..., chat: _Optional[_Union[_common_pb2.ChatInput, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., max_length: _Optional[int] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ..., reject_if_longer: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "count", "truncated", "rendered")
    IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    RENDERED_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    truncated: bool
    rendered: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., truncated: _Optional[bool] = ..., rendered: _Optional[str] = ...) -> None: ...

class TokenizeBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[TokenizeRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[TokenizeRequest, _Mapping]]] = ...) -> None: ...

class TokenizeBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[TokenizeResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[TokenizeResponse, _Mapping]]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("counts", "total")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    total: int
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., total: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("ids", "skip_special_tokens", "flush")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    flush: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., flush: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("vocab_size", "special_tokens", "eos_token_ids", "chat_template", "max_input_bytes")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    special_tokens: _containers.ScalarMap[str, int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: str
    max_input_bytes: int
    def __init__(self, vocab_size: _Optional[int] = ..., special_tokens: _Optional[_Mapping[str, int]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[str] = ..., max_input_bytes: _Optional[int] = ...) -> None: ...
