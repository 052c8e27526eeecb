"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` make of its output.

- `"none"` (the default without tools): the tools still reach the chat template; the output is text, unparsed.
- `"auto"` (the default with tools): the server's parser (`--tool-call-parser`, `tool_parsers.py`) finds the
  calls the model chose to write; needs `--enable-auto-tool-choice`, else 400 (as vLLM answers).
- `"required"` and a named function (`{"type": "function", "function": {"name": N}}`): enforced by structured
  output, the model constrained to `required_schema` (a JSON array of `{"name", "parameters"}`, at least one,
  at most one with `parallel_tool_calls: false`) or to `N`'s parameters schema, and the output read by
  `ConstrainedCalls`. Such a request cannot also carry `response_format` / `structured_outputs` (400).

    plan = tool_plan(req, enable_auto=True, parser="hermes")   # None: no parsing
    stream = plan.new_stream()                                 # per choice: feed(text) / finish() -> deltas
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from jhybrid.server.protocol import APIError, ChatCompletionRequest
from jhybrid.server.tool_parsers import PARSERS, new_call_id

log = logging.getLogger("jhybrid.server")

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's parameters schema (an object with no properties when the tool has none)."""
    return parameters if parameters is not None else EMPTY_PARAMETERS


def required_schema(tools: dict[str, dict[str, Any] | None], *, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"`: an array of at least one call, each `{"name": one of the
    tools, "parameters": that tool's arguments}` (at most one call when `parallel` is False)."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters_schema(params)},
              "required": ["name", "parameters"]} for name, params in tools.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: dict[str, dict[str, Any] | None], name: str) -> dict[str, Any]:
    """The JSON schema of a named tool_choice: that function's arguments."""
    return parameters_schema(tools[name])


class ConstrainedCalls:
    """The output of a constrained request as tool calls, with the parser interface (`feed` / `finish` ->
    deltas). A named function's output is its arguments: the call's header goes first, then each piece of text
    as an arguments fragment (JSON by the constraint, unless max_tokens cut it: finish_reason "length" says so).
    "required"'s array is read at the end; output that is not such an array (cut off) comes back as text."""

    def __init__(self, name: str | None):
        self.name, self.num_calls = name, 0
        self._text = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        if self.name is None or not text:
            return []
        out = []
        if self.num_calls == 0:
            self.num_calls = 1
            out.append({"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                        "function": {"name": self.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def finish(self) -> list[dict[str, Any]]:
        if self.name is not None:
            return []
        try:
            calls = json.loads(self._text)
            if not (isinstance(calls, list) and calls and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                               and isinstance(c.get("parameters", {}), dict)
                                                               for c in calls)):
                raise ValueError("not a non-empty array of {name, parameters}")
        except ValueError as e:
            log.warning('tool_choice "required": the output is not an array of calls (%s); returned as text', e)
            return [{"content": self._text}] if self._text else []
        out = []
        for index, call in enumerate(calls):
            self.num_calls += 1
            out.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                        "function": {"name": call["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {
                "arguments": json.dumps(call.get("parameters", {}), ensure_ascii=False)}}]})
        return out


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one chat request's output is read. `mode`: "auto" | "required" | "named"."""

    mode: str
    tools: dict[str, dict[str, Any] | None]
    parser: str | None = None
    name: str | None = None
    parallel: bool = True
    schema: dict[str, Any] | None = None  # "required" / "named": the JSON schema the output is constrained to

    def new_stream(self):
        if self.mode == "auto":
            return PARSERS[self.parser](self.tools, max_calls=None if self.parallel else 1)
        return ConstrainedCalls(self.name)


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the client sent them, for the chat template (None without tools, as HF passes it)."""
    return [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None


def tool_plan(req: ChatCompletionRequest, *, enable_auto: bool, parser: str | None) -> ToolPlan | None:
    """The request's plan (None: the output is plain text); an APIError (400) when the server cannot honour it."""
    choice = req.effective_tool_choice
    if choice == "none":
        return None
    tools = {t.function.name: t.function.parameters for t in req.tools}
    if choice == "auto":
        if not enable_auto or parser is None:
            raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs a server started with '
                           "--enable-auto-tool-choice and --tool-call-parser NAME; or send tool_choice \"none\"",
                           param="tool_choice", code="unsupported_parameter")
        return ToolPlan("auto", tools, parser=parser, parallel=req.parallel_tool_calls)
    if (field := req.structured_output_field()) is not None:
        raise APIError(400, f"{field}: tool_choice {json.dumps(choice)} already constrains the output to tool calls; "
                       "send one or the other", param=field, code="invalid_value")
    if choice == "required":
        return ToolPlan("required", tools, parallel=req.parallel_tool_calls,
                        schema=required_schema(tools, parallel=req.parallel_tool_calls))
    name = choice["function"]["name"]
    return ToolPlan("named", tools, name=name, schema=named_schema(tools, name))


__all__ = ["ConstrainedCalls", "ToolPlan", "named_schema", "required_schema", "template_tools", "tool_plan"]
