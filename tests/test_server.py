"""The OpenAI-compatible server on the example's tiny checkpoint (CPU): the official `openai` client, the
bad-input matrix, 200 concurrent streams, client disconnects, metrics, and the chat template.

One engine (module scope, so XLA compiles each step shape once; at most 8 rows and 16 tokens a step keep
the shapes to four: an XLA compile costs seconds on a small shared CPU) serves three apps on loopback: `main`
(a copy of the checkpoint with a chat template added), `keyed` (the same with an API key) and `plain`
(the original checkpoint's missing chat template).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import socket
import time

import httpx
import pytest

from jhybrid.cli import main
from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app, load_chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny"
API_KEY = "sekret-key"
# a short chat template with HF idioms (bos_token, raise_exception, whitespace control); short because the
# tiny tokenizer has no ChatML special tokens and every prompt token costs CPU time here
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GREEDY = {"temperature": 0.0}
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("tiny_random", os.path.join(ROOT, "examples", "tiny_random.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plain = module.write_tiny_checkpoint(str(tmp_path_factory.mktemp("srv") / "plain"), seed=5)
    chat = str(tmp_path_factory.mktemp("srv") / "chat")
    shutil.copytree(plain, chat)
    path = os.path.join(chat, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, "chat_template": TEMPLATE}, f)
    return plain, chat


@pytest.fixture(scope="module")
def servers(dirs):
    plain, chat = dirs
    engine = build_engine(chat, dtype="float32", served_model_name=MODEL, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                          max_num_batched_tokens=16, warmup=True)  # as `jhybrid serve`: no compile mid-test
    template = load_chat_template(chat)
    apps = {
        "main": create_app(engine, ServerConfig(model_names=(MODEL,), chat_template=template)),
        "keyed": create_app(engine, ServerConfig(model_names=(MODEL,), chat_template=template, api_key=API_KEY)),
        "plain": create_app(engine, ServerConfig(model_names=(MODEL,), chat_template=load_chat_template(plain))),
    }
    running = {name: BackgroundServer(app).start() for name, app in apps.items()}
    yield engine, {name: s.url for name, s in running.items()}
    for s in running.values():
        s.stop()
    engine.shutdown()


def wait_idle(engine, url: str | None = None, timeout: float = 30.0) -> None:
    """Waits until nothing runs, waits or holds a block or slot (read from this thread; the engine owns it),
    and, given the server's url, until /metrics says so too (the gauges lag by one engine iteration)."""
    eng = engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = not eng.scheduler.running and not eng.scheduler.waiting and not eng.requests
        if idle and eng.blocks.num_used == 0 and eng.slots.num_used == 0:
            if url is None:
                return
            m = scrape(url)
            gauges = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "state_slots_used")
            if all(m[f"jhybrid:{g}"] == 0 for g in gauges):
                return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: running={eng.scheduler.running} waiting={len(eng.scheduler.waiting)} "
                         f"blocks={eng.blocks.num_used} slots={eng.slots.num_used} requests={list(eng.requests)}")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (without the model_name label)."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*"', "", key).replace("{,", "{").replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out


def test_openai_client_completions_chat_and_stream(servers, dirs):
    import openai

    engine, url = servers
    client = openai.OpenAI(base_url=url["main"] + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, **GREEDY)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.choices[0].text
    assert comp.usage.completion_tokens >= 1 and comp.usage.total_tokens == comp.usage.prompt_tokens + comp.usage.completion_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Paris."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and text
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    prompt = load_chat_template(dirs[1]).render(messages)
    assert prompt == "<|bos|>system: Be brief.\nuser: Tell me about Paris.\nassistant:"
    assert chat.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == text, "streamed deltas must concatenate to the non-streamed text"
    assert sum(1 for d in deltas if d) > 1, "the stream came in one piece"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens

    # a streamed completion equals the non-streamed one too; so does a stop string, held back while streaming
    comp_text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True, **GREEDY))
    assert comp_text == comp.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[: text.find(stop)]
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stop=[stop], stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.find(stop)]

    # a batch of prompts (text and token ids) with n=2: one choice each, in order
    many = client.completions.create(model=MODEL, prompt=["Once upon a time", "The capital"], n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == comp_text[: len(many.choices[0].text)]
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True}, **GREEDY)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3
    wait_idle(engine)


