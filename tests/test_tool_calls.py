"""Tool calling: the parsers on hand-built model outputs, the schemas of tool_choice "required" / named, the
prompt against HF transformers' `apply_chat_template(..., tools=...)`, and the route through the official
`openai` client, streamed and not.

The seam: the server tests run the real app, chat template, tokenizer and AsyncEngine over `ScriptedBackend`,
an engine backend (the interface `ThreadBackend` and `EngineProcess` implement) that answers each request
with the next scripted reply, in the pieces given, and records the prompt ids it got. A model that writes a
given tool call on demand is what the tests need and what a random tiny model cannot do; everything the server
does with the text happens after this boundary, exactly as with a real engine.

Each test was checked to fail: the comment "fails without" names the behaviour removed once to see it fail.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import httpx
import pytest

from jhybrid.server import AsyncEngine, BackgroundServer, ServerConfig, create_app, load_chat_template
from jhybrid.server.engine_core import Delta, Outputs
from jhybrid.server.protocol import APIError
from jhybrid.server.tool_parsers import PARSERS, collect, convert_value
from jhybrid.server.tools import ConstrainedCalls, named_schema, required_schema
from tests import tool_templates
from tests.example_ckpt import merge_json, write_example_checkpoint

MODEL = "tiny-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Das Wetter einer Stadt",  # non-ASCII: tojson must keep it
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}, "precise": {"type": "boolean"}, "offset": {"type": "number"},
    "tags": {"type": "array"}, "extra": {"type": ["object", "null"]}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}


# ----------------------------------------------------------------------------------------------- parsers
def _calls(deltas):
    content, calls = collect(deltas)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def parse_whole(name, text, **kw):
    p = PARSERS[name](SCHEMAS, **kw)
    return _calls(p.feed(text) + p.finish())


def parse_pieces(name, pieces, **kw):
    p = PARSERS[name](SCHEMAS, **kw)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    return deltas


HERMES_TWO = ('I will check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>\n')
QWEN3_CODER = ("Checking.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n"
               "<parameter=precise>\nTrue\n</parameter>\n<parameter=offset>\n1.5\n</parameter>\n<parameter=tags>\n"
               '["a", 1]\n</parameter>\n<parameter=extra>\nnull\n</parameter>\n<parameter=note>\nline 1\nline 2\n'
               "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
               "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
MINIMAX = ('<think>\nMaybe <tool_calls> is not for now.\n</think>\nSure.\n<tool_calls>\n'
           '{"name": "get_weather", "arguments": {"city": "Köln"}}\n{"name": "get_time", "arguments": {}}\n</tool_calls>')
CASES = {  # name: (parser, model output, content, calls)
    "hermes": ("hermes", HERMES_TWO, "I will check both.",
               [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]),
    "qwen3_coder": ("qwen3_coder", QWEN3_CODER, "Checking.",
                    [("get_time", {"zone": "Europe/Paris", "precise": True, "offset": 1.5, "tags": ["a", 1],
                                   "extra": None, "note": "line 1\nline 2"}),
                     ("get_weather", {"city": "Paris", "days": 3})]),
    "minimax": ("minimax", MINIMAX, "<think>\nMaybe <tool_calls> is not for now.\n</think>\nSure.",
                [("get_weather", {"city": "Köln"}), ("get_time", {})]),
    "text only": ("hermes", "No tools needed: 2 < 3 and <tool is a word.\n", "No tools needed: 2 < 3 and <tool is a word.\n", []),
    "text after the call": ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone. ', "Done. ",
                            [("get_time", {})]),
    "unterminated but whole": ("hermes", 'x <tool_call>\n{"name": "get_time", "arguments": {}}\n', "x", [("get_time", {})]),
}


@pytest.mark.parametrize("case", CASES)
def test_parser_reads_hand_built_outputs_whole_and_streamed(case):
    """fails without: qwen3_coder's schema types (offset stays "1.5"), minimax's <think> skip (the planning tag
    opens a block: content loses the think text), the whitespace trim next to calls, held-back tag prefixes
    (char-by-char streaming then splits `<tool_call>` and the calls come back as text)."""
    parser, text, content, calls = CASES[case]
    assert parse_whole(parser, text) == (content or None if calls else content, calls)
    by_char = parse_pieces(parser, list(text))
    assert _calls(by_char) == (content or None if calls else content, calls)
    for cut in range(1, len(text)):  # every split into two pieces
        assert _calls(parse_pieces(parser, [text[:cut], text[cut:]])) == _calls(by_char), cut
    for d in by_char:  # no piece of a tag leaks as content, and each call is announced before its arguments
        assert "tool_call" not in d.get("content", "") or case == "minimax"
    announced = [d["tool_calls"][0] for d in by_char if "tool_calls" in d]
    for i in range(len(calls)):
        head, args = announced[2 * i], announced[2 * i + 1]
        assert head["index"] == args["index"] == i and head["id"].startswith("call_") and head["type"] == "function"
        assert head["function"] == {"name": calls[i][0], "arguments": ""} and "id" not in args


def test_a_tag_prefix_is_held_back_then_released():
    """fails without the hold-back (`_held`): "<tool" leaves as content before "_call>" arrives."""
    p = PARSERS["hermes"]()
    assert p.feed("Hi <tool") == [{"content": "Hi"}]  # " <tool" might begin a call
    assert p.feed("box>") == [{"content": " <toolbox>"}]  # it did not
    assert p.feed(" and <tool_") == [{"content": " and"}]
    assert p.finish() == [{"content": " <tool_"}]


def test_malformed_or_cut_blocks_come_back_as_text():
    """fails without the fallback in `_block` (a broken block raising, or dropped)."""
    bad = 'a\n<tool_call>\n{"name": "get_time", "arguments": {oops}}\n</tool_call>'
    assert parse_whole("hermes", bad) == ('a<tool_call>\n{"name": "get_time", "arguments": {oops}}\n</tool_call>', [])
    cut = 'a <tool_call>\n{"name": "get_time", "argu'  # max_tokens cut the call
    assert parse_whole("hermes", cut) == ('a<tool_call>\n{"name": "get_time", "argu', [])
    assert parse_whole("qwen3_coder", "<tool_call>\nno function\n</tool_call>") == \
        ("<tool_call>\nno function\n</tool_call>", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    """fails without `max_calls` (both calls come back)."""
    assert parse_whole("hermes", HERMES_TWO, max_calls=1)[1] == [("get_weather", {"city": "Paris", "days": 2})]


@pytest.mark.parametrize("text, schema, value", [
    ("42", {"type": "integer"}, 42), ("4.0", {"type": "number"}, 4.0), ("4", {"type": "number"}, 4),
    ("-2e3", {"type": "number"}, -2000.0), ("false", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": "string"}, "null"), ("null", {"type": "integer"}, None), ("{'a': True}", {"type": "object"}, {"a": True}),
    ("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "null"}]}, [1, 2]), ("7", {"enum": ["7", "8"]}, "7"),
    ("12", None, "12"), ("twelve", {"type": "integer"}, "twelve"),
])
def test_qwen3_coder_values_follow_the_schema(text, schema, value):
    """fails without `convert_value`'s per-type branches (each row covers one)."""
    got = convert_value(text, schema)
    assert got == value and type(got) is type(value)


