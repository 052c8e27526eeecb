"""Structured output (`SamplingParams.structured_outputs`, xgrammar): sampled output (temperature 1, several seeds) of
the example's tiny random checkpoint parses as JSON and validates against the schema, fully matches the regex, is
one of the choices, is a sentence of the EBNF grammar; offline and through the server with the `openai` client
(`response_format` json_schema / json_object, `extra_body={"structured_outputs": ...}`, the older `guided_*`); bad
schemas / regexes / grammars are refused naming the field; the grammar bitmask is a runtime input of the step
programs, so nothing compiles after warm-up; logprobs stay the model's; n, logit_bias, allowed_token_ids, ignore_eos,
a failed step's recompute and aborts keep the matcher right.

Each test says how it was checked to fail (the behaviour removed once, the test run, the behaviour put back).
The engines have tests/test_server.py's shapes (8 rows, 16-token steps), so the modules share compiled programs.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sys
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid import LLM, SamplingParams
from jhybrid.engine.compilation import CompileWatch
from jhybrid.engine.runner import SPLIT_COMPILE_THREAD
from jhybrid.engine.sampling import FLAG_MASKED, MAX_BAN_TOKENS, MAX_LOGIT_BIAS, SamplingArrays, SlotTables, TokenHistory, sample
from jhybrid.engine.structured_output import StructuredOutputsParams
from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app, load_chat_template
from tests.example_ckpt import merge_json, write_example_checkpoint

MODEL = "tiny"
SHAPES = dict(dtype="float32", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16)  # test_server.py's
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = "The quick brown fox jumps over the lazy dog"
SEEDS = range(5)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "admin": {"type": "boolean"}, "role": {"enum": ["reader", "writer"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
          "required": ["name", "age", "admin", "role", "tags"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-\d{2}( [xyz]+)?"
CHOICES = ["yes", "no", "maybe not", 'say "hi"']
GRAMMAR = 'root ::= ("x" | "yy")+ "!"'


def validate(doc, schema=SCHEMA) -> None:
    """`doc` is valid under `schema` (jsonschema when installed, else by hand for the keywords `SCHEMA` uses)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        return jsonschema.validate(doc, schema)
    kind = schema.get("type")
    if "enum" in schema:
        assert doc in schema["enum"], (doc, schema)
    elif kind == "object":
        assert isinstance(doc, dict), doc
        assert set(schema.get("required", ())) <= set(doc), doc
        if schema.get("additionalProperties") is False:
            assert set(doc) <= set(schema["properties"]), doc
        for key, value in doc.items():
            validate(value, schema["properties"][key])
    elif kind == "array":
        assert isinstance(doc, list) and len(doc) <= schema.get("maxItems", len(doc)), doc
        for item in doc:
            validate(item, schema["items"])
    elif kind == "string":
        assert isinstance(doc, str) and len(doc) <= schema.get("maxLength", len(doc)), doc
    elif kind == "integer":
        assert type(doc) is int and schema.get("minimum", doc) <= doc <= schema.get("maximum", doc), doc
    elif kind == "boolean":
        assert isinstance(doc, bool), doc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_example_checkpoint(tmp_path_factory.mktemp("so") / "plain", seed=5)
    merge_json(os.path.join(path, "tokenizer_config.json"), {"chat_template": TEMPLATE})
    return path


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **SHAPES, warmup=True)


@pytest.fixture(scope="module")
def served(ckpt):
    engine = build_engine(ckpt, served_model_name=MODEL, warmup=True, **SHAPES)
    server = BackgroundServer(create_app(engine, ServerConfig(model_names=(MODEL,), chat_template=load_chat_template(ckpt),
                                                              generation_defaults={}))).start()
    yield engine, server.url
    server.stop()
    engine.shutdown()


