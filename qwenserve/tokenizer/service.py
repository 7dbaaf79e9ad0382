"""The tokenizer stage's work, free of gRPC: Tokenize, TokenizeBatch and CountTokens requests in, answers out.

A caller's mistake (nothing to tokenize, too large, invalid UTF-8, unknown roles, a template that refuses
the conversation) raises InvalidInput naming the field, or ChatTemplateError; `invalid_input_detail` is
what the service edge (`qwenserve_services.tokenizer.server`) sends for it as INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any

from qwenserve.rpc_errors import error_detail
from qwenserve.tokenizer.builtin import BuiltinVocab
from qwenserve.tokenizer.errors import ChatTemplateError, InvalidInput
from qwenserve.tokenizer.hygiene import (
    InputLimits,
    clean_messages,
    clean_text,
    decode_utf8,
    parse_json_object,
)
from qwenserve.tokenizer.tokenizer import Tokenizer
from qwenserve.v1 import common_pb2, tokenizer_pb2

# Template variables the service sets itself; chat_template_kwargs_json may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def load_tokenizer(model: str | None, vocab: str) -> Tokenizer:
    """The checkpoint's tokenizer, or without a model the built-in vocabulary `vocab`."""
    if model:
        return Tokenizer.from_dir(model)
    return Tokenizer.builtin(BuiltinVocab.from_name(vocab))


class TokenizerService:
    """Answers the Tokenizer RPCs' requests with `tokenizer`, within `limits`."""

    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, where: str = "request"
    ) -> tokenizer_pb2.TokenizeResponse:
        """Encode text, UTF-8 bytes or a chat (rendered with the chat template), truncated as asked."""
        kind = request.WhichOneof("input")
        rendered = ""
        if kind is None:
            raise InvalidInput(where, "has no input; set one of text, text_bytes or chat")
        if kind == "chat":
            rendered = self.render_chat(request.chat, f"{where}.chat")
            ids = self.tokenizer.encode(rendered)
        else:
            raw = request.text if kind == "text" else decode_utf8(request.text_bytes, f"{where}.text_bytes")
            if not raw:
                raise InvalidInput(f"{where}.{kind}", "is empty; there is nothing to tokenize")
            ids = self.tokenizer.encode(clean_text(raw, f"{where}.{kind}", self.limits.max_text_bytes))
        count = len(ids)
        limit = request.max_length
        if limit and count > limit:
            if request.reject_if_longer:
                raise InvalidInput(f"{where}.max_length", f"the input is {count} tokens, more than {limit}")
            ids = (
                ids[-limit:] if request.truncation_side == tokenizer_pb2.TRUNCATION_SIDE_LEFT else ids[:limit]
            )
        return tokenizer_pb2.TokenizeResponse(
            ids=ids, count=count, truncated=len(ids) < count, rendered=rendered
        )

    def tokenize_batch(
        self, request: tokenizer_pb2.TokenizeBatchRequest
    ) -> tokenizer_pb2.TokenizeBatchResponse:
        """Each request as `tokenize` answers it; the first bad one fails the batch."""
        self.check_batch(len(request.requests), "requests")
        return tokenizer_pb2.TokenizeBatchResponse(
            responses=[self.tokenize(r, f"requests[{i}]") for i, r in enumerate(request.requests)]
        )

    def count_tokens(self, request: tokenizer_pb2.CountTokensRequest) -> tokenizer_pb2.CountTokensResponse:
        """The token count of each text, and their total."""
        self.check_batch(len(request.texts), "texts")
        limit = self.limits.max_text_bytes
        texts = [clean_text(t, f"texts[{i}]", limit) for i, t in enumerate(request.texts)]
        counts = [len(ids) for ids in self.tokenizer.encode_batch(texts)]
        return tokenizer_pb2.CountTokensResponse(counts=counts, total=sum(counts))

    def info(self) -> tokenizer_pb2.TokenizerInfo:
        """The vocabulary's size, special and end-of-sequence tokens, chat template and input limit."""
        template = self.tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default", "")
        return tokenizer_pb2.TokenizerInfo(
            vocab_size=self.tokenizer.vocab_size,
            special_tokens=self.tokenizer.special_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            chat_template=template or "",
            max_input_bytes=self.limits.max_text_bytes,
        )

    def check_batch(self, size: int, field: str) -> None:
        """Raises InvalidInput for an empty batch or one over the limit."""
        if size == 0:
            raise InvalidInput(field, "is empty; send at least one input")
        if size > self.limits.max_batch:
            raise InvalidInput(field, f"has {size} inputs, more than the limit of {self.limits.max_batch}")

    def render_chat(self, chat: common_pb2.ChatInput, where: str) -> str:
        """The conversation through the chat template, followed by the answer's forced start."""
        messages: list[dict[str, Any]] = []
        for i, m in enumerate(chat.messages):
            message: dict[str, Any] = {"role": m.role, "content": m.content}
            for key in ("name", "tool_call_id", "reasoning_content"):
                if value := getattr(m, key):
                    message[key] = value
            if m.tool_calls_json:
                message["tool_calls"] = [
                    parse_json_object(raw, f"{where}.messages[{i}].tool_calls_json[{j}]")
                    for j, raw in enumerate(m.tool_calls_json)
                ]
            messages.append(message)
        try:
            messages = clean_messages(messages, self.limits)
        except InvalidInput as err:
            raise InvalidInput(f"{where}.{err.field}", err.message) from None
        if len(chat.tools_json) > self.limits.max_tools:
            raise InvalidInput(f"{where}.tools_json", f"has more than {self.limits.max_tools} tools")
        tools = [parse_json_object(raw, f"{where}.tools_json[{i}]") for i, raw in enumerate(chat.tools_json)]
        kwargs: dict[str, Any] = {}
        if chat.chat_template_kwargs_json:
            kwargs = parse_json_object(chat.chat_template_kwargs_json, f"{where}.chat_template_kwargs_json")
            if reserved := RESERVED_TEMPLATE_VARIABLES & kwargs.keys():
                raise InvalidInput(
                    f"{where}.chat_template_kwargs_json",
                    f"may not set {', '.join(sorted(reserved))}; use the fields",
                )
        if chat.HasField("enable_thinking"):
            kwargs["enable_thinking"] = chat.enable_thinking
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=chat.add_generation_prompt, **kwargs
        )
        return rendered + chat.assistant_prefix  # the answer's forced start, which the model continues

    def warm_up(self) -> None:
        """Compile the chat template and touch the encoder (before health says SERVING)."""
        self.tokenizer.encode("warm-up: hello, 你好 👋")
        if self.tokenizer.chat_template:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def invalid_input_detail(err: InvalidInput | ChatTemplateError) -> common_pb2.ErrorDetail:
    """A caller's mistake as an ErrorDetail: `invalid_argument` naming its field, or `chat_template_error`."""
    if isinstance(err, InvalidInput):
        return error_detail("invalid_argument", str(err), field=err.field)
    return error_detail("chat_template_error", str(err))