# ----------------------------------------------------------------------------------------------- required / named
def test_required_and_named_schemas():
    """The reference is the schema spelled out by hand. fails without minItems, the name enum per tool, or the
    empty-object default for a tool without parameters."""
    tools = {"get_weather": SCHEMAS["get_weather"], "ping": None}
    assert required_schema(tools) == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                          "parameters": SCHEMAS["get_weather"]}, "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["ping"]},
                                          "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}}
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    assert named_schema(tools, "get_weather") == SCHEMAS["get_weather"]
    assert named_schema(tools, "ping") == {"type": "object", "properties": {}}


def test_constrained_output_as_tool_calls():
    """fails without ConstrainedCalls' array reading (required) or its header-then-fragments (named)."""
    required = ConstrainedCalls(None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    deltas = required.feed(text[:30]) + required.feed(text[30:]) + required.finish()
    assert _calls(deltas) == (None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]) and required.num_calls == 2
    cut = ConstrainedCalls(None)
    assert collect(cut.feed('[{"name": "get_we') + cut.finish()) == ('[{"name": "get_we', [])
    named = ConstrainedCalls("get_weather")
    deltas = named.feed('{"city": ') + named.feed('"Oslo"}') + named.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert _calls(deltas) == (None, [("get_weather", {"city": "Oslo"})])


