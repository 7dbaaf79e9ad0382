"""Chat templates rendered with jinja2 exactly the way `transformers`' `apply_chat_template` renders them.

Same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, the `{% generation %}` tag),
same globals (`raise_exception`, `strftime_now`, `dict`, `namespace`), the same `tojson` (no HTML
escaping, `ensure_ascii=False`), and the same variables: `messages`, `tools`, `documents`,
`add_generation_prompt`, the named special tokens (`bos_token`, `eos_token`, ...) and any extra
keyword (`enable_thinking`, ...), which wins over a special token of the same name.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qwenserve.tokenizer.errors import ChatTemplateError

# Where a message's reasoning may arrive; templates read `reasoning_content` (gpt-oss ones `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change what the model sees.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` inside templates, without exposing the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # A namespace that refuses underscore names, so templates cannot reach interpreter internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attributes ({name!r})")


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' jinja environment (cached by source)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(
            f"the chat template does not compile: {err.message} (line {err.lineno})"
        ) from None


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with the template `source`, as `apply_chat_template(..., tokenize=False)` would.

    `special_tokens` are the named tokens (`eos_token`, ...) the template may read; keyword
    arguments such as `enable_thinking=False` are passed to the template too and win over them.
    Raises ChatTemplateError when the template raises or fails.
    """
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    # Keys whose value is None are dropped, as transformers does (templates test presence, not None).
    chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
    variables = {**(special_tokens or {}), **kwargs}
    template = compile_template(source)
    try:
        return template.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused the conversation: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise ChatTemplateError(f"the chat template failed on this conversation: {err}") from None
