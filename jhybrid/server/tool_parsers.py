"""Tool-call parsers: a model's text -> OpenAI tool calls, streamed or whole. Names as vLLM's `--tool-call-parser`:

| name          | models                          | what the model writes                                                      |
|---------------|---------------------------------|----------------------------------------------------------------------------|
| `hermes`      | Qwen3, Qwen3-Next, Hermes       | `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one per call |
| `qwen3_coder` | Qwen3.5, Qwen3-Coder            | `<tool_call>\\n<function=N>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` |
| `minimax`     | MiniMax-M1, MiniMax-Text-01     | `<tool_calls>\\n{"name": N, "arguments": {...}}\\n...</tool_calls>`, a call per line |

`qwen3_coder` values are text; each is converted by its parameter's JSON-schema type in the request's tools
(integer, number, boolean, object and array parsed; `null` is None unless the type is string; a value that does
not convert stays a string). `minimax` ignores tags inside `<think>...</think>` (the model plans there).

One incremental machine serves both modes: `feed(text)` returns the stream deltas that text completes and
`finish()` the rest, and a whole response is one `feed` and `finish` gathered by `collect`, so a streamed
response says exactly what the non-streamed one would. The deltas are the `delta` objects of OpenAI's chat
chunks: `{"content": text}` for text outside the calls, then per call `{"tool_calls": [{"index", "id",
"type": "function", "function": {"name", "arguments": ""}}]}` and `{"tool_calls": [{"index", "function":
{"arguments": JSON text}}]}` (what the `openai` client's stream accumulators expect). A call is sent once its
block is complete and parsed, so a block that does not parse (or that the output cut off) comes back as text,
in both modes, never as half a call. Text that could begin a tag is held back until it cannot, and so is
whitespace that might touch a call: content is the text outside the calls less the whitespace next to them
(the text as is when there are none), None when nothing is left.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("jhybrid.server")


class ToolCallFormatError(ValueError):
    """A tool-call block that does not parse."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could be the beginning of one of `tags`."""
    return max((n for tag in tags for n in range(min(len(tag) - 1, len(text)), 0, -1)
                if text.endswith(tag[:n])), default=0)