# ----------------------------------------------------------------------------------------------- the server
class ScriptedBackend:
    """An AsyncEngine backend whose "model" answers each request with the next reply of `replies` (a list of
    text pieces, each one engine delta), finish_reason "stop"; `prompts` records the prompt ids received."""

    def __init__(self, tokenizer, max_model_len: int = 4096):
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, tokenizer.vocab_size
        self.replies: collections.deque[list[str]] = collections.deque()
        self.prompts: list[list[int]] = []
        self.frontend, self.alive, self.taken = None, False, (0, 0)

    def start(self, frontend):
        self.frontend, self.alive = frontend, True

    def is_alive(self):
        return self.alive

    def add(self, adds):  # called under the frontend's lock: answer from another thread
        for add in adds:
            self.prompts.append(list(add.prompt))
            reply = self.replies.popleft() if self.replies else ["(no scripted reply)"]
            threading.Thread(target=self._answer, args=(add, reply), daemon=True).start()

    def _answer(self, add, reply):
        self.taken = (self.taken[0] + 1, self.taken[1] + len(add.prompt))
        num = 0
        for i, text in enumerate(reply):
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False)) or (0,)
            num += len(ids)
            last = i == len(reply) - 1
            delta = Delta(text, ids, len(add.prompt), num, "stop" if last else None,
                          cumulative_logprob=-0.5 * num if last else None, token_logprobs=(-0.5,) * len(ids))
            self.frontend._on_outputs(Outputs([(add.request_id, delta)], [], self.taken, (0, 0)))
            time.sleep(0.002)

    def abort(self, request_id): ...

    def abort_all(self): ...

    def stop(self):
        self.alive = False

    def join(self, timeout): ...

    def stats(self):
        return dict(running=0, waiting=0, preempted=0, num_preemptions=0, blocks_used=0, blocks_total=1,
                    slots_used=0, slots_total=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_example_checkpoint(tmp_path_factory.mktemp("tools") / "ckpt")
    merge_json(f"{path}/tokenizer_config.json", {"chat_template": tool_templates.HERMES})
    return path


@pytest.fixture(scope="module")
def server(ckpt):
    from jhybrid.tokenizer import load_tokenizer

    backend = ScriptedBackend(load_tokenizer(ckpt))
    engine = AsyncEngine(backend=backend, model_name=MODEL)
    template = load_chat_template(ckpt)
    configs = {
        "hermes": ServerConfig(model_names=(MODEL,), chat_template=template, enable_auto_tool_choice=True,
                               tool_call_parser="hermes"),
        "qwen3_coder": ServerConfig(model_names=(MODEL,), chat_template=template, enable_auto_tool_choice=True,
                                    tool_call_parser="qwen3_coder"),
        "plain": ServerConfig(model_names=(MODEL,), chat_template=template),
    }
    running = {name: BackgroundServer(create_app(engine, cfg)).start() for name, cfg in configs.items()}
    yield backend, {name: s.url for name, s in running.items()}
    for s in running.values():
        s.stop()
    engine.shutdown()


def hf_prompt_ids(ckpt, messages, tools, **kw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt).apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False, **kw)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL_REPLY = ["Let me ", "look.\n\n<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris", ',
              '"days": 2}}\n</tool_call>']


