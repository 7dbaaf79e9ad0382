from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
    FINISH_REASON_CONTENT_FILTER: _ClassVar[FinishReason]

class KVTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KVTransport]
    KV_TRANSPORT_SHM: _ClassVar[KVTransport]
    KV_TRANSPORT_GRPC: _ClassVar[KVTransport]
    KV_TRANSPORT_MOONCAKE: _ClassVar[KVTransport]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
FINISH_REASON_CONTENT_FILTER: FinishReason
KV_TRANSPORT_UNSPECIFIED: KVTransport
KV_TRANSPORT_SHM: KVTransport
KV_TRANSPORT_GRPC: KVTransport
KV_TRANSPORT_MOONCAKE: KVTransport

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "logprobs", "top_logprobs", "structured", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    structured: StructuredOutput
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "ebnf", "reasoning_first")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIRST_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StringList
    ebnf: str
    reasoning_first: ReasoningFirst
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StringList, _Mapping]] = ..., ebnf: _Optional[str] = ..., reasoning_first: _Optional[_Union[ReasoningFirst, _Mapping]] = ...) -> None: ...

class ReasoningFirst(_message.Message):
    __slots__ = ("start_id", "end_id", "open_in_prompt")
    START_ID_FIELD_NUMBER: _ClassVar[int]
    END_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_IN_PROMPT_FIELD_NUMBER: _ClassVar[int]
    start_id: int
    end_id: int
    open_in_prompt: bool
    def __init__(self, start_id: _Optional[int] = ..., end_id: _Optional[int] = ..., open_in_prompt: _Optional[bool] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "total_tokens", "reasoning_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    total_tokens: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("code", "message", "field", "retryable")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    field: str
    retryable: bool
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., retryable: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls_json", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls_json: _containers.RepeatedScalarFieldContainer[str]
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[_Iterable[str]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "enable_thinking", "tools_json", "chat_template_kwargs_json", "tool_choice", "tool_choice_name", "assistant_prefix")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_NAME_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    enable_thinking: bool
    tools_json: _containers.RepeatedScalarFieldContainer[str]
    chat_template_kwargs_json: str
    tool_choice: str
    tool_choice_name: str
    assistant_prefix: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., enable_thinking: _Optional[bool] = ..., tools_json: _Optional[_Iterable[str]] = ..., chat_template_kwargs_json: _Optional[str] = ..., tool_choice: _Optional[str] = ..., tool_choice_name: _Optional[str] = ..., assistant_prefix: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("index", "id", "name", "arguments_json")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments_json: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "model_fingerprint", "linear_layers", "linear_conv_dim", "linear_conv_width", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim", "architecture_fingerprint", "weights")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LINEAR_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LINEAR_CONV_DIM_FIELD_NUMBER: _ClassVar[int]
    LINEAR_CONV_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LINEAR_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    LINEAR_KEY_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LINEAR_VALUE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str
    linear_layers: int
    linear_conv_dim: int
    linear_conv_width: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    architecture_fingerprint: str
    weights: str
    def __init__(self, dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., linear_layers: _Optional[int] = ..., linear_conv_dim: _Optional[int] = ..., linear_conv_width: _Optional[int] = ..., linear_value_heads: _Optional[int] = ..., linear_key_head_dim: _Optional[int] = ..., linear_value_head_dim: _Optional[int] = ..., architecture_fingerprint: _Optional[str] = ..., weights: _Optional[str] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("handoff_id", "transport", "layout", "num_tokens", "location", "offset", "length", "checksum", "lease_expires_unix_ms", "attributes", "control_endpoint")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    transport: KVTransport
    layout: KVLayout
    num_tokens: int
    location: str
    offset: int
    length: int
    checksum: str
    lease_expires_unix_ms: int
    attributes: _containers.ScalarMap[str, str]
    control_endpoint: str
    def __init__(self, handoff_id: _Optional[str] = ..., transport: _Optional[_Union[KVTransport, str]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., location: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ..., control_endpoint: _Optional[str] = ...) -> None: ...

class EngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("max_model_len", "kv_cache_tokens", "sends_headers_on_accept", "precision")
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SENDS_HEADERS_ON_ACCEPT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    kv_cache_tokens: int
    sends_headers_on_accept: bool
    precision: str
    def __init__(self, max_model_len: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., sends_headers_on_accept: _Optional[bool] = ..., precision: _Optional[str] = ...) -> None: ...
