"""EleutherAI's lm-evaluation-harness (`lm_eval`, its `local-completions` model) against `jhybrid serve`, as a
user evaluates a model (issue 19): three small local tasks, one per kind of request the harness sends —
multiple choice (loglikelihood), rolling loglikelihood (perplexity) and generate_until — on the bundled model in
float32. Every loglikelihood the harness computed from the server's answers is checked against the offline
engine's prompt log-probabilities and against HF transformers' log-softmax on the same token ids (1e-4), and
every generation against the offline engine's greedy text with the same stop.

The tasks are YAML files over local JSON lines written here (no hub access); the harness's own tokenizer
handling (`TemplateLM._encode_pair`, rolling windows with its prefix token) gives the token ids, so the
references score exactly what the server was sent.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import jhybrid
from jhybrid import LLM, SamplingParams
from jhybrid.server import BackgroundServer, ServerConfig, build_engine, create_app

pytestmark = pytest.mark.slow  # a server, the harness and HF: ~50 s

MODEL = jhybrid.default_model_path()
NAME = "kjv"
SHAPES = dict(dtype="float32", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32)  # test_engine_process.py's
MAX_LENGTH = 96  # the harness's context limit (tokens)

MC = [
    {"question": "And God said, Let there be", "choices": ["light", "darkness", "a king", "water"], "label": 0},
    {"question": "In the beginning God created the heaven and the", "choices": ["earth", "sea", "man"], "label": 0},
    {"question": "The LORD is my", "choices": ["shepherd", "enemy", "brother"], "label": 0},
    {"question": "Blessed are the", "choices": ["meek", "proud", "rich", "strong"], "label": 0},
]
ROLLING = [
    {"text": "And the earth was without form, and void; and darkness was upon the face of the deep."},
    {"text": "Honour thy father and thy mother: that thy days may be long upon the land."},
]
GEN = [
    {"question": "And God said, Let there be light: and", "answer": " there was light."},
    {"question": "The LORD is my shepherd; I shall not", "answer": " want."},
]


def _task(folder, name, kind, data, fields: str) -> None:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / (name + '.jsonl')}\n"
        f"test_split: test\noutput_type: {kind}\n{fields}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    _task(folder, "jh_mc", "multiple_choice", MC,
          'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
          "metric_list:\n  - metric: acc\n")
    _task(folder, "jh_rolling", "loglikelihood_rolling", ROLLING,
          'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n')
    _task(folder, "jh_gen", "generate_until", GEN,
          'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
          'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0.0\n'
          "metric_list:\n  - metric: exact_match\n")
    return folder


@pytest.fixture(scope="module")
def url():
    engine = build_engine(MODEL, served_model_name=NAME, warmup=True, **SHAPES)
    server = BackgroundServer(create_app(engine, ServerConfig(model_names=(NAME,)))).start()
    yield server.url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def evaluated(url, tasks):
    """The harness's results (with samples) and its LM object (its tokenizer handling)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(model=NAME, base_url=f"{url}/v1/completions", tokenizer_backend="huggingface",
                                        tokenizer=MODEL, max_length=MAX_LENGTH, num_concurrent=2, max_retries=1)
    results = simple_evaluate(model=lm, tasks=["jh_mc", "jh_rolling", "jh_gen"],
                              task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                              log_samples=True, batch_size=1)
    return results, lm


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, **SHAPES)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def _references(offline, hf_model, ids: list[int], first: int) -> tuple[float, float]:
    """The log-probability of `ids[first:]` given `ids[:first]`: by the offline engine's prompt logprobs and by HF's
    log-softmax."""
    (out,) = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                          temperature=0.0), use_tqdm=False)
    ours = sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(first, len(ids)))
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    theirs = float(sum(logp[i - 1, ids[i]] for i in range(first, len(ids))))
    return ours, theirs


def test_multiple_choice_loglikelihoods_equal_offline_and_hf(evaluated, offline, hf_model):
    """Each choice's loglikelihood as the harness computed it from the server's echoed logprobs equals the offline
    engine's and HF's on the same token ids (1e-4), and its `acc` is the argmax over those. Checked to fail with the
    server's echoed prompt logprobs each taken from the next position (the token ids kept), and with the echo's
    first entry dropped (so do the rolling ones)."""
    results, lm = evaluated
    samples = results["samples"]["jh_mc"]
    assert len(samples) == len(MC)
    for s in samples:
        lls = []
        for (context, continuation), (ll, _greedy) in zip(s["arguments"], s["filtered_resps"], strict=True):
            ctx, cont = lm._encode_pair(context, continuation)
            ours, theirs = _references(offline, hf_model, ctx + cont, len(ctx))
            assert abs(ll - ours) < 1e-4 and abs(ll - theirs) < 1e-4, (context, continuation, ll, ours, theirs)
            lls.append(ll)
        assert s["acc"] == float(int(np.argmax(lls)) == s["target"])
    assert results["results"]["jh_mc"]["acc,none"] == pytest.approx(np.mean([s["acc"] for s in samples]))


def test_rolling_loglikelihoods_equal_offline_and_hf(evaluated, offline, hf_model):
    """loglikelihood_rolling (perplexity): one window per text (shorter than MAX_LENGTH), its tokens scored after
    the harness's prefix token; the harness's total equals the offline engine's and HF's (1e-4), and its word
    perplexity is exp(-total / words). Checked to fail with the two
    server mutations of the multiple-choice test."""
    results, lm = evaluated
    samples = results["samples"]["jh_rolling"]
    assert len(samples) == len(ROLLING)
    totals, words = [], []
    for s, doc in zip(samples, ROLLING, strict=True):
        ll = s["filtered_resps"][0]
        ll = ll[0] if isinstance(ll, (list, tuple)) else ll
        ids = lm.tok_encode(doc["text"])
        assert len(ids) + 1 <= MAX_LENGTH
        ours, theirs = _references(offline, hf_model, [lm.prefix_token_id, *ids], 1)
        assert abs(ll - ours) < 1e-4 and abs(ll - theirs) < 1e-4, (doc, ll, ours, theirs)
        totals.append(ll)
        words.append(len(doc["text"].split()))
    perplexity = results["results"]["jh_rolling"]["word_perplexity,none"]
    assert perplexity == pytest.approx(math.exp(-sum(totals) / sum(words)), rel=1e-6)


def test_generations_equal_the_offline_engine(evaluated, offline):
    """generate_until: the harness's generation for each prompt is the offline engine's greedy text for the same
    token ids, cut at the first stop string (the harness's `until`); exact_match follows from it. Checked to fail
    with the server dropping `stop` (an empty list)."""
    results, lm = evaluated
    samples = results["samples"]["jh_gen"]
    assert len(samples) == len(GEN)
    for s, doc in zip(samples, GEN, strict=True):
        (out,) = offline.generate([{"prompt_token_ids": lm.tok_encode(doc["question"])}],
                                  SamplingParams(max_tokens=8, temperature=0.0, stop=["\n", "."]), use_tqdm=False)
        got = s["filtered_resps"][0]
        got = got[0] if isinstance(got, list) else got
        assert got == out.outputs[0].text, (doc, got, out.outputs[0].text)
        assert s["exact_match"] == float(got == doc["answer"])
