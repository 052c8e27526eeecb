"""OpenAI request bodies (pydantic, strict types) and OpenAI-style errors.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`; validation failures are 400
with a message that starts with the offending field (`max_tokens: Input should be greater than 0`).
Every field is range-checked against what the engine can represent: integers that reach int32 arrays are
bounded, floats must be finite (NaN and Infinity are refused). Unknown fields are ignored, as OpenAI
clients send vendor fields freely, except those that would change the output (`UNSUPPORTED`, e.g.
`typical_p`, `guided_whitespace_pattern`): those answer 400 unless they hold their neutral value.
Structured output (`_GenerationRequest.structured_outputs_params`): OpenAI's `response_format` (`text`,
`json_object`, `json_schema`), vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object": ...}) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; at most one
of them per request; an invalid schema, regex or grammar is a 400 naming the field. Sampling controls: OpenAI's `presence_penalty`, `frequency_penalty` ([-2, 2]), `logit_bias`,
`n`, `best_of` and `seed`; vLLM's extensions `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `bad_words`,
`allowed_token_ids`, `include_stop_str_in_output`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`chat_template_kwargs`. Tools: `tools` (function tools, checked here), `tool_choice`, `parallel_tool_calls`, and
assistant `tool_calls` / `tool` messages in the history (`jhybrid.server.tools`). Fields a request leaves out
take the checkpoint's generation_config.json defaults (`jhybrid.server.app`). Log-probabilities: completions `logprobs` (0..20, with `echo` the
prompt's too; `max_tokens: 0` only with `echo`), chat `logprobs` + `top_logprobs` (0..20; `top_logprobs` without
`logprobs: true` is a 400, as OpenAI answers).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_ERROR_TYPES = {500: "server_error", 503: "server_error"}  # the rest: invalid_request_error

INT32_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's limit on `n`
MAX_LOGPROBS = 20  # OpenAI's limit on `logprobs` (completions) and `top_logprobs` (chat); the engine's too

# Fields other OpenAI-compatible servers accept that change the output, with their neutral values: present
# with another value, they answer 400 instead of being ignored.
UNSUPPORTED: dict[str, tuple] = {
    "typical_p": (None, 1.0),
    "length_penalty": (None, 1.0), "use_beam_search": (None, False),
    "prompt_logprobs": (None,), "guided_whitespace_pattern": (None,), "structural_tag": (None,),
    "truncate_prompt_tokens": (None,), "logits_processors": (None, []), "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]), "reasoning_effort": (None,),
    "verbosity": (None,), "web_search_options": (None,), "continue_final_message": (None, False),
}


class APIError(Exception):
    """An error answered as OpenAI does: HTTP `status` with `{"error": {...}}` (and `headers`, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming the field (`messages.0.role: ...`)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first["msg"].removeprefix("Invalid JSON: ")
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = [str(p) for p in first["loc"]]
    if not loc and first["type"] == "value_error":  # a check across fields: its message names the field first
        msg = first["msg"].removeprefix("Value error, ")
        return APIError(400, msg, param=msg.split(":", 1)[0], code="invalid_value")
    if not loc or first["type"] == "model_type":
        return APIError(400, "the request body must be a JSON object", code="invalid_request")
    # union members add type tags to the location (`prompt.str`); keep the path into the body only
    path = ".".join(p for p in loc if p.isdigit() or not any(c in p for c in "[]") and p not in _TYPE_TAGS)
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 and first["type"] != "missing" else ""
    if first["type"] == "missing":
        msg = "this field is required"
    return APIError(400, f"{path}: {msg}{more}", param=path, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="invalid_value")


# vLLM `structured_outputs` options besides the constraint, with the values this server's behaviour matches
# (JSON is always written without free whitespace and strict: no properties the schema does not name)
_STRUCTURED_NEUTRAL = {"disable_fallback": (None, False, True), "disable_any_whitespace": (None, True),
                       "disable_additional_properties": (None, True), "whitespace_pattern": (None,),
                       "structural_tag": (None,)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids (decimal integers as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("response_format")
    @classmethod
    def _format_type(cls, v):
        if v is not None and v.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be one of 'text', 'json_object', 'json_schema'; got {v.get('type')!r}")
        return v

    def structured_output_field(self) -> str | None:
        """The first field that asks for structured output (None: free text); cheap, the constraint unchecked."""
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        return next((name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                       "guided_grammar") if getattr(self, name) is not None), None)

    def structured_outputs_params(self):
        """The request's `StructuredOutputsParams` (None: free text); APIError 400 naming the field when the
        constraint is malformed, invalid (schema, regex, grammar) or given more than once."""
        from jhybrid.engine.structured_output import StructuredOutputsParams

        given = []  # (field path of the constraint for errors, its StructuredOutputsParams kwargs)
        fmt = self.response_format
        if fmt is not None and fmt.get("type") == "json_object":
            given.append(("response_format", dict(json_object=True)))
        elif fmt is not None and fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise _bad("response_format.json_schema", 'must be an object {"name": ..., "schema": {...}}')
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise _bad("response_format.json_schema.schema", "a JSON schema (an object) is required")
            given.append(("response_format.json_schema.schema", dict(json=schema)))
        if self.structured_outputs is not None:
            so = dict(self.structured_outputs)
            for key, ok in _STRUCTURED_NEUTRAL.items():
                if key in so and so.pop(key) not in ok:
                    raise APIError(400, f"structured_outputs.{key}: only {' or '.join(map(repr, ok))} is supported",
                                   param=f"structured_outputs.{key}", code="unsupported_parameter")
            unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise APIError(400, f"structured_outputs.{unknown[0]}: not supported by this server; use one of "
                               "json, regex, choice, grammar, json_object", param=f"structured_outputs.{unknown[0]}",
                               code="unsupported_parameter")
            so = {k: v for k, v in so.items() if v is not None and v is not False}
            if len(so) != 1:
                raise _bad("structured_outputs", f"give exactly one of json, regex, choice, grammar, json_object; got "
                           f"{', '.join(so) or 'none'}")
            (key, value), = so.items()
            given.append((f"structured_outputs.{key}", {key: value}))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                given.append((name, {name.removeprefix("guided_"): getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise _bad(given[1][0], f"only one structured-output constraint per request; {given[0][0]} is given too")
        path, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as e:  # the message names structured_outputs.<kind>: name the field the request used
            msg = str(e)
            kind = next(iter(kwargs))
            for prefix in (f"structured_outputs.{kind}", "structured_outputs"):
                if msg.startswith(prefix):
                    msg = path + msg[len(prefix):]
                    break
            raise _bad(path, msg.removeprefix(path + ": ").removeprefix(path + " ")) from None

    def check_supported(self) -> None:
        """400 for a field this server does not implement that would change the output."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
                                               for ok in UNSUPPORTED[name]):
                raise APIError(400, f"{name}: not supported by this server (it would change the output); leave it "
                               f"unset", param=name, code="unsupported_parameter")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("bad_words")
    @classmethod
    def _words(cls, v):
        if v and any(not w.strip() for w in v):
            raise ValueError("bad words must be non-blank strings")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, v):
        if v is not None and (not v or any(not 0 <= t <= INT32_MAX for t in v)):
            raise ValueError("must be a non-empty list of token ids")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_GenerationRequest):
    """`logprobs`: the log-probability of each returned token and the `logprobs` most likely ones (with `echo`,
    of the prompt's tokens too, the first one's null). `max_tokens: 0` is allowed with `echo` (the prompt and its
    log-probabilities alone), as vLLM allows it."""

    max_tokens: int | None = Field(None, ge=0)
    # token ids first: pydantic's smart union tries the members in order, and a 10k-token prompt validated against
    # list[str] first (one error per element) took ~5 ms of the event loop against ~0.7 ms this way
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo: the prompt alone)")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        ok = isinstance(v, str) or (
            isinstance(v, list) and v and (
                all(isinstance(x, str) for x in v)
                or all(type(x) is int for x in v)
                or all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in v)
            )
        )
        if not ok:
            raise ValueError("must be a string, a non-empty list of strings, a list of token ids or a list of "
                             "non-empty token-id lists")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's letters, digits, _ and -, plus . and : (namespaces)


class FunctionDefinition(BaseModel):
    """A function tool: its `parameters` are a JSON schema of an object (none: no arguments). `strict` is
    accepted; with tool_choice "auto" the arguments are what the model wrote (not enforced)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not TOOL_NAME.fullmatch(v):
            raise ValueError(f"must be 1 to 64 letters, digits, '_', '-', '.' or ':', got {v!r}")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        if v is None:
            return v
        if v.get("type", "object") != "object":
            raise ValueError(f'must be a JSON schema of an object ("type": "object"), got "type": {v["type"]!r}')
        props = v.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ValueError('"properties" must map each argument name to its JSON schema (an object)')
        required = v.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError('"required" must be a list of argument names')
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    """A call in an assistant message of the history; `arguments` is JSON text (as OpenAI sends it) or an object."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v):
        if isinstance(v, str):
            try:
                parsed = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"must be a JSON object as text, got {v[:60]!r} ({e})") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"must be a JSON object as text, got {v[:60]!r}")
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other fields (reasoning_content, ...) reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            kinds = {p.get("type") for p in v} - {"text"}
            if kinds:
                raise ValueError(f"only text content parts are supported, got {sorted(map(str, kinds))}")
            return v
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, this one is {self.role!r}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message must name the call it answers (tool_call_id)")
        return self

    def for_template(self) -> dict[str, Any]:
        """A plain dict, with text parts joined into one string (what text-only templates expect) and tool calls'
        arguments as objects (what tool-use templates expect; HF's convention, as vLLM does)."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        for call in d.get("tool_calls", ()):
            args = call["function"]["arguments"]
            if isinstance(args, str):
                call["function"]["arguments"] = json.loads(args) if args.strip() else {}
        return d


TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False  # vLLM's chat extension; refused when true
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None: "auto" with tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be set to true when top_logprobs is used")
        return self

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v):
        if v is None or v in TOOL_CHOICES:
            return v
        function = v.get("function") if isinstance(v, dict) else None
        if not (isinstance(v, dict) and v.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)):
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
                             f"got {json.dumps(v)[:80]}")
        return {"type": "function", "function": {"name": function["name"]}}

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        names = [t.function.name for t in self.tools or ()]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tools: two tools are named {dup[0]!r}; names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice: {json.dumps(choice)} needs tools; none were given")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ValueError(f"tool_choice: names the function {choice['function']['name']!r}, which is not among "
                             f"the tools ({', '.join(names)})")
        return self

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported for chat completions")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's shape): the prompt's token ids as the server would feed them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's shape): the text of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]