def test_openai_client_tool_calls(server, ckpt):
    """fails without: tools passed to the template (the prompt differs from HF's), the parser in the route
    (content holds the raw call), finish_reason "tool_calls"."""
    import openai

    backend, url = server
    client = openai.OpenAI(base_url=url["hermes"] + "/v1", api_key="unused", max_retries=0)
    backend.replies.append(CALL_REPLY)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    assert backend.prompts[-1] == hf_prompt_ids(ckpt, MESSAGES, TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    backend.replies.append(["It is sunny."])  # no call: plain text, finish_reason as the engine said
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto")
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


def test_openai_client_streamed_tool_calls(server):
    """The official client's stream helper accumulates the deltas into the same message. fails without the
    hold-back (a "<tool" content delta), or with the name and the arguments in one unordered delta."""
    import openai

    backend, url = server
    client = openai.OpenAI(base_url=url["hermes"] + "/v1", api_key="unused", max_retries=0)
    backend.replies.append(CALL_REPLY + ["\n<tool_call>\n", '{"name": "get_time", "arguments": {}}\n</tool_call>'])
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    assert all("<" not in (d.content or "") for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [(tc.index, tc.id is not None, tc.function.name) for tc in calls if tc.id] == \
        [(0, True, "get_weather"), (1, True, "get_time")]
    first = next(i for i, tc in enumerate(calls) if tc.function.arguments)
    assert calls[first - 1].function.name == "get_weather"  # the name before any arguments
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert len({c.id for c in message.tool_calls}) == 2


def test_qwen3_coder_server_and_n(server):
    """Two choices, one calling and one not; parameter types from the request's schema. fails without
    per-choice parsers (the second choice would continue the first's state)."""
    backend, url = server
    backend.replies.extend([[QWEN3_CODER[:50], QWEN3_CODER[50:]], ["No call."]])
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "n": 2}
    r = httpx.post(url["qwen3_coder"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    first, second = r.json()["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Checking."
    args = [json.loads(c["function"]["arguments"]) for c in first["message"]["tool_calls"]]
    assert args[1] == {"city": "Paris", "days": 3} and args[0]["offset"] == 1.5 and args[0]["precise"] is True
    assert second == {"index": 1, "message": {"role": "assistant", "content": "No call."}, "logprobs": None,
                      "finish_reason": "stop"}


def test_multi_turn_history_renders_as_hf(server, ckpt, tmp_path):
    """Assistant tool_calls (arguments as JSON text, as OpenAI sends them) and tool messages reach the template
    as HF expects them (arguments as objects). fails without the arguments conversion in `for_template` (the
    XML template iterates `arguments|items`: it fails on text)."""
    backend, url = server
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    hf_history = json.loads(json.dumps(history))
    hf_history[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    del hf_history[2]["content"]  # the server drops None fields, as HF does
    backend.replies.append(["Sunny."])
    r = httpx.post(url["hermes"] + "/v1/chat/completions", json={"model": MODEL, "messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert backend.prompts[-1] == hf_prompt_ids(ckpt, hf_history, TOOLS)
    assert r.json()["choices"][0]["message"]["content"] == "Sunny."
    # the Qwen3.5-style template
    xml = load_chat_template(ckpt, tool_templates.XML)
    from jhybrid.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
    ours = xml.render([m.for_template() for m in req.messages], tools=TOOLS)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    assert ours == hf.apply_chat_template(hf_history, tools=TOOLS, chat_template=tool_templates.XML, tokenize=False,
                                          add_generation_prompt=True)
    assert "<parameter=city>\nParis\n</parameter>" in ours


def test_tool_use_template_is_picked_with_tools(tmp_path):
    """A checkpoint with named templates renders requests with tools through "tool_use", as HF does. fails
    without `ChatTemplate.tool_use`."""
    from transformers import AutoTokenizer

    path = write_example_checkpoint(tmp_path / "named")
    merge_json(f"{path}/tokenizer_config.json", {"chat_template": [
        {"name": "default", "template": tool_templates.PLAIN}, {"name": "tool_use", "template": tool_templates.HERMES}]})
    ours, hf = load_chat_template(path), AutoTokenizer.from_pretrained(path)
    for tools in (TOOLS, None):
        assert ours.render(MESSAGES, tools=tools) == hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                                                            add_generation_prompt=True)
    assert "<tools>" in ours.render(MESSAGES, tools=TOOLS) and "<tools>" not in ours.render(MESSAGES)


def _post(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body}, timeout=30)


def test_tool_choice_none_and_refusals(server, ckpt):
    """fails without: the flag check (auto on a server without --enable-auto-tool-choice would answer text), the
    refusal of a second constraint beside "required" / a named function (the tools' schema silently replaced
    response_format: checked by removing it), tool validation (a malformed tool would reach the template).
    The constrained output itself is tested on a real engine in tests/test_structured_output.py."""
    backend, url = server
    raw = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    backend.replies.append([raw])
    r = _post(url["hermes"], tools=TOOLS, tool_choice="none")  # the tools reach the template, the text is as is
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == {"role": "assistant", "content": raw}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert backend.prompts[-1] == hf_prompt_ids(ckpt, MESSAGES, TOOLS)

    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):  # auto is the default with tools
        r = _post(url["plain"], **body)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"], r.text
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for field, value in (("response_format", {"type": "json_object"}), ("guided_regex", "a+")):
            r = _post(url["hermes"], tools=TOOLS, tool_choice=choice, **{field: value})
            assert r.status_code == 400 and "already constrains the output" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == field
    bad = [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "two tools are named 'get_weather'"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice: must be"),
        ({"messages": MESSAGES + [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages.2.tool_calls.0.function.arguments"),
        ({"tools": TOOLS, "chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
    ]
    for body, message in bad:
        r = _post(url["hermes"], **body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    backend.replies.append(["still serving"])  # the refusals touched nothing else
    assert _post(url["hermes"]).json()["choices"][0]["message"]["content"] == "still serving"


def test_server_config_and_cli_flags(monkeypatch, capsys):
    """fails without the flags' passing in cli._serve, or ServerConfig's checks."""
    import jhybrid.server
    from jhybrid.cli import _parser, main

    seen = {}
    monkeypatch.setattr(jhybrid.server, "serve", lambda model, **kw: seen.update(kw))
    assert main(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]) == 0
    assert seen["enable_auto_tool_choice"] is True and seen["tool_call_parser"] == "qwen3_coder"
    assert main(["serve", "m"]) == 0
    assert seen["enable_auto_tool_choice"] is False and seen["tool_call_parser"] is None
    sub = next(a for a in _parser()._actions if hasattr(a, "choices") and a.choices and "serve" in a.choices)
    help_text = sub.choices["serve"].format_help()
    assert all(name in help_text for name in PARSERS), "every parser is named in --help"
    with pytest.raises(ValueError, match="unknown tool call parser.*hermes, minimax, qwen3_coder"):
        ServerConfig(model_names=("m",), tool_call_parser="llama3_json")
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        ServerConfig(model_names=("m",), enable_auto_tool_choice=True)
