"""The offline API in vLLM's shape (issue 19): a vLLM script runs unchanged against `jhybrid.LLM`.

The bundled model (`jhybrid.default_model_path()`) in float32 on `test_bundled_model.py`'s engine shapes, so that
in a run of the suite its step programs are compiled already. References are the engine run directly
(`LLMEngine.add_request` + `step`, no output wrapping), runs with explicit seeds, and text written out by hand.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

import jhybrid
from jhybrid import LLM, Logprob, SamplingParams
from jhybrid.engine.outputs import _Decoder, prompt_logprobs
from jhybrid.engine.prompts import continue_final, parse_prompts, template_message
from jhybrid.engine.vllm_options import translate

MODEL = jhybrid.default_model_path()
SHAPES = dict(dtype="float32", max_num_seqs=1, max_model_len=64)  # test_bundled_model.py's engine
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
GREEDY = dict(temperature=0.0, ignore_eos=True)
_ref_ids = itertools.count()


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, **SHAPES)


def engine_run(llm, prompt, sp):
    """The engine's own result for one request: (output ids, text, finish_reason)."""
    seq = llm.engine.add_request(f"ref-{next(_ref_ids)}", prompt, sp)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.release(seq.request_id)
    return list(seq.output_ids), seq.text, seq.finish_reason


def test_vllm_script_gives_the_engines_tokens(llm):
    """Prompt dicts (text and token ids) with a list of SamplingParams, read as a vLLM script reads them
    (`outputs[0].text / token_ids / finish_reason / stop_reason`, `cumulative_logprob`, `Logprob.logprob`): the same
    tokens and text as the engine gives each request alone; `stop_reason` is the stop token id or string that ended
    it. Checked to fail: with prompt dicts passed on to the engine as they are (it cannot encode a dict), and with
    `stop_reason` always None."""
    tok = llm.tokenizer
    ids = tok.encode("And God said")  # as the engine encodes the text: the token-ids prompt continues as it does
    base_ids, base_text, _ = engine_run(llm, "And God said", SamplingParams(max_tokens=8, **GREEDY))
    stop_id = base_ids[4]
    stop_str = base_text[len(base_text) // 2: len(base_text) // 2 + 3]
    prompts = [{"prompt": "And God said"}, {"prompt_token_ids": ids}, "And God said", {"prompt": "And God said"},
               [{"prompt": "And God said"}]]
    params = [SamplingParams(max_tokens=8, logprobs=2, **GREEDY), SamplingParams(max_tokens=3, **GREEDY),
              SamplingParams(max_tokens=8, stop_token_ids=[stop_id], **GREEDY),
              SamplingParams(max_tokens=8, stop=["\x00", stop_str], **GREEDY),
              SamplingParams(max_tokens=8, stop=[stop_str], include_stop_str_in_output=True, **GREEDY)]
    outputs = llm.generate(prompts[:4], params[:4], use_tqdm=False) + llm.generate(prompts[4], params[4], use_tqdm=False)
    assert len(outputs) == 5 and all(len(out.outputs) == 1 and out.finished for out in outputs)
    text_out, ids_out, stop_tok, stop_text, stop_kept = outputs
    assert text_out.prompt == "And God said" and ids_out.prompt is None and ids_out.prompt_token_ids == ids
    first = text_out.outputs[0]
    assert (first.index, first.token_ids, first.text, first.finish_reason, first.stop_reason) == \
        (0, base_ids, base_text, "length", None)
    assert ids_out.outputs[0].token_ids == base_ids[:3] and base_text.startswith(ids_out.outputs[0].text)
    assert stop_tok.outputs[0].finish_reason == "stop" and stop_tok.outputs[0].stop_reason == stop_id
    assert stop_tok.outputs[0].token_ids == base_ids[: base_ids.index(stop_id) + 1]
    assert stop_text.outputs[0].finish_reason == "stop" and stop_text.outputs[0].stop_reason == stop_str
    assert stop_text.outputs[0].text == base_text[: base_text.find(stop_str)]
    assert stop_kept.outputs[0].stop_reason == stop_str
    assert stop_kept.outputs[0].text == base_text[: base_text.find(stop_str) + len(stop_str)]
    for out in outputs:  # jhybrid's older names read the first completion
        c = out.outputs[0]
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == \
            (c.token_ids, c.text, c.finish_reason, c.stop_reason)
    # logprobs as vLLM hands them out: the sampled token's Logprob at each position, ranked; their sum is cumulative
    sampled = [pos[t] for pos, t in zip(first.logprobs, first.token_ids, strict=True)]
    assert all(lp.rank == 1 and lp.decoded_token == tok.decode([t]) for lp, t in zip(sampled, first.token_ids))
    assert first.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in sampled), rel=1e-6)
    assert [lp.rank for lp in first.logprobs[0].values()] == [1, 2]


