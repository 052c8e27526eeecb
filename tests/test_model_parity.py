"""Numerical parity with HF transformers' PyTorch models (fp32, every weight random, tiny shapes).

Each family is saved with `save_pretrained`, loaded through jhybrid's converter, and compared:
prefill logits (relative error <= 1e-5), 32 greedy tokens against HF `generate`, and chunked prefill
against one-shot prefill (and against HF given explicit `position_ids`).

Both sides compute in fp32 and round differently (summation order, the chunked vs HF's chunked gated
delta rule), and a random model amplifies rounding: over six random dense Qwen3-Next seeds the relative
logit error against HF fp32 ranged 2e-6..1e-5. The kernels themselves are checked against float64 ground
truth in test_kernel_references.py; a real bug shows up here as errors of 1e-3 and more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jhybrid
from jhybrid.checkpoint import load_model
from jhybrid.model_loader import LoadedModel
from tests.conftest import FAMILY_ENGINE
from tests.hf_models import make_llama, make_qwen3, make_qwen3_5, make_qwen3_next
from tests.runner_helpers import SequenceRunner

FAMILIES = {
    "qwen3_next_moe": lambda p: make_qwen3_next(p, moe=True, seed=1),
    "qwen3_next_dense": lambda p: make_qwen3_next(p, moe=False, seed=5),
    "qwen3_5": lambda p: make_qwen3_5(p, seed=3),
    "qwen3": lambda p: make_qwen3(p, seed=4),
    "llama": lambda p: make_llama(p, seed=5),
}
HYBRID = ["qwen3_next_moe", "qwen3_next_dense", "qwen3_5"]


# fast tier: Qwen3-Next with MoE (Gated DeltaNet, gated attention, MoE); the others are `slow`
@pytest.fixture(scope="module", params=[name if name == "qwen3_next_moe" else pytest.param(name, marks=pytest.mark.slow)
                                        for name in FAMILIES])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = FAMILIES[request.param](path)
    cfg, params = load_model(path)
    return request.param, hf_model, LoadedModel(cfg=cfg, params=params)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def hf_logits(hf_model, ids, positions=None):
    positions = np.arange(len(ids)) if positions is None else positions
    with torch.no_grad():
        out = hf_model(torch.tensor([list(ids)]), position_ids=torch.tensor(np.asarray(positions)[None]), use_cache=False)
    return out.logits[0].float().numpy()


def prompt(seed, n, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def test_prefill_logits_match_hf(family):
    name, hf_model, model = family
    ids = prompt(0, 77)
    runner = SequenceRunner(model.cfg, model.params, max_len=128)
    table, slot = runner.start()
    got = runner.step(ids, 0, table, slot, all_logits=True)
    want = hf_logits(hf_model, ids)
    err = rel_err(got, want)
    print(f"{name}: prefill logits relative error vs HF {err:.2e}")
    assert err <= 1e-5, f"{name}: prefill logits relative error {err:.2e}"


def test_greedy_32_tokens_equal_hf_generate(family):
    """Two prompts batched on one engine (one set of programs per family), each equal to HF `generate`."""
    name, hf_model, model = family
    prompts = [prompt(1, 5), prompt(2, 40)]
    llm = jhybrid.LLM(model, **FAMILY_ENGINE)
    outs = llm.generate(prompts, jhybrid.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            hf_out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32, pad_token_id=0
            )
        want = hf_out[0, len(ids):].tolist()
        assert out.token_ids == want, f"{name}: greedy tokens differ from HF generate for the {len(ids)}-token prompt"
        assert out.finish_reason == "length"


def test_chunked_prefill_equals_one_shot_and_hf(family):
    """77 tokens (the prefill test's shapes: its programs are reused) in chunks: three, and for the hybrids a
    1-token first and last chunk (conv history shorter than the kernel)."""
    name, hf_model, model = family
    patterns = [(26, 25, 26), (1, 75, 1)] if name in HYBRID else [(26, 25, 26)]
    runner = SequenceRunner(model.cfg, model.params, max_len=128)
    for chunks in patterns:
        check_chunking(name, hf_model, runner, chunks)


def check_chunking(name, hf_model, runner, chunks):
    ids = prompt(3, sum(chunks))

    def run(pieces):
        table, slot = runner.start()
        logits, start = [], 0
        for n in pieces:
            logits.append(np.asarray(runner.step(ids[start : start + n], start, table, slot, all_logits=True)))
            start += n
        tokens = []
        last = logits[-1][-1]
        for _ in range(8):
            tokens.append(int(np.argmax(last)))
            last = np.asarray(runner.step([tokens[-1]], start, table, slot))
            start += 1
        runner.finish(table, slot)
        return np.concatenate(logits), tokens

    one_logits, one_tokens = run([len(ids)])
    chunk_logits, chunk_tokens = run(list(chunks))
    err = rel_err(chunk_logits, one_logits)
    assert err <= 1e-5, f"{name} {chunks}: chunked prefill logits differ from one-shot, relative error {err:.2e}"
    assert chunk_tokens == one_tokens, f"{name} {chunks}: decode after chunked prefill differs from one-shot"
    # each chunk against HF run on the prefix that ends with it, positions given explicitly
    start = 0
    for n in chunks:
        end = start + n
        want = hf_logits(hf_model, ids[:end], positions=np.arange(end))[start:end]
        err = rel_err(chunk_logits[start:end], want)
        assert err <= 1e-5, f"{name} {chunks}: chunk at {start} differs from HF, relative error {err:.2e}"
        start = end


def test_generate_rejects_bad_input(family):
    _, _, model = family
    with pytest.raises(ValueError, match="max_tokens"):
        jhybrid.generate(model, [[1, 2]], max_tokens=0)
    with pytest.raises(ValueError, match="token ids must lie"):
        jhybrid.generate(model, [[1, 999]], max_tokens=2)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        jhybrid.generate(model, [[1] * 250], max_tokens=10)
    with pytest.raises(ValueError, match="no tokenizer"):
        jhybrid.generate(model, ["hello"], max_tokens=2)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 512}])
def test_rope_frequencies_match_transformers(scaling):
    """`rope_inv_freq` (numpy fp32 on the host, a constant of the programs) against transformers' own RoPE
    initialisation for the default, linear and llama3 scalings. Checked to fail with the
    llama3 branch's low- and high-frequency bounds swapped."""
    import types

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jhybrid.models.layers import rope_inv_freq

    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_theta=500000.0,
                     max_position_embeddings=4096, rope_scaling=scaling)
    if scaling is None:
        want = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    scaling = scaling or {}
    cfg = types.SimpleNamespace(rotary_dim=128, rope_theta=500000.0, rope_type=scaling.get("rope_type", "default"),
                                rope_factor=scaling.get("factor", 1.0),
                                rope_original_max_position=scaling.get("original_max_position_embeddings", 0),
                                rope_low_freq_factor=scaling.get("low_freq_factor", 1.0),
                                rope_high_freq_factor=scaling.get("high_freq_factor", 4.0))
    got = rope_inv_freq(cfg)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