class ToolCallParser:
    """Splits text into content and `start ... end` blocks, each turned into calls by `parse_block`.
    `tools`: {name: parameters JSON schema} of the request. `max_calls`: later calls are dropped
    (`parallel_tool_calls: false`)."""

    name = ""
    start = end = ""
    skip: tuple[str, str] | None = None  # a region whose tags are text (open, close)

    def __init__(self, tools: Mapping[str, Mapping[str, Any] | None] | None = None, max_calls: int | None = None):
        self.tools = dict(tools or {})
        self.max_calls = max_calls
        self.num_calls = 0
        self._buf = ""
        self._in_block = self._in_skip = False
        self._after_call = False  # the next text loses its leading whitespace

    def parse_block(self, body: str) -> list[tuple[str, dict[str, Any]]]:
        """(name, arguments) of the calls in one block's body; raises ToolCallFormatError."""
        raise NotImplementedError

    # ----------------------------------------------------------------- the machine
    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while self._buf:
            if self._in_block:
                i = self._buf.find(self.end)
                if i < 0:
                    break
                body, self._buf = self._buf[:i], self._buf[i + len(self.end):]
                self._in_block = False
                out += self._block(body, closed=True)
            elif self._in_skip:
                close = self.skip[1]
                i = self._buf.find(close)
                if i >= 0:
                    self._in_skip = False
                    out += self._text(self._buf[:i + len(close)])
                    self._buf = self._buf[i + len(close):]
                else:
                    keep = _held(self._buf, (close,))
                    out += self._text(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
            else:
                i = self._buf.find(self.start)
                j = self._buf.find(self.skip[0]) if self.skip else -1
                if j >= 0 and (i < 0 or j < i):
                    out += self._text(self._buf[:j + len(self.skip[0])])
                    self._buf, self._in_skip = self._buf[j + len(self.skip[0]):], True
                elif i >= 0:
                    out += self._text(self._buf[:i].rstrip())
                    self._buf, self._in_block = self._buf[i + len(self.start):], True
                else:
                    tags = (self.start,) + ((self.skip[0],) if self.skip else ())
                    safe = self._buf[:len(self._buf) - _held(self._buf, tags)]
                    safe = safe[:len(safe.rstrip())]  # trailing whitespace may touch a call
                    out += self._text(safe)
                    self._buf = self._buf[len(safe):]
                    break
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what `feed` held back; an unterminated block is parsed as if it were closed."""
        rest, self._buf = self._buf, ""
        if self._in_block:
            self._in_block = False
            return self._block(rest, closed=False)
        return self._text(rest)

    def _text(self, text: str) -> list[dict[str, Any]]:
        if self._after_call and not self._in_skip:
            text = text.lstrip()
        if not text:
            return []
        self._after_call = False
        return [{"content": text}]

    def _block(self, body: str, *, closed: bool) -> list[dict[str, Any]]:
        try:
            calls = self.parse_block(body)
            if not calls:
                raise ToolCallFormatError("the block holds no call")
        except (ToolCallFormatError, ValueError) as e:
            log.warning("%s tool parser: a block that does not parse is returned as text (%s)", self.name, e)
            raw = self.start + body + (self.end if closed else "")
            self._after_call = False
            return [{"content": raw}]
        out = []
        for name, arguments in calls:
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                log.info("%s tool parser: dropped a call of %r beyond parallel_tool_calls=false", self.name, name)
                continue
            index, self.num_calls = self.num_calls, self.num_calls + 1
            out.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index,
                                        "function": {"arguments": json.dumps(arguments, ensure_ascii=False)}}]})
        self._after_call = True
        return out


def _json_call(text: str) -> tuple[str, dict[str, Any]]:
    """`{"name": N, "arguments": {...}}` (arguments may also be a JSON string of an object, or absent)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallFormatError(f"not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallFormatError(f'expected {{"name": ..., "arguments": {{...}}}}, got {text[:80]!r}')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallFormatError(f"arguments are a string that is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolCallFormatError(f"arguments must be a JSON object, got {type(args).__name__}")
    return obj["name"], args


class HermesParser(ToolCallParser):
    name, start, end = "hermes", "<tool_call>", "</tool_call>"

    def parse_block(self, body):
        return [_json_call(body.strip())]


class MinimaxParser(ToolCallParser):
    name, start, end = "minimax", "<tool_calls>", "</tool_calls>"
    skip = ("<think>", "</think>")

    def parse_block(self, body):
        return [_json_call(line) for line in (raw.strip() for raw in body.splitlines()) if line]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class Qwen3CoderParser(ToolCallParser):
    name, start, end = "qwen3_coder", "<tool_call>", "</tool_call>"

    def parse_block(self, body):
        calls = []
        for fn in _FUNCTION.finditer(body):
            name = fn.group(1).strip()
            schema = self.tools.get(name) or {}
            properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            args = {}
            for p in _PARAMETER.finditer(fn.group(2)):
                value = p.group(2).removeprefix("\n").removesuffix("\n")
                key = p.group(1).strip()
                args[key] = convert_value(value, properties.get(key))
            calls.append((name, args))
        if not calls:
            raise ToolCallFormatError("no <function=NAME> in the block")
        return calls


def _schema_type(schema: Any) -> str | None:
    """The JSON-schema type a parameter's value is converted to (None: unknown, kept as text)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if isinstance(kind, str):
        return kind.strip().lower()
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            if (found := _schema_type(member)) not in (None, "null"):
                return found
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return "string"
    return None


def convert_value(text: str, schema: Any) -> Any:
    """A `qwen3_coder` parameter's text as its schema's type; text it cannot convert stays text."""
    kind = _schema_type(schema)
    if kind in (None, "string"):
        return text
    stripped = text.strip()
    if stripped.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(stripped)
        if kind == "number":
            number = float(stripped)
            return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", stripped) else number
        if kind == "boolean":
            if stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            raise ValueError(stripped)
        if kind in ("object", "array"):
            try:
                return json.loads(stripped)
            except json.JSONDecodeError:
                return ast.literal_eval(stripped)  # Python literals: {'a': 1}, [True]
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    log.info("qwen3_coder tool parser: %r is not a %s; kept as text", text[:80], kind)
    return text


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Qwen3CoderParser, MinimaxParser)}


def collect(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole response from its stream deltas, as a client accumulates them."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            call["function"]["name"] += part.get("function", {}).get("name", "")
            call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
    if not calls:
        return content, []
    return content or None, [calls[i] for i in sorted(calls)]


__all__ = ["PARSERS", "ToolCallFormatError", "ToolCallParser", "collect", "convert_value", "new_call_id"]
