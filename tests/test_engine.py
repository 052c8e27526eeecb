"""The engine: continuous batching with preemption, slot reuse, sampling, stops, aborts, streaming."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import jhybrid
from jhybrid import LLM, SamplingParams
from jhybrid.checkpoint import load_model
from tests.example_ckpt import write_example_checkpoint
from jhybrid.model_loader import LoadedModel
from tests.hf_models import make_qwen3_5

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen3.5 hybrid (3 GDN : 1 full) with a 512-token context, and its HF model."""
    path = tmp_path_factory.mktemp("q35")
    hf_model = make_qwen3_5(path, seed=11, max_position_embeddings=512)
    cfg, params = load_model(path)
    return hf_model, LoadedModel(cfg=cfg, params=params)


@pytest.fixture(scope="module")
def texty(tmp_path_factory):
    """The example's tiny checkpoint, which has a tokenizer."""
    return write_example_checkpoint(tmp_path_factory.mktemp("texty") / "ckpt", seed=3)


def prompts_1_to_300(n=16, vocab=128):
    rng = np.random.default_rng(0)
    lengths = np.linspace(1, 300, n).astype(int)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths]


def assert_all_free(llm: LLM):
    eng = llm.engine
    assert eng.blocks.num_used == 0 and eng.blocks.num_free == eng.cache.num_blocks - 1, "KV blocks leaked"
    assert eng.slots.num_used == 0 and eng.slots.num_free == eng.cache.num_slots - 1, "state slots leaked"
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_batched_with_preemption_equals_alone_and_hf(tiny):
    hf_model, model = tiny
    prompts = prompts_1_to_300()
    params = SamplingParams(max_tokens=10, **GREEDY)
    # 4 running sequences of up to 310 tokens need up to 80 blocks of 16; 45 force preemption
    llm = LLM(model, dtype=None, max_num_seqs=4, max_model_len=320, num_kv_blocks=45, max_num_batched_tokens=128)
    batched = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert_all_free(llm)
    alone_llm = LLM(model, dtype=None, max_num_seqs=1, max_model_len=320, max_num_batched_tokens=512)
    for i, (p, out) in enumerate(zip(prompts, batched)):
        (alone,) = alone_llm.generate([p], params)
        assert out.token_ids == alone.token_ids, f"prompt {i} ({len(p)} tokens): batched != alone"
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert out.token_ids == want[0, len(p):].tolist(), f"prompt {i} ({len(p)} tokens): differs from HF"
        assert out.finish_reason == "length"
    assert_all_free(alone_llm)
    # bucketing keeps the number of compiled programs bounded: one decode bucket (4 rows), mixed steps of
    # 64 and 128 tokens
    assert len(llm.engine.runner.compiled_shapes) <= 3, llm.engine.runner.compiled_shapes


def test_seeded_sampling_does_not_depend_on_batching(tiny):
    _, model = tiny
    prompts = prompts_1_to_300(6)
    llm = LLM(model, dtype=None, max_num_seqs=4, max_model_len=320)
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
    llm = LLM(model, dtype=None, max_num_seqs=2, max_model_len=320)
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
    llm = LLM(model, dtype=None, max_num_seqs=2, max_model_len=64)
    outs = llm.generate([[1] * 80, [2, 3, 4], [5] * 64], SamplingParams(max_tokens=4, **GREEDY))
    assert outs[0].finish_reason == "error" and "max_model_len" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert outs[2].finish_reason == "error"
    assert_all_free(llm)


def test_generation_stops_at_max_model_len(tiny):
    _, model = tiny
    llm = LLM(model, dtype=None, max_num_seqs=2, max_model_len=64)
    (out,) = llm.generate([[7] * 60], SamplingParams(max_tokens=50, **GREEDY))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_stops_and_stream(texty):
    llm = LLM(texty, dtype="float32", max_num_seqs=4, max_model_len=128)
    base = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, **GREEDY))[0]
    assert base.text and base.finish_reason == "length"
    # stop token id: the output ends at the first occurrence of the third generated token
    stop_id = base.token_ids[2]
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    # stop string: the text is cut before it
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.find(stop)]
    # streaming yields the same text, in pieces
    deltas = list(llm.stream("Once upon a time", SamplingParams(max_tokens=24, **GREEDY)))
    assert "".join(deltas) == base.text and len(deltas) > 1
    deltas = list(llm.stream("Once upon a time", SamplingParams(max_tokens=24, stop=[stop], **GREEDY)))
    assert "".join(deltas) == base.text[: base.text.find(stop)]
    assert_all_free(llm)


def test_abort_frees_everything(tiny):
    _, model = tiny
    llm = LLM(model, dtype=None, max_num_seqs=3, max_model_len=320)
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=30, **GREEDY)) for i, p in enumerate(prompts_1_to_300(5))]
    for _ in range(4):
        eng.step()
    eng.abort("r0")
    eng.abort("r4")  # still waiting
    while eng.has_unfinished():
        eng.step()
    assert seqs[0].finish_reason == "abort" and seqs[4].finish_reason == "abort"
    assert all(s.finish_reason == "length" for s in seqs[1:4])
    assert_all_free(llm)


def test_generate_wrapper_uses_the_engine(tiny):
    _, model = tiny
    prompts = prompts_1_to_300(3)
    outs = jhybrid.generate(model, prompts, max_tokens=6, ignore_eos=True)
    llm = LLM(model, dtype=None, max_num_seqs=1, max_model_len=320)
    assert [o.token_ids for o in outs] == [llm.generate([p], SamplingParams(max_tokens=6, **GREEDY))[0].token_ids for p in prompts]
