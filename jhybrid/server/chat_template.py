"""The model's chat template, rendered with jinja2 the way HF transformers' `apply_chat_template` does.

Where it comes from, first found wins: an explicit template (`--chat-template FILE_OR_TEXT`),
`chat_template.jinja` in the checkpoint, `tokenizer_config.json["chat_template"]` (a string, or HF's list
of `{"name", "template"}` where "default" is used, and "tool_use" when the request has tools, as HF picks
them). A checkpoint with none gets `None`; the server then
answers chat requests with a 400.

Rendering matches HF: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
loopcontrols extension, a `tojson` filter that keeps non-ASCII, `raise_exception` and `strftime_now`
helpers, and `messages`, `tools` and `documents` (None unless given), `add_generation_prompt`, `bos_token`,
`eos_token` (and the other special tokens of tokenizer_config.json) as variables. The rendered text already holds the special tokens, so callers
tokenize it with `add_special_tokens=False`.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (`raise_exception`) or failed to render."""


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: str | os.PathLike, override: str | None = None) -> "ChatTemplate | None":
    """The checkpoint's chat template, or `override` (a file path or the template text itself)."""
    model_dir = os.fspath(model_dir)
    tok_cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    source = tool_use = None
    if override:
        if os.path.isfile(override):
            with open(override) as f:
                source = f.read()
        elif "{" in override:
            source = override
        else:
            raise ValueError(f"--chat-template {override!r} is neither a file nor a jinja template")
    elif os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        with open(os.path.join(model_dir, "chat_template.jinja")) as f:
            source = f.read()
    else:
        source = tok_cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
            tool_use = named.get("tool_use")
    if not source:
        return None
    special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    special = {k: v for k, v in special.items() if v is not None}
    return ChatTemplate(source, special, tool_use=ChatTemplate(tool_use, special) if tool_use else None)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *,
                 tool_use: "ChatTemplate | None" = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.tool_use = tool_use  # the checkpoint's "tool_use" template, for requests with tools

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt, as HF's `apply_chat_template(messages, tools=tools, documents=documents, tokenize=False,
        add_generation_prompt=..., **kwargs)` renders it."""
        if tools is not None and self.tool_use is not None:
            return self.tool_use.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        documents=documents, **kwargs)
        variables = {**self.special_tokens, **kwargs, "messages": messages, "tools": tools, "documents": documents,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2.TemplateError, or a template tripping over unexpected message fields
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None
