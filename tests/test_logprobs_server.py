"""Log-probabilities through the OpenAI-compatible server: completions `logprobs` with and without `echo`
(`max_tokens` 0 included), chat `logprobs` + `top_logprobs`, streamed and not, against the offline engine.

The engine has `tests/test_server.py`'s shapes (the example's tiny checkpoint, 8 rows, 16-token steps: prompts
are chunked), so the two modules share their compiled step programs.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import numpy as np
import pytest

from jhybrid import LLM, SamplingParams
from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app, load_chat_template
from tests.example_ckpt import merge_json, write_example_checkpoint

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SHAPES = dict(dtype="float32", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16)  # test_server.py's
PROMPT = "the quick brown fox jumps over the lazy dog and then the dog sleeps while the fox runs far away into the woods"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_example_checkpoint(tmp_path_factory.mktemp("lp") / "plain", seed=5)
    merge_json(os.path.join(path, "tokenizer_config.json"), {"chat_template": TEMPLATE})
    return path


@pytest.fixture(scope="module")
def url(ckpt):
    engine = build_engine(ckpt, served_model_name=MODEL, warmup=True, **SHAPES)
    app = create_app(engine, ServerConfig(model_names=(MODEL,), chat_template=load_chat_template(ckpt)))
    server = BackgroundServer(app).start()
    yield server.url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **SHAPES)


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body) -> list[dict]:
    """The chunks of a streamed response (without [DONE])."""
    chunks = []
    with httpx.stream("POST", url + path, json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def joined_completion_logprobs(chunks: list[dict]) -> tuple[str, dict]:
    """A streamed completion's text and its chunks' logprobs joined into one (completions shape)."""
    text, joined = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        (choice,) = c["choices"]
        text += choice["text"]
        for key, value in (choice["logprobs"] or {}).items():
            joined[key] += value
    return text, joined


def test_completions_echo_logprobs_equal_the_offline_engine(url, offline):
    """lm-evaluation-harness's loglikelihood request (`max_tokens` 1, `logprobs` 1, `echo`): one entry per prompt
    token then the generated one, the first null; each value equals the offline engine's prompt logprobs
    (`prompt_logprobs=1`) and generated logprob for the same prompt (1e-5), the top dicts hold the token and the
    most likely one; `max_tokens` 0 returns the prompt alone; streamed equals non-streamed. Checked to fail: with
    `prompt_logprobs` not passed to the engine (`_params`), the prompt entries are all null."""
    ids = offline.tokenizer.encode(PROMPT)
    assert len(ids) > 16, "the prompt should be chunked over 16-token steps"
    (ref,) = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1))
    body = dict(prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0.0)
    got = post(url, "/v1/completions", **body)["choices"][0]
    lp = got["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref.prompt_logprobs[q][ids[q]] for q in range(1, n)] + [next(iter(ref.logprobs[0].values()))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, rtol=0, atol=1e-5)
    for q in range(1, n):  # the token and the top one (one entry when the token is the top one)
        top = lp["top_logprobs"][q]
        assert 1 <= len(top) <= 2 and math.isclose(max(top.values()), max(ref.prompt_logprobs[q].values()), abs_tol=1e-5)
    assert "".join(lp["tokens"][:n]) == got["text"][: sum(map(len, lp["tokens"][:n]))]
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    streamed_text, streamed = joined_completion_logprobs(stream(url, "/v1/completions", **body))
    assert streamed_text == got["text"] and streamed == lp
    # max_tokens 0: the prompt and its logprobs alone, as vLLM answers it
    zero = post(url, "/v1/completions", **{**body, "max_tokens": 0})
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert zero["usage"]["completion_tokens"] == 0
    zero_text, zero_streamed = joined_completion_logprobs(stream(url, "/v1/completions", **{**body, "max_tokens": 0}))
    assert zero_streamed["token_logprobs"] == lp["token_logprobs"][:n] and zero_text == zero["choices"][0]["text"]


def test_completions_logprobs_without_echo_streamed_and_not(url, offline):
    """`logprobs: 3` without echo: one entry per generated token (its logprob equal to the offline engine's and
    the top dict holding the token and the 3 most likely, keyed by their text); the streamed chunks join to the same. Checked to
    fail: with the generated tokens' logprobs left out of `_merge_deltas`, the streamed run misses tokens."""
    ids = offline.tokenizer.encode(PROMPT)[:10]
    (ref,) = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))
    body = dict(prompt=ids, max_tokens=6, logprobs=3, temperature=0.0, ignore_eos=True)
    lp = post(url, "/v1/completions", **body)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6
    want = [d[t] for d, t in zip(ref.logprobs, ref.token_ids)]  # greedy: the token is the top one
    np.testing.assert_allclose(lp["token_logprobs"], want, rtol=0, atol=1e-5)
    for top, ref_top in zip(lp["top_logprobs"], ref.logprobs):  # keyed by text: tokens that read alike merge
        assert 1 <= len(top) <= 4 and set(top.values()) <= set(ref_top.values())
        assert max(top.values()) == max(ref_top.values())
    _, streamed = joined_completion_logprobs(stream(url, "/v1/completions", **body))
    assert streamed["token_logprobs"] == lp["token_logprobs"] and streamed["top_logprobs"] == lp["top_logprobs"]


def test_chat_logprobs_with_the_openai_client(url, offline):
    """Chat `logprobs` + `top_logprobs: 2` read through the official `openai` client, streamed and not: each
    content token has its text, logprob, UTF-8 bytes and two top entries sorted by logprob; the streamed
    tokens equal the non-streamed ones. `top_logprobs` without `logprobs` and values out of range answer 400.
    Checked to fail: with the chat branch of `_params` not asking the engine for logprobs, `top_logprobs`
    comes back empty."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5, temperature=0.0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8", "replace")) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)  # greedy
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(**kw, stream=True)
                for choice in chunk.choices if choice.logprobs and choice.logprobs.content for e in choice.logprobs.content]
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in content]
    plain = client.chat.completions.create(**{k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")})
    assert plain.choices[0].logprobs is None
    for bad, param in [(dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs")]:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": kw["messages"], **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for bad in [dict(logprobs=21), dict(logprobs=-1), dict(max_tokens=0)]:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **bad})
        assert r.status_code == 400, r.text