def test_n_and_best_of(llm):
    """`n`: n completions, candidate k seeded `seed + k` (each equals a single request with that seed: the run is
    reproducible and the candidates differ). `best_of`: of the best_of candidates, the n of highest cumulative
    logprob, highest first, where each candidate's cumulative logprob is recomputed from its own per-token
    logprobs (`logprobs=0`: each position holds the sampled token alone). Checked to fail: with every candidate
    given the request's own seed (identical candidates), with the candidates kept in index order instead of sorted
    (the kept indices are [0, 1], not [0, 2]), and with the sampled token left out of `logprobs` (KeyError)."""
    prompt = "And God said"
    hot = dict(temperature=1.5, max_tokens=4, ignore_eos=True, seed=11)
    (every,) = llm.generate(prompt, SamplingParams(n=3, logprobs=0, **hot), use_tqdm=False)
    assert [c.index for c in every.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in every.outputs}) == 3, "seeded candidates must differ"
    (single,) = llm.generate(prompt, SamplingParams(**{**hot, "seed": 11 + 2}), use_tqdm=False)
    assert single.outputs[0].token_ids == every.outputs[2].token_ids, "candidate k must be seeded seed + k"
    own = [sum(pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)) for c in every.outputs]
    np.testing.assert_allclose([c.cumulative_logprob for c in every.outputs], own, rtol=1e-6)
    want = [int(i) for i in np.argsort(-np.array(own), kind="stable")[:2]]
    assert want != [0, 1], "the seed was chosen so that the best candidates are not the first ones"
    (best,) = llm.generate(prompt, SamplingParams(n=2, best_of=3, **hot), use_tqdm=False)
    assert [c.index for c in best.outputs] == want
    assert [c.token_ids for c in best.outputs] == [every.outputs[i].token_ids for i in want]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_prompt_logprobs_as_vllm_logprobs():
    """The engine's prompt log-probabilities ({prompt token, then the top-k}) become `Logprob`s that read as
    floats and as vLLM's (`.logprob`, `.rank`, `.decoded_token`): the top-k ranked by value, the prompt token
    ranked only when it is one of them. Checked to fail: with ranks given in the entry's order (the prompt
    token, first, would be rank 1)."""
    decode = _Decoder(None)
    entries = [None, {7: -2.0, 3: -0.5, 9: -1.0}, {4: -0.2, 8: -1.5}]  # k = 2: token 7 outside, token 4 inside
    got = prompt_logprobs(entries, [1, 7, 4], 2, decode)
    assert got[0] is None
    assert {t: (lp.logprob, lp.rank) for t, lp in got[1].items()} == {7: (-2.0, None), 3: (-0.5, 1), 9: (-1.0, 2)}
    assert {t: (lp.logprob, lp.rank) for t, lp in got[2].items()} == {4: (-0.2, 1), 8: (-1.5, 2)}
    assert got[1][3] == -0.5 and isinstance(got[1][3], float) and list(got[1]) == [7, 3, 9]
    assert Logprob(-1.0, 2, "x") == -1.0 and repr(Logprob(-1.0, 2, "x")).startswith("Logprob(logprob=-1.0, rank=2")


def test_chat_equals_generate_on_the_rendered_template(llm, tmp_path):
    """`LLM.chat` renders the conversation with the template (checked against the text written out by hand),
    tokenizes it without added special tokens and generates: the same tokens as `generate` on those ids; the
    checkpoint's own template (tokenizer_config.json) is found; a checkpoint without one raises naming the fix.
    Checked to fail: with `add_generation_prompt` not passed to the template (add_generation_prompt=False still
    renders `<assistant>`), and with the checkpoint's template not loaded (the "no chat template" error)."""
    messages = [{"role": "user", "content": "And God said"}]
    text = "<user>And God said\n<assistant>"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    (want,) = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    (got,) = llm.chat(messages, sp, chat_template=TEMPLATE, use_tqdm=False)
    assert got.prompt == text and got.prompt_token_ids == ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].text == want.outputs[0].text
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "Let"}]], SamplingParams(max_tokens=1),
                   chat_template=TEMPLATE,
                   add_generation_prompt=False, use_tqdm=False)
    assert [o.prompt for o in two] == ["<user>And God said\n", "<user>And God said\n<assistant>Let\n"]
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(messages, sp, use_tqdm=False)

    for name in os.listdir(MODEL):  # the bundled model with a chat template in its tokenizer_config.json
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(MODEL, name), tmp_path / name)
    with open(os.path.join(MODEL, "tokenizer_config.json")) as f:
        config = json.load(f)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (own,) = LLM(str(tmp_path), **SHAPES).chat(messages, sp, use_tqdm=False)
    assert own.prompt == text and own.outputs[0].token_ids == want.outputs[0].token_ids


