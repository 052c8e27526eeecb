"""A step's read in two halves around the next step's dispatch (`LLMEngine.step`, `DEFER_POSTPROCESS`): its
tokens and the stops they decide before the schedule, its text, logprob entries and stop strings' effects after
the dispatch. Where the second half runs must change no output, and it must run after the dispatch."""

from __future__ import annotations

import pytest

from jhybrid import LLM, SamplingParams
from jhybrid.engine import llm_engine
from jhybrid.engine.structured_output import StructuredOutputsParams
from tests.example_ckpt import write_example_checkpoint

# 16-token steps: prompts are chunked beside decodes; 5 rows of 8: requests wait for a row
SHAPES = dict(dtype="float32", max_num_seqs=5, max_model_len=128, max_num_batched_tokens=16)
PROMPTS = ["The quick brown fox jumps over the lazy dog", "In the beginning", "And it came to pass",
           "Who is", "Hello"]


def _params() -> list[SamplingParams]:
    """Requests that end every way a sequence ends: a stop string (with and without its text), EOS, a stop
    token id, the length limit, a grammar's end; with logprobs, min_tokens and sampling beside."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = []
    for i in range(10):
        kw = dict(max_tokens=6 + 3 * i, temperature=1.0, seed=i)
        kind = i % 5
        if kind == 0:
            kw.update(stop=["e", "o"], logprobs=2)
        elif kind == 1:
            kw.update(stop=["a", " t"], include_stop_str_in_output=True, min_tokens=2)
        elif kind == 2:
            kw.update(stop_token_ids=list(range(40, 400)), logprobs=1)
        elif kind == 3:
            kw.update(structured_outputs=StructuredOutputsParams(json=schema), max_tokens=60)
        else:
            kw.update(temperature=0.0, ignore_eos=True, logprobs=3)
        out.append(SamplingParams(**kw))
    return out


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_example_checkpoint(tmp_path_factory.mktemp("deferred") / "ckpt", seed=7), **SHAPES)


def _outputs(llm: LLM, defer: bool, monkeypatch) -> list[tuple]:
    monkeypatch.setattr(llm_engine, "DEFER_POSTPROCESS", defer)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(10)]
    got = llm.generate(prompts, _params(), use_tqdm=False)
    return [(o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs) for r in got for o in r.outputs]


def _same(a: list[tuple], b: list[tuple]) -> None:
    """Equal outputs; logprob values to 1e-5 (XLA:CPU's reductions differ by an ulp from one run to the next,
    whatever the read order)."""
    assert [x[:4] for x in a] == [y[:4] for y in b]
    for x, y in zip(a, b):
        assert (x[4] is None) == (y[4] is None)
        for u, v in zip(x[4] or (), y[4] or (), strict=True):
            entries = lambda d: [(t, e.rank, e.decoded_token) for t, e in d.items()]  # noqa: E731
            assert entries(u) == entries(v)
            assert [e.logprob for e in u.values()] == pytest.approx([e.logprob for e in v.values()], abs=1e-5)


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_the_text_half_after_the_dispatch_changes_no_output(llm, monkeypatch, split):
    """The same texts, tokens, finish and stop reasons and logprob entries with the second half of a step's read
    after the next dispatch as before the schedule. The workload ends requests by stop strings (both kinds), stop
    token ids, length and a grammar; its grammar steps run split (`ModelRunner.split_sampling`) or whole (the
    matchers take a step's tokens in `execute`, `read_matchers`). Checked to fail ("whole"): with `_finish_lit`
    checking the grammar's end again (as the one-piece read did), a JSON request's matcher has taken the next
    step's EOS by then and its closing brace is cut, with the deferral only."""
    monkeypatch.setattr(llm.engine.runner, "split_sampling", split)
    before = _outputs(llm, False, monkeypatch)
    after = _outputs(llm, True, monkeypatch)
    reasons = {r[2] for r in before}
    assert {"stop", "length"} <= reasons, reasons
    assert any(r[3] is not None for r in before)  # a stop string or stop token id ended one
    _same(after, before)


def test_the_text_half_runs_after_the_next_dispatch(llm, monkeypatch):
    """In a call that reads a step and dispatches the next, the runner's `execute` comes before the read's text
    (`_finish_lit`) with the deferral on, and after it with it off. Checked to fail: with `_finish_lit` called
    before the schedule whatever `DEFER_POSTPROCESS` says, the first assertion fails."""
    eng = llm.engine
    events: list[str] = []
    execute, finish = eng.runner.execute, eng._finish_lit

    def traced_execute(*a, **k):
        events.append("dispatch")
        return execute(*a, **k)

    def traced_finish():
        if eng._lit is not None:
            events.append("text")
        return finish()

    monkeypatch.setattr(eng.runner, "execute", traced_execute)
    monkeypatch.setattr(eng, "_finish_lit", traced_finish)
    orders = {}
    for defer in (True, False):
        monkeypatch.setattr(llm_engine, "DEFER_POSTPROCESS", defer)
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        eng.add_request(f"order-{defer}", PROMPTS[0], sp)
        pairs = []
        while eng.has_unfinished():
            events.clear()
            eng.step()
            if "dispatch" in events and "text" in events:
                pairs.append(tuple(events))
        eng.release(f"order-{defer}")
        orders[defer] = set(pairs)
    assert orders[True] == {("dispatch", "text")}, orders
    assert orders[False] == {("text", "dispatch")}, orders


def _serve(eng, prompts, sp, tag: str) -> list:
    """Runs `prompts` as the server's engine thread does (`safe_step`: a step that raises fails its request)."""
    seqs = [eng.add_request(f"{tag}-{i}", p, sp) for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.safe_step()
    for seq in seqs:
        eng.release(seq.request_id)
    assert eng.blocks.num_used == 0 and eng.slots.num_used == 0
    return [(s.finish_reason, s.text, s.output_ids) for s in seqs]


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "before-schedule"])
def test_a_detokenizer_fault_in_the_text_half_fails_its_request_alone(llm, monkeypatch, defer):
    """A detokenizer that raises on one request's tokens, in a step whose first row is that request: the request
    fails, the others' text and tokens are what they are without the fault. Checked to fail: with the text half
    stopping at the raising row (no per-row `try` in `_finish_lit`), the rows after it have their tokens taken
    but not their text, and a token's text is missing from their output."""
    monkeypatch.setattr(llm_engine, "DEFER_POSTPROCESS", defer)
    eng, tok = llm.engine, llm.engine.tokenizer
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    others = [[30, 31, 32], [33, 34, 35], [36, 37, 38]]
    ref = _serve(eng, others, sp, f"ref-{defer}")
    real = tok.decode

    def decode(ids, skip_special_tokens=True):
        ids = list(ids)
        if 406 in ids and len(ids) > 5:  # the first prompt's, once it has generated a few tokens
            raise UnicodeError("injected decode fault")
        return real(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", decode)
    got = _serve(eng, [[42, 43, 406]] + others, sp, f"fault-{defer}")
    assert got[0][0] == "error"
    assert got[1:] == ref


def test_logprob_entries_are_plain_numbers_whichever_half_reads_them(llm):
    """A request with stop strings is read whole in the first half, the others in the second; both give logprob
    entries keyed by Python ints with float values (a server writes them as JSON). Checked to fail: with the
    first half taking the top logprobs as NumPy arrays, the stop-string request's keys are NumPy ints."""
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, **kw)
              for kw in (dict(stop=["\x00never"]), {})]
    for r in llm.generate(PROMPTS[:2], params, use_tqdm=False):
        entries = r.outputs[0].logprobs
        assert entries and all(type(t) is int and type(e.logprob) is float for d in entries for t, e in d.items())