def sampled(offline, so: StructuredOutputsParams, max_tokens: int = 100, **kw):
    """One completion per seed of `SEEDS`, temperature 1, constrained by `so`."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured_outputs=so, **kw) for s in SEEDS]
    return [o.outputs[0] for o in offline.generate([PROMPT] * len(params), params, use_tqdm=False)]


# ------------------------------------------------------------------------------------------ params and the sampler
def test_params_validated_naming_the_field():
    """Exactly one kind; an invalid schema, regex or grammar raises ValueError naming it. Checked to fail: without
    `self.to_grammar()` in `__post_init__` the bad schema, regex and grammar pass."""
    for kwargs, words in [(dict(), "exactly one"), (dict(regex="a", choice=["b"]), "exactly one"),
                          (dict(json={"type": "nope"}), "structured_outputs.json: invalid JSON schema"),
                          (dict(json="{not json"), "structured_outputs.json: not valid JSON"),
                          (dict(json=[1]), "structured_outputs.json"),
                          (dict(regex="a(b"), "structured_outputs.regex: invalid regex"),
                          (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar: invalid EBNF"),
                          (dict(choice=[]), "structured_outputs.choice"), (dict(choice="yes"), "structured_outputs.choice"),
                          (dict(json_object=1), "structured_outputs.json_object must be a bool")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).key == StructuredOutputsParams(json=SCHEMA).key


def test_sampler_applies_the_bitmask_to_flagged_rows_only():
    """Rows with FLAG_MASKED sample (greedy and drawn) only tokens whose bit is set; other rows ignore their mask
    row; the logprobs stay the model's. Checked to fail: with the mask's `lax.cond` removed from `sample`, the
    flagged rows take their unmasked argmax."""
    rng = np.random.default_rng(0)
    vocab, rows, num_slots = 70, 4, 2
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    allowed = rng.random((rows, vocab)) < 0.2
    allowed[:, np.argmax(logits, axis=1)] = False  # the unmasked argmax is never allowed
    bits = np.zeros((rows, 96), bool)
    bits[:, :vocab] = allowed
    mask = np.packbits(bits.reshape(rows, -1, 32)[:, :, ::-1], axis=2).view(">u4").astype(np.uint32).view(np.int32)
    mask = mask.reshape(rows, 3)
    flags = np.array([FLAG_MASKED, FLAG_MASKED, 0, FLAG_MASKED], np.int32)
    s = SamplingArrays(temperature=jnp.array([0.0, 1.0, 0.0, 1.0]), top_k=jnp.zeros(rows, jnp.int32),
                       top_p=jnp.ones(rows), seeds=jnp.arange(rows), counters=jnp.zeros(rows, jnp.int32),
                       want_logprobs=jnp.zeros(rows, jnp.int32), slot_ids=jnp.zeros(rows, jnp.int32),
                       flags=jnp.asarray(flags), min_p=jnp.zeros(rows), presence_penalty=jnp.zeros(rows),
                       frequency_penalty=jnp.zeros(rows), repetition_penalty=jnp.ones(rows),
                       num_output=jnp.zeros(rows, jnp.int32), recent=jnp.full((rows, MAX_BAN_TOKENS - 1), -2, jnp.int32))
    tables = SlotTables(bias_ids=jnp.zeros((num_slots, MAX_LOGIT_BIAS), jnp.int32),
                        bias_values=jnp.zeros((num_slots, MAX_LOGIT_BIAS)),
                        bans=jnp.full((num_slots, 4, MAX_BAN_TOKENS + 1), -1, jnp.int32),
                        allowed=jnp.ones((num_slots, vocab), bool))
    history = TokenHistory(output_counts=jnp.zeros((num_slots, vocab), jnp.int32),
                           prompt_mask=jnp.zeros((num_slots, vocab), bool))
    for _ in range(3):
        tokens, logp, _, _ = jax.jit(sample)(jnp.asarray(logits), s, tables, history, jnp.asarray(mask))
        tokens = np.asarray(tokens)
        for i in (0, 1, 3):
            assert allowed[i, tokens[i]], (i, tokens[i])
        assert tokens[0] == np.argmax(np.where(allowed[0], logits[0], -np.inf))
        assert tokens[2] == np.argmax(logits[2])  # not flagged: its mask row is not read
        model_logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(model_logp)[np.arange(rows), tokens], rtol=1e-5)
        s = type(s)(**{**s.__dict__, "counters": s.counters + 1})


# ------------------------------------------------------------------------------------------ offline
def test_json_schema_output_parses_and_validates(offline):
    """Sampled at temperature 1 (seeds 0-4), every output is JSON valid under the schema and ends with "stop"; the
    grammar is compiled once for the five requests. Checked to fail: with the rows' FLAG_MASKED not set
    (`Sequence.set_matcher`) the text is noise and does not parse."""
    grammars = offline.engine.grammars
    before = grammars.num_compiled if grammars is not None else 0
    for out in sampled(offline, StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out
        validate(json.loads(out.text))
    assert offline.engine.grammars.num_compiled - before <= 1


def test_regex_choice_grammar_and_json_object(offline):
    """The regex fully matches, the output is one of the choices, a sentence of the EBNF grammar, a JSON object.
    Checked to fail: the same with FLAG_MASKED unset (noise); with the matcher's `terminated` stop removed, the
    ignore_eos request runs on to max_tokens (the grammar offers nothing but EOS, which does not stop it)."""
    for out in sampled(offline, StructuredOutputsParams(regex=REGEX)):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out
    outs = sampled(offline, StructuredOutputsParams(choice=CHOICES))
    assert all(o.finish_reason == "stop" and o.text in CHOICES for o in outs), outs
    assert len({o.text for o in outs}) > 1  # sampled, not forced
    for out in sampled(offline, StructuredOutputsParams(grammar=GRAMMAR)):
        assert out.finish_reason == "stop" and re.fullmatch(r"(x|yy)+!", out.text), out
    for out in sampled(offline, StructuredOutputsParams(json_object=True), max_tokens=120):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out
        else:  # a random model may write a long object: it is a prefix of one
            assert out.finish_reason == "length" and out.text.startswith("{")
    for out in sampled(offline, StructuredOutputsParams(choice=CHOICES), ignore_eos=True):
        assert out.finish_reason == "stop" and out.text in CHOICES, out


def test_logprobs_stay_the_models(offline):
    """A constrained token's reported logprob is the model's (what the same model gives that token as part of a
    prompt), not one renormalised over the allowed tokens. Checked to fail: taking the token's logprob in `sample`
    from the masked logits gives larger values."""
    so = StructuredOutputsParams(regex=REGEX)
    out = offline.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured_outputs=so,
                                                    logprobs=1), use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    scored = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    n = len(out.prompt_token_ids)
    for k, token in enumerate(out.outputs[0].token_ids):
        want, got = float(scored.prompt_logprobs[n + k][token]), float(out.outputs[0].logprobs[k][token])
        assert abs(got - want) < 1e-4, (k, token, got, want)


def test_with_n_bias_allowed_tokens_and_stop_ids(offline, ckpt):
    """n=3 gives three valid documents; a +100 logit bias on a token the grammar forbids never makes it appear;
    allowed_token_ids that hold the grammar's tokens keep it valid. Checked to fail: with FLAG_MASKED unset the +100
    token is taken at once."""
    from jhybrid.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    so = StructuredOutputsParams(json=SCHEMA)
    out = offline.generate([PROMPT], SamplingParams(n=3, max_tokens=100, temperature=1.0, seed=7, structured_outputs=so),
                           use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        validate(json.loads(c.text))
    forbidden = tok.encode("fox", add_special_tokens=False)[0]
    for c in sampled(offline, StructuredOutputsParams(regex=REGEX), logit_bias={forbidden: 100.0}):
        assert forbidden not in c.token_ids and re.fullmatch(REGEX, c.text), c
    allowed = sorted({t for s in ["a", "b", "c", "-"] + [str(d) for d in range(10)] + [" ", "x", "y", "z"]
                      for t in tok.encode(s, add_special_tokens=False)} | {0})
    for c in sampled(offline, StructuredOutputsParams(regex=REGEX), allowed_token_ids=allowed):
        assert set(c.token_ids) <= set(allowed) and re.fullmatch(REGEX, c.text), c


def test_min_tokens_holds_stop_tokens_while_the_grammar_can_go_on(offline):
    """Before `min_tokens` the stop tokens are left out of the mask while the grammar allows anything else (the
    outputs of an open-ended regex are at least that long), and let through when they are all it allows (a choice
    still ends, "stop", shorter than min_tokens). Checked to fail: with `hold_stop` False in `_token_mask` a
    regex output is 2 tokens long. (The min_tokens stop bans of `ban_rows`, left out for structured requests, do
    not show here: this checkpoint's EOS is token 0, which is what a fully masked row's argmax picks.)"""
    outs = sampled(offline, StructuredOutputsParams(regex="[a-c]+"), max_tokens=40, min_tokens=6)
    for out in outs:
        assert len(out.token_ids) >= 6 and re.fullmatch("[a-c]+", out.text), out
    for out in sampled(offline, StructuredOutputsParams(choice=CHOICES), min_tokens=8):
        assert out.finish_reason == "stop" and out.text in CHOICES, out


def test_batch_fill_equals_row_by_row(offline):
    """`fill_bitmask` (the library's threaded batch fill, what a step with several constrained rows uses) writes the
    same rows as `Matcher.fill` one by one, with matchers in different states, the JSON control-byte mask and
    `hold_stop`; rows it is not given stay all-allowed. Checked to fail with `_finish` skipped in the batch path
    (the JSON rows kept tokens with control bytes)."""
    from jhybrid.engine.structured_output import fill_bitmask, new_bitmask

    grammars = offline.engine._grammar_cache()
    tok = offline.engine.tokenizer
    rows = [(StructuredOutputsParams(json=SCHEMA), '{"name": "a'), (StructuredOutputsParams(regex="[a-c]+x"), "ab"),
            (StructuredOutputsParams(choice=CHOICES), ""), (StructuredOutputsParams(json_object=True), "{")]
    matchers = []
    for so, prefix in rows:
        m = grammars.matcher(so)
        for t in tok.encode(prefix):
            assert m.accept(t), (so, prefix, t)
        matchers.append(m)
    vocab = offline.engine.model.cfg.vocab_size
    for hold in (False, True):
        want, got = new_bitmask(6, vocab), new_bitmask(6, vocab)
        spec = [(i + 1, m, hold) for i, m in enumerate(matchers)]
        for row, m, h in spec:
            m.fill(want, row, h)
        fill_bitmask(got, spec)
        np.testing.assert_array_equal(got, want)
        assert (got[0] == -1).all() and (got[5] == -1).all() and not (got[1:5] == -1).all()


def test_recompute_and_abort_keep_the_matcher_right(offline):
    """Every running sequence sent back for recompute mid-generation (the engine's failed-step recovery drops the
    step in flight, its tokens unread) resumes its matcher where its tokens are: the outputs equal those of an
    uninterrupted run. An aborted constrained request frees its matcher. Checked to fail: with `_requeue_all`
    also giving each sequence a fresh matcher (grammar state lost), the resumed outputs differ."""
    eng = offline.engine
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=s, structured_outputs=so) for s in SEEDS]
    want = [o.outputs[0].token_ids for o in offline.generate([PROMPT] * len(params), params, use_tqdm=False)]
    seqs = [eng.add_request(f"re{i}", PROMPT, p) for i, p in enumerate(params)]
    for _ in range(12):
        eng.step()
    assert any(len(s.output_ids) > 2 for s in seqs)
    eng._requeue_all()
    victim = eng.add_request("aborted", PROMPT, params[0])
    eng.step()
    eng.abort("aborted")
    assert victim.matcher is None and victim.finish_reason == "abort"
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == want
    for s in seqs:
        validate(json.loads(s.text))
        eng.release(s.request_id)
    eng.release("aborted")
    assert eng.blocks.num_used == 0 and eng.slots.num_used == 0


def _structured_run(offline, split: bool, recover_after: int | None = None, dispatch_thread: bool = False):
    """Sampled JSON-schema and regex requests on `offline`'s engine, its steps split or not; with `recover_after`,
    the step after that many fails in its program call, once (the engine recovers: every sequence is recomputed,
    the step before it dropped unread). Returns the outputs and how many steps ran split."""
    eng, runner = offline.engine, offline.engine.runner
    runner.split_sampling, threaded, real = split, runner.dispatch_thread, runner._call
    runner.dispatch_thread = dispatch_thread
    runner.wait_split_compiles()
    before = runner.num_split_steps
    sos = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)]
    seqs = [eng.add_request(f"split{split}-{i}", PROMPT, SamplingParams(max_tokens=60, temperature=1.0, seed=s,
                                                                         structured_outputs=sos[i % 2]))
            for i, s in enumerate(SEEDS)]
    try:
        for _ in range(recover_after or 0):
            eng.step()
        if recover_after:
            assert any(len(s.output_ids) > 2 for s in seqs) and any(not s.is_finished for s in seqs)
            def fail(*args, **kwargs):
                runner._call = real
                raise RuntimeError("injected step failure")

            runner._call = fail
        failures = eng._failed_steps_total
        while eng.has_unfinished():
            assert eng.safe_step()[1] == []  # a failed step fails no request: it runs again
            runner.wait_split_compiles()  # a bucket met for the first time compiles in the background
        assert eng._failed_steps_total - failures == (1 if recover_after else 0)
    finally:
        runner.drain()
        runner.split_sampling, runner.dispatch_thread, runner._call = True, threaded, real
    for s in seqs:
        assert s.finish_reason in ("stop", "length"), (s.finish_reason, s.error)
        eng.release(s.request_id)
    return [s.output_ids for s in seqs], runner.num_split_steps - before


def test_split_steps_sample_what_whole_steps_do(offline):
    """A step whose grammar masks need the previous step's tokens runs split (forward dispatched, masks filled on
    the host meanwhile, then the sampling program); the tokens equal those of the whole-step path (the host takes
    the previous tokens into the matchers first, `_read_matchers`), and both equal the whole-step path recovering
    from a step that failed after its matchers took the step before's tokens (dropped unread: `Matcher.undo`),
    and recovering from a step whose call failed on the dispatch thread (the GPU's path).
    Checked to fail: with `sample_split` filling the masks before the engine reads the previous step, the split
    run raises (a matcher one token behind its row); with `_requeue_all` not undoing the matchers, the recovering
    run raises (a matcher one token ahead). (`_requeue_all`'s drain of a call queued behind the failed one: this
    module run with JHYBRID_DISPATCH_THREAD=1 ended the engine without it, EngineFailure; not caught every run.)"""
    split, num_split = _structured_run(offline, split=True)
    whole, num_whole = _structured_run(offline, split=False)
    recovered, _ = _structured_run(offline, split=False, recover_after=10)
    threaded, _ = _structured_run(offline, split=False, recover_after=10, dispatch_thread=True)
    assert num_split > 10 and num_whole == 0
    assert split == whole == recovered == threaded


def test_nothing_compiles_after_warmup(offline):
    """Structured requests of every kind, mixed with free ones, compile no program after warm-up (the bitmask is a
    runtime input of the step programs). Checked to fail: with the host mask put through one eager `jnp` op in
    `_token_mask` (work on the request path outside the step programs), the watch counts its compiles."""
    work = [(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=1, structured_outputs=so))
            for so in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
                       StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR))]
    work += [(PROMPT, SamplingParams(max_tokens=10, temperature=0.0)), (PROMPT, SamplingParams(max_tokens=10, logprobs=2))]
    offline.engine.runner.wait_split_compiles()
    with CompileWatch(background=SPLIT_COMPILE_THREAD) as watch:  # split programs compile off the request path
        offline.generate([p for p, _ in work], [sp for _, sp in work], use_tqdm=False)
    assert watch.count == 0, f"{watch.count} programs compiled after warm-up"
    assert offline.engine.stats()["programs_compiled_after_ready"] == 0


# ------------------------------------------------------------------------------------------ server
def post(url: str, path: str = "/v1/completions", **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)


def test_openai_client_response_format_and_structured_outputs(served):
    """Chat with `response_format` json_schema and json_object, completions with `extra_body={"structured_outputs":
    ...}` (regex, choice, json, grammar) and the older `guided_*` fields, through the `openai` client.
    Checked to fail: with `fields["structured_outputs"]` not set in `_sampling_fields`, the outputs are noise
    (and with `guided_regex` back in protocol.UNSUPPORTED, the guided requests answer 400)."""
    import openai

    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Give me a user as JSON"}]
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=90, temperature=1.0, seed=seed,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "user", "schema": SCHEMA, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        validate(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=90, temperature=1.0, seed=2,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for body, check in [({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
                        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
                        ({"structured_outputs": {"json": SCHEMA}}, lambda t: validate(json.loads(t)) is None),
                        ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(r"(x|yy)+!", t)),
                        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
                        ({"guided_json": SCHEMA}, lambda t: validate(json.loads(t)) is None),
                        ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"(x|yy)+!", t))]:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, temperature=1.0, seed=4, n=2,
                                      extra_body=body)
        for c in r.choices:
            assert c.finish_reason == "stop" and check(c.text), (body, c.text)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "days": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
              "additionalProperties": False}}}]


def test_tool_choice_required_and_named_are_constrained(served):
    """tool_choice "required" and a named function on the real engine (random weights, temperature 1): every
    answer is a tool call of a given tool whose arguments validate against that tool's schema, through the
    `openai` client. Checked to fail: with `sampling_fields` dropped from the tool plan in `_generate`, the
    outputs are noise (required: returned as text with no tool_calls; named: arguments that do not parse)."""
    import openai

    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for seed in SEEDS:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=90, temperature=1.0, seed=seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.content is None, (choice, c)
            calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
            assert len(calls) == 1, calls
            if choice != "required":
                assert calls[0][0] == "get_time"
            validate(calls[0][1], schemas[calls[0][0]])


def test_grammar_checks_do_not_hold_up_other_requests(served, monkeypatch):
    """A request's constraint is built and checked on a worker thread (the first one imports xgrammar and torch,
    ~17 s here): while one takes 1.5 s (`to_grammar` slowed by hand), the event loop answers /v1/models at once.
    Checked to fail: with `_constraint` calling `req.structured_outputs_params()` on the event loop, /v1/models
    waited ~1.2 s."""
    _, url = served
    original = StructuredOutputsParams.to_grammar

    def slow(self):
        time.sleep(1.5)
        return original(self)

    monkeypatch.setattr(StructuredOutputsParams, "to_grammar", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, url, prompt=PROMPT, max_tokens=8, structured_outputs={"regex": "[ab]+"})
        time.sleep(0.3)
        start = time.perf_counter()
        r = httpx.get(url + "/v1/models", timeout=10)
        waited = time.perf_counter() - start
        assert r.status_code == 200 and waited < 0.6, f"/v1/models waited {waited:.2f} s behind a grammar check"
        done = pending.result()
        assert done.status_code == 200 and re.fullmatch("[ab]+", done.json()["choices"][0]["text"]), done.text


def test_without_xgrammar_a_400_names_the_extra(served, monkeypatch):
    """xgrammar is the `structured` extra (it brings PyTorch): without it, a structured request (or a tool_choice
    that needs one) is a 400 saying what to install, and the server goes on. Checked to fail: without the
    ImportError branch of `_constraint` the request answered 500."""
    _, url = served
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    r = post(url, prompt=PROMPT, max_tokens=4, structured_outputs={"regex": "[ab]+x"})
    assert r.status_code == 400 and "jhybrid[structured]" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=4, tools=TOOLS,
             tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert post(url, prompt=PROMPT, max_tokens=2).status_code == 200


def test_refusals_name_the_field_and_nothing_compiles(served):
    """Bad schema / regex / grammar, two constraints at once, unknown options, an unknown response_format type:
    400 naming the field. Then the warmed-up engine has compiled nothing since it was ready. Checked to fail:
    without the ValueError-to-400 mapping of `structured_outputs_params` a bad schema answers 500."""
    engine, url = served
    cases = [(dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
              "response_format.json_schema.schema"),
             (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema"),
             (dict(response_format={"type": "xml"}), "response_format"),
             (dict(structured_outputs={"regex": "a(b"}), "structured_outputs.regex"),
             (dict(structured_outputs={"grammar": "root ::= nope"}), "structured_outputs.grammar"),
             (dict(structured_outputs={"json": {"type": "nope"}}), "structured_outputs.json"),
             (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
             (dict(structured_outputs={"lark": "x"}), "structured_outputs.lark"),
             (dict(structured_outputs={"regex": "a", "whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
             (dict(guided_regex="a(b"), "guided_regex"), (dict(guided_json={"type": "nope"}), "guided_json"),
             (dict(guided_choice=[]), "guided_choice"),
             (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex"),
             (dict(guided_whitespace_pattern=" "), "guided_whitespace_pattern")]
    for body, field in cases:
        r = post(url, prompt=PROMPT, max_tokens=4, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"].startswith(field), (body, r.json())
    r = post(url, prompt=PROMPT, max_tokens=8, response_format={"type": "text"})
    assert r.status_code == 200, r.text
    assert engine.engine.stats()["programs_compiled_after_ready"] == 0