def test_gpu_memory_utilization_reaches_the_planner(llm, monkeypatch):
    """`LLM(gpu_memory_utilization=...)` (vLLM's name; `memory_fraction` still works) is the share the cache
    planner gets; `jhybrid serve/generate --help` show `--gpu-memory-utilization`; vLLM's other options are
    translated (dtype "auto"), logged (enforce_eager) or refused naming the option. Checked to fail: with the
    planner given a fixed 0.9 (the first assertion), and without the `gpu_memory_utilization` field."""
    import jhybrid.engine.llm_engine as llm_engine
    from jhybrid.cli import _parser

    seen = []
    real = llm_engine.plan_cache
    monkeypatch.setattr(llm_engine, "plan_cache", lambda cfg, **kw: seen.append(kw["memory_fraction"]) or real(cfg, **kw))
    small = LLM(model=llm.model, gpu_memory_utilization=0.37, dtype="auto", enforce_eager=True, swap_space=4,
                seed=None, max_num_seqs=2, max_model_len=32)
    assert seen == [0.37] and small.engine.config.gpu_memory_utilization == 0.37
    LLM(llm.model, dtype=None, memory_fraction=0.25, max_num_seqs=2, max_model_len=32)
    assert seen == [0.37, 0.25]
    for command in (["serve", "DIR"], ["generate"]):
        for flag in ("--gpu-memory-utilization", "--memory-fraction"):
            assert _parser().parse_args([*command, flag, "0.5"]).gpu_memory_utilization == 0.5
    sub = next(a for a in _parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    assert all("--gpu-memory-utilization" in sub.choices[c].format_help() for c in ("serve", "generate"))
    assert translate("m", dict(dtype="half", num_gpu_blocks_override=9, tokenizer="m")) == \
        dict(dtype="float16", num_kv_blocks=9)
    assert translate("m", dict(dtype=np.dtype("float32"))) == dict(dtype="float32")
    for name, value in (("quantization", "awq"), ("tokenizer", "other"), ("kv_cache_dtype", "fp8")):
        with pytest.raises(ValueError, match=name):
            LLM(llm.model, **{name: value})


def test_use_tqdm_counts_prompts(llm, capsys):
    """A progress bar over prompts: it reaches the number of prompts (a prompt with n=2 counts once), with
    vLLM's speed postfix; on by default (stderr), off with use_tqdm=False. Checked to fail: with the bar never
    advanced (n stays 0)."""
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.postfix, self.format_dict = total, 0, kw.get("postfix"), {"elapsed": 1.0}
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    sp = SamplingParams(max_tokens=1, **GREEDY)
    llm.generate(["And God said", [5, 6, 7]], [sp, SamplingParams(n=2, **{**GREEDY, "max_tokens": 1})], use_tqdm=Bar)
    assert [(b.total, b.n) for b in bars] == [(2, 2)] and "toks/s" in bars[0].postfix
    capsys.readouterr()
    llm.generate("And God said", sp)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate("And God said", sp, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_bad_prompts_and_params_name_the_problem(llm):
    """Unsupported prompt dict keys and a wrong number of SamplingParams raise ValueError naming them; stream
    still yields the text that generate returns, and refuses n > 1. Checked to fail: with unknown dict keys
    accepted, and with the count of SamplingParams not checked (zip drops the third prompt)."""
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": 1}}, use_tqdm=False)
    with pytest.raises(ValueError, match="unknown key"):
        llm.generate({"text": "x"}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    sp = SamplingParams(max_tokens=3, **GREEDY)
    assert "".join(llm.stream({"prompt": "And God said"}, sp)) == llm.generate("And God said", sp, use_tqdm=False)[0].text
    with pytest.raises(ValueError, match="n=2"):
        next(llm.stream("And God said", SamplingParams(n=2)))


def test_prompt_forms_and_chat_messages():
    """The prompt forms `generate` takes (a string, token ids as a list or an array, prompt dicts, lists of any
    of them), text parts of a chat message joined as vLLM joins them, and `continue_final_message` cutting the
    rendered chat after the final message. Checked to fail: with a bare list of token ids taken as a list of
    prompts (each id is then refused as a prompt), and with the rendered text left uncut. Token ids come back as the
    integer array the engine takes without converting them again (an 8k-token list was converted twice)."""
    def parse(p):
        return [(text, ids if isinstance(ids, str) else [int(t) for t in ids]) for text, ids in parse_prompts(p)]

    assert parse("a b") == [("a b", "a b")]
    assert parse([3, 4]) == [(None, [3, 4])] and parse(np.array([3, 4])) == [(None, [3, 4])]
    assert parse([{"prompt": "a"}, {"prompt_token_ids": [5], "prompt": "x"}, [6, 7], "b"]) == \
        [("a", "a"), ("x", [5]), (None, [6, 7]), ("b", "b")]
    assert parse({"prompt_token_ids": np.array([1, 2])}) == [(None, [1, 2])] and parse([]) == []
    ids = parse_prompts([[3, 4]])[0][1]
    assert isinstance(ids, np.ndarray) and ids.dtype.kind == "i"
    assert parse([[3.0, 4]]) == [(None, [3, 4])]  # not an integer array: the per-element path
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(parts, "auto")["content"] == "a\nb"
    assert template_message(parts, "openai")["content"] == parts["content"]
    with pytest.raises(ValueError, match="image_url"):
        template_message({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "auto")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let"}]
    assert continue_final("<user>Hi\n<assistant>Let\n", messages) == "<user>Hi\n<assistant>Let"