def _ok_completion(client: httpx.Client, url: str, **headers) -> None:
    r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1, **GREEDY}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_input_matrix(servers):
    engine, url = servers
    main_url = url["main"]
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    comp = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [  # (label, path, body (dict, or raw bytes), status, words the message must contain)
        ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
        ("empty body", "/v1/chat/completions", b"", 400, "not valid JSON"),
        ("not an object", "/v1/completions", b"[1, 2, 3]", 400, "JSON object"),
        ("max_tokens string", "/v1/completions", {**comp, "max_tokens": "8"}, 400, "max_tokens"),
        ("temperature string", "/v1/chat/completions", {**chat, "temperature": "hot"}, 400, "temperature"),
        ("prompt number", "/v1/completions", {**comp, "prompt": 5}, 400, "prompt"),
        ("prompt missing", "/v1/completions", {"model": MODEL}, 400, "prompt: this field is required"),
        ("messages string", "/v1/chat/completions", {**chat, "messages": "hi"}, 400, "messages"),
        ("bad role", "/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("stream string", "/v1/completions", {**comp, "stream": "yes"}, 400, "stream"),
        ("unknown model", "/v1/completions", {**comp, "model": "gpt-17"}, 404, "gpt-17"),
        ("unknown model (chat)", "/v1/chat/completions", {**chat, "model": "gpt-17"}, 404, "does not exist"),
        ("zero max_tokens", "/v1/completions", {**comp, "max_tokens": 0}, 400, "max_tokens"),
        ("negative max_tokens", "/v1/chat/completions", {**chat, "max_tokens": -5}, 400, "max_tokens"),
        ("zero max_completion_tokens", "/v1/chat/completions", {**chat, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ("negative temperature", "/v1/completions", {**comp, "temperature": -0.5}, 400, "temperature"),
        ("temperature too high", "/v1/chat/completions", {**chat, "temperature": 2.5}, 400, "temperature"),
        ("top_p zero", "/v1/completions", {**comp, "top_p": 0}, 400, "top_p"),
        ("top_p above one", "/v1/chat/completions", {**chat, "top_p": 1.5}, 400, "top_p"),
        ("empty messages", "/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("empty stop string", "/v1/completions", {**comp, "stop": [""]}, 400, "stop"),
        ("prompt too long", "/v1/completions", {**comp, "prompt": long_text}, 400, "maximum context length"),
        ("messages too long", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": long_text}]}, 400,
         "maximum context length"),
        ("ids too long", "/v1/completions", {**comp, "prompt": [3] * MAX_MODEL_LEN}, 400, "maximum context length"),
        ("max_tokens past context", "/v1/completions", {**comp, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("ids out of vocab", "/v1/completions", {**comp, "prompt": [1, 2, 100000]}, 400, "token ids"),
        ("empty prompt", "/v1/completions", {**comp, "prompt": ""}, 400, "empty"),
        ("template refuses role", "/v1/chat/completions", {**chat, "messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, 400,
         "unknown role tool"),
        ("body over the limit", "/v1/completions", {**comp, "prompt": "x" * (2 << 20)}, 413, "exceeds"),
    ]
    with httpx.Client(timeout=60) as client:
        # a long request running through the whole matrix must not notice it
        background = client.build_request("POST", main_url + "/v1/completions", json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True, **GREEDY})
        bg = client.send(background, stream=True)
        bg_lines = bg.iter_lines()
        assert next(line for line in bg_lines if line.startswith("data:"))
        for label, path, body, status, words in cases:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.post(main_url + path, headers={"content-type": "application/json"}, **kw)
            assert r.status_code == status, f"{label}: {r.status_code} {r.text[:300]}"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, label
            assert words in err["message"], f"{label}: {err['message']!r} lacks {words!r}"
            _ok_completion(client, main_url)
        # a body that lies about its size: no Content-Length, streamed in chunks past the limit
        r = client.post(main_url + "/v1/completions", content=iter([b'{"prompt": "', b"y" * (1 << 20), b"y" * 1024, b'"}']),
                        headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text[:200]
        # no chat template -> 400 naming the problem; completions still work there
        r = client.post(url["plain"] + "/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        _ok_completion(client, url["plain"])
        # API key: missing, wrong, right; /health and /metrics stay open
        r = client.post(url["keyed"] + "/v1/completions", json=comp)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = client.post(url["keyed"] + "/v1/completions", json=comp, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and "incorrect API key" in r.json()["error"]["message"]
        assert client.get(url["keyed"] + "/v1/models").status_code == 401
        _ok_completion(client, url["keyed"], Authorization=f"Bearer {API_KEY}")
        assert client.get(url["keyed"] + "/health").status_code == 200
        # unknown routes and methods answer in the same error shape
        r = client.get(main_url + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        assert client.get(main_url + "/v1/completions").status_code == 405
        # the background stream finished normally, with all its tokens
        events = [line[6:] for line in bg_lines if line.startswith("data: ")]
        bg.close()
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    metrics = scrape(main_url)
    assert metrics['jhybrid:http_requests_total{method="POST",route="/v1/completions",status="400"}'] >= 15
    assert metrics['jhybrid:http_requests_total{method="POST",route="/v1/completions",status="413"}'] >= 2
    wait_idle(engine)


async def _stream_one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    chat = i % 4 == 0
    body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **GREEDY}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Q{i}?"}]
    else:
        body["prompt"] = f"Hi {i}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return 0, f"status {r.status_code}"
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    if events[-1] != "[DONE]":
        return 0, "no [DONE]"
    usage = json.loads(events[-2])["usage"]
    if usage["completion_tokens"] != 4:
        return 0, f"usage {usage}"
    return 1, ""


@pytest.mark.slow
def test_200_concurrent_streams(servers):
    engine, url = servers
    before = scrape(url["main"])

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        # the last streams get no byte until all before them are done: on a busy shared CPU that took over 120 s
        async with httpx.AsyncClient(limits=limits, timeout=600) as client:
            return await asyncio.gather(*(_stream_one(client, url["main"], i) for i in range(200)))

    results = asyncio.run(run())
    errors = [msg for ok, msg in results if not ok]
    assert not errors, f"{len(errors)} of 200 streams failed: {errors[:5]}"
    wait_idle(engine, url["main"])
    after = scrape(url["main"])
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "state_slots_used"):
        assert after[f"jhybrid:{gauge}"] == 0, gauge
    assert after["jhybrid:kv_blocks_total"] > 0 and after["jhybrid:state_slots_total"] == 8

    def delta(key):
        return after[key] - before.get(key, 0)

    assert delta('jhybrid:request_success_total{finished_reason="length"}') == 200
    assert delta("jhybrid:generation_tokens_total") == 800
    assert delta("jhybrid:time_to_first_token_seconds_count") == 200
    assert delta("jhybrid:inter_token_latency_seconds_count") == 600
    assert delta("jhybrid:e2e_request_latency_seconds_count") == 200
    assert delta("jhybrid:prompt_tokens_total") > 200
    # where the outputs wait on their way to the streams (a removed observe() call fails these)
    assert delta('jhybrid:output_delivery_seconds_count{stage="engine_to_server"}') >= 1
    assert delta('jhybrid:output_delivery_seconds_count{stage="server_queue"}') >= 1
    assert delta("jhybrid:event_loop_lag_seconds_count") >= 1


def test_disconnects_abort_and_free(servers):
    engine, url = servers
    before = scrape(url["main"])

    async def drop_streams(n: int):
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i):
                body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 110, "ignore_eos": True, "stream": True,
                        **GREEDY}
                async with client.stream("POST", url["main"] + "/v1/completions", json=body) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                            seen += 1
                            if seen == 2:
                                return  # leaving the block closes the connection mid-stream

            await asyncio.gather(*(one(i) for i in range(n)))

    def aborted_since_start() -> float:
        key = 'jhybrid:request_success_total{finished_reason="abort"}'
        return scrape(url["main"])[key] - before[key]

    asyncio.run(drop_streams(6))
    # all six aborts land before the next request, so a "running" request below can only be that one (the check
    # once saw a stream that was still being aborted, hung up before the request was read and counted 6 of 7)
    wait_idle(engine, url["main"])
    assert aborted_since_start() == 6, f"{aborted_since_start()} streams aborted, expected 6"
    # a non-streaming client that hangs up while its request runs
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 110,
                       "ignore_eos": True, **GREEDY}).encode()
    host, port = url["main"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while not engine.engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.engine.scheduler.running, "the request never started"
    wait_idle(engine, url["main"])
    after = scrape(url["main"])
    assert aborted_since_start() == 7, f"{aborted_since_start()} requests aborted, expected 7"
    assert after["jhybrid:kv_blocks_used"] == 0 and after["jhybrid:state_slots_used"] == 0
    # the server still serves
    with httpx.Client(timeout=60) as client:
        _ok_completion(client, url["main"])


def test_engine_thread_sleeps_when_idle(servers):
    engine, url = servers
    wait_idle(engine)
    clock = time.pthread_getcpuclockid(engine.backend.thread.ident)
    before = time.clock_gettime(clock)
    time.sleep(0.5)
    assert time.clock_gettime(clock) - before < 0.02, "the idle engine thread burns CPU (busy loop?)"


def test_health_metrics_version(servers):
    _, url = servers
    assert httpx.get(url["main"] + "/health").json() == {"status": "ok"}
    r = httpx.get(url["main"] + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "num_requests_running", "num_requests_waiting", "num_requests_preempted", "num_preemptions_total",
                 "kv_cache_usage_perc", "state_slot_usage_perc", "prompt_tokens_total", "generation_tokens_total"):
        assert f"jhybrid:{name}" in r.text, name
    assert "version" in httpx.get(url["main"] + "/version").json()


def test_serve_load_benchmark(servers, tmp_path, capsys):
    from benchmarks.serve_load import main as serve_load

    _, url = servers
    out = tmp_path / "load.json"
    argv = ["--url", url["main"], "--num-requests", "8", "--concurrency", "4", "--max-tokens", "3", "--prompt-words", "2",
            "--warmup-requests", "0", "--json", str(out)]
    assert serve_load(argv) == 0
    assert "time to first token" in capsys.readouterr().out
    res = json.loads(out.read_text())["results"]
    assert res["num_requests"] == 8 and res["num_errors"] == 0
    # the rates count every request and all of its 3 streamed tokens (ignore_eos) over the run's wall time
    assert res["requests_per_s"] == 8 / res["wall_s"] and res["output_tokens_per_s"] == 8 * 3 / res["wall_s"]
    # (TTFT's percentiles are over the requests that streamed text: a sampled 3-token answer can decode to none)
    assert 0 < res["ttft_s"]["p50"] <= res["e2e_s"]["p99"] and 0 < res["e2e_s"]["p50"] <= res["e2e_s"]["p99"] <= res["wall_s"]
    assert 0 < res["itl_s"]["p50"] <= res["itl_s"]["p99"]
    with pytest.raises(SystemExit):
        serve_load(["--url", "http://192.0.2.1:8000"])  # not loopback: refused before any request


def test_chat_template_renders_like_hf(dirs):
    from transformers import AutoTokenizer

    _, chat = dirs
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Héllo {{ not jinja }}"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    ours = load_chat_template(chat)
    hf = AutoTokenizer.from_pretrained(chat)
    for gen in (True, False):
        assert ours.render(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)
    # chat_template.jinja wins over tokenizer_config.json, as in HF
    with open(os.path.join(chat, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    try:
        assert load_chat_template(chat).render(messages[:1]) == "[system] sys\n"
    finally:
        os.remove(os.path.join(chat, "chat_template.jinja"))


def test_cli_serve_rejects_bad_options(dirs, capsys):
    plain, _ = dirs
    assert main(["serve", "--model", plain, "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--model", plain, "--max-body-bytes", "0"]) == 2
