"""`POST /tokenize` and `POST /detokenize` (vLLM's request and response shapes) on the bundled model, checked
against HF `tokenizers` reading the same tokenizer.json directly."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from jhybrid.assets import default_model_path
from jhybrid.server.app import ServerConfig, create_app
from jhybrid.server.launch import BackgroundServer, build_engine

MODEL = "kjv"


@pytest.fixture(scope="module")
def served():
    path = Path(default_model_path())
    engine = build_engine(str(path), dtype="float32", served_model_name=MODEL, max_num_seqs=2, max_model_len=128)
    server = BackgroundServer(create_app(engine.start(), ServerConfig(model_names=(MODEL,)))).start()
    try:
        yield server.url, Tokenizer.from_file(str(path / "tokenizer.json")), engine
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_gives_the_tokenizers_ids(served, special):
    """The ids the tokenizer gives, with and without special tokens. (The bundled tokenizer adds none, so this
    does not show that the flag is passed on; the request model refuses fields it does not know.)"""
    url, reference, _ = served
    text = "In the beginning God created the heaven and the earth."
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    want = reference.encode(text, add_special_tokens=special).ids
    assert r.json() == {"count": len(want), "max_model_len": 128, "tokens": want, "token_strs": None}


def test_detokenize_gives_the_tokenizers_text(served):
    url, reference, _ = served
    ids = reference.encode("And God said, Let there be light: and there was light.").ids
    r = httpx.post(url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": reference.decode(ids)}


@pytest.mark.parametrize("path,body,message", [
    ("/tokenize", {"prompt": "x", "messages": []}, "messages"),  # a field that would change the output: refused
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "x"}, "does not exist"),
    ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_requests_are_refused_naming_the_problem(served, path, body, message):
    url, _, _ = served
    r = httpx.post(url + path, json=body)
    assert r.status_code in (400, 404), (r.status_code, r.text)
    assert message in r.json()["error"]["message"], r.text
