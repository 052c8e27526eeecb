"""The engine: continuous batching with preemption, sampling, stops, aborts, streaming (slot reuse:
test_slot_reuse.py). Engines of the tiny hybrid share one shape set (`ENGINE`, tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jhybrid
from jhybrid import LLM, SamplingParams
from tests.conftest import ENGINE, GREEDY, prompts_1_to_300


def assert_all_free(llm: LLM):
    eng = llm.engine
    assert eng.blocks.num_used == 0 and eng.blocks.num_free == eng.cache.num_blocks - 1, "KV blocks leaked"
    assert eng.slots.num_used == 0 and eng.slots.num_free == eng.cache.num_slots - 1, "state slots leaked"
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_batched_with_preemption_equals_alone_and_hf(tiny, alone):
    """16 prompts of 1..300 tokens, 4 at a time in a pool that forces preemption, in 128-token steps (chunked
    prefill beside decodes): each equals its run alone, and the runs alone equal HF `generate` (a prompt of
    one token, one of a step and a half, and the longest: three chunks)."""
    hf_model, model = tiny
    prompts = prompts_1_to_300()
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(model, **ENGINE)
    batched = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert_all_free(llm)
    for i, (p, out, want) in enumerate(zip(prompts, batched, alone)):
        assert out.token_ids == want, f"prompt {i} ({len(p)} tokens): batched != alone"
        assert out.finish_reason == "length"
    for i in (0, 10, 15):
        p = prompts[i]
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert alone[i] == want[0, len(p):].tolist(), f"prompt {i} ({len(p)} tokens): differs from HF"
    # bucketing keeps the number of compiled programs bounded: one decode bucket (4 rows), mixed steps of
    # 64 and 128 tokens
    assert len(llm.engine.runner.compiled_shapes) <= 3, llm.engine.runner.compiled_shapes


def test_seeded_sampling_does_not_depend_on_batching(tiny):
    _, model = tiny
    prompts = prompts_1_to_300(6)
    llm = LLM(model, **ENGINE)
    sp = [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(6)]
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, sp)]
    assert together == alone
    # top_k=1 and a tiny top_p both collapse sampling onto the greedy token
    greedy = llm.generate(prompts[:2], SamplingParams(max_tokens=8, **GREEDY))
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True, **kw))
        assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy], kw
    # different seeds give different samples at a high temperature (the sampler really samples)
    hot = [llm.generate([prompts[3]], SamplingParams(max_tokens=8, temperature=5.0, seed=s))[0].token_ids for s in (1, 2)]
    assert hot[0] != hot[1]


def test_logprobs_match_hf_log_softmax(tiny):
    hf_model, model = tiny
    prompt = prompts_1_to_300()[3]
    llm = LLM(model, **ENGINE)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=5, logprobs=3, **GREEDY))
    full = prompt + out.token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([full[:-1]])).logits[0, len(prompt) - 1 :].double()
    want = torch.log_softmax(logits, -1).numpy()
    assert len(out.logprobs) == 5
    for pos, top in enumerate(out.logprobs):
        assert len(top) == 3
        order = np.argsort(-want[pos])[:3]
        assert list(top) == order.tolist(), f"position {pos}: top-3 ids differ"
        np.testing.assert_allclose(list(top.values()), want[pos][order], rtol=1e-4, atol=1e-5)


def test_invalid_sampling_params_name_the_parameter():
    for kw, name in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                     (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
                     (dict(seed=-1), "seed"), (dict(logprobs=50), "logprobs"), (dict(stop=[""]), "stop"),
                     (dict(stop_token_ids=[-3]), "stop_token_ids"),
                     # values that pass a Python check but not the step's int32 / finite-float arrays
                     (dict(max_tokens=2**31), "max_tokens"), (dict(top_k=2**31), "top_k"),
                     (dict(stop_token_ids=[2**31]), "stop_token_ids"), (dict(temperature=float("nan")), "temperature"),
                     (dict(top_p=float("nan")), "top_p"), (dict(max_tokens=True), "max_tokens"),
                     (dict(logit_bias={2**31: 1.0}), "logit_bias"), (dict(logit_bias={1: 101.0}), "logit_bias"),
                     (dict(logit_bias={1: float("inf")}), "logit_bias"),
                     (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)


def test_too_long_prompt_fails_alone(tiny):
    _, model = tiny
    llm = LLM(model, **ENGINE)  # max_model_len 320
    outs = llm.generate([[1] * 330, [2, 3, 4], [5] * 320], SamplingParams(max_tokens=4, **GREEDY))
    assert outs[0].finish_reason == "error" and "max_model_len" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert outs[2].finish_reason == "error"
    assert_all_free(llm)


def test_generation_stops_at_max_model_len(tiny):
    _, model = tiny
    llm = LLM(model, **ENGINE)  # max_model_len 320
    (out,) = llm.generate([[7] * 316], SamplingParams(max_tokens=50, **GREEDY))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_no_step_feeds_tokens_past_the_length_limit(tiny):
    """A sequence whose sampled-but-unread token reaches its max_tokens (or max_model_len) gets no further step:
    the engine runs one step ahead of its reads, and that step's row would be wasted work (one decode step after
    every length-limited request; the floors' 8k prefill row paid a whole decode step for it). Checked to fail
    without `Scheduler._ends_by_length`."""
    _, model = tiny
    llm = LLM(model, **ENGINE)  # max_model_len 320, 128-token steps
    fed = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda sched, prev: fed.append([r.num_tokens for r in sched.rows]) or execute(sched, prev)
    cases = [([5] * 40, 1, [[40]]),  # the prefill samples the only token
             ([5] * 40, 3, [[40], [1], [1]]),  # two decode steps feed tokens 1 and 2; token 3 is never fed
             ([7] * 318, 50, [[128], [128], [62], [1]])]  # max_model_len 320 after 2 tokens
    for prompt, max_tokens, steps in cases:
        fed.clear()
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))
        assert out.finish_reason == "length" and len(out.token_ids) == min(max_tokens, 320 - len(prompt))
        assert fed == steps, f"max_tokens={max_tokens}: steps fed {fed}, want {steps}"
    assert_all_free(llm)


def test_stops_and_stream():
    # the bundled model (it has a tokenizer) on test_bundled_model.py's engine shapes: their programs are reused
    llm = LLM(jhybrid.default_model_path(), dtype="float32", max_num_seqs=1, max_model_len=64)
    base = llm.generate(["And God said"], SamplingParams(max_tokens=24, **GREEDY))[0]
    assert base.text and base.finish_reason == "length"
    # stop token id: the output ends at the first occurrence of the third generated token
    stop_id = base.token_ids[2]
    out = llm.generate(["And God said"], SamplingParams(max_tokens=24, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    # stop string: the text is cut before it
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    out = llm.generate(["And God said"], SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.find(stop)]
    # streaming yields the same text, in pieces
    deltas = list(llm.stream("And God said", SamplingParams(max_tokens=24, **GREEDY)))
    assert "".join(deltas) == base.text and len(deltas) > 1
    deltas = list(llm.stream("And God said", SamplingParams(max_tokens=24, stop=[stop], **GREEDY)))
    assert "".join(deltas) == base.text[: base.text.find(stop)]
    assert_all_free(llm)


def test_abort_frees_everything(tiny):
    _, model = tiny
    llm = LLM(model, **ENGINE)
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=30, **GREEDY)) for i, p in enumerate(prompts_1_to_300(6))]
    for _ in range(4):
        eng.step()
    assert seqs[0].slot and seqs[5].status.value == "waiting"
    eng.abort("r0")  # running
    eng.abort("r5")  # still waiting (4 run at most)
    while eng.has_unfinished():
        eng.step()
    assert seqs[0].finish_reason == "abort" and seqs[5].finish_reason == "abort"
    assert all(s.finish_reason == "length" for s in seqs[1:5])
    assert_all_free(llm)


@pytest.mark.slow
def test_generate_wrapper_uses_the_engine(tiny, alone):
    _, model = tiny
    prompts = prompts_1_to_300()[::5]
    outs = jhybrid.generate(model, prompts, max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in outs] == alone[::5]
