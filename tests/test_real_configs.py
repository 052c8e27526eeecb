"""Published configs of real checkpoints (tests/real_configs/), read as published, against HF transformers.

- Every published config reads, into the model its publisher describes (layer list, experts, residual scales,
  RoPE width); fields ignored on purpose (vision tower, M-RoPE sections, MTP heads) are logged once.
- Shrunk copies (tests/published_models.py: published fields kept, sizes reduced, every weight random, fp32)
  give HF's prefill logits (relative error <= 1e-5) and HF `generate`'s greedy tokens: Qwen3.5-35B-A3B in the
  fast tier, the other Qwen3.5-MoE sizes and MiniMax-M1 (published form) marked `slow`.
- Renamed configs are refused with the unread fields named: a Qwen3.5-MoE config as `qwen3_5` /
  `qwen3_5_text` (which would drop every expert), a published MiniMax config as `minimax` (which would
  alternate layer kinds, scale residuals by 1 and rotate whole heads).

Each test was seen to fail with its behaviour removed (noted per test).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from jhybrid.checkpoint import load_model
from jhybrid.config import ModelConfig, ignored_fields
from tests.published_models import (
    MINIMAX, QWEN3_5_MOE, REAL_CONFIGS, VOCAB, make_published, minimax_hf_config, minimax_partial_rope, published,
)
from tests.runner_helpers import SequenceRunner

ALL = sorted(p.name for p in REAL_CONFIGS.iterdir() if (p / "config.json").is_file())
METADATA = ("dtype", "bos_token_id", "eos_token_ids", "pad_token_id")  # not the model: set per checkpoint


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


# ------------------------------------------------------------------------------------------ reading
@pytest.mark.parametrize("name", ALL)
def test_every_published_config_reads(name):
    """Each published config.json builds a ModelConfig (config only, no weights)."""
    cfg = ModelConfig.from_hf(published(name))
    assert cfg.num_layers == len(cfg.layer_kinds) > 0


@pytest.mark.parametrize("name", QWEN3_5_MOE)
def test_qwen3_5_moe_reads_its_experts(name):
    """Qwen3.5-MoE is the text model: Gated DeltaNet layers as published, every MLP a mixture of experts
    (softmax top-k, renormalised, plus a sigmoid-gated shared expert), a quarter of each head rotated.
    Fails (was seen to) when qwen3_5_moe is read as the dense qwen3_5_text."""
    text = published(name)["text_config"]
    cfg = ModelConfig.from_hf(published(name))
    assert cfg.model_type == "qwen3_5_moe" and cfg.norm_zero_centred and cfg.attn_output_gate and cfg.qk_norm
    assert list(cfg.layer_kinds) == text["layer_types"]
    assert cfg.mlp_kinds == ("moe",) * text["num_hidden_layers"]
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (text["num_experts"], text["num_experts_per_tok"])
    assert cfg.moe_intermediate_size == text["moe_intermediate_size"]
    assert cfg.shared_expert_intermediate_size == text["shared_expert_intermediate_size"] and cfg.shared_expert_gate
    assert cfg.norm_topk_prob and cfg.moe_router == "softmax"
    assert cfg.rotary_dim == text["head_dim"] // 4 and cfg.rope_theta == 1e7


def test_minimax_m1_reads_as_published():
    """MiniMax-M1: the published layer list (7 lightning, then softmax attention), residual scales 3.5566 / 1,
    the residual taken after the norm (postnorm), RoPE over 64 of 128 dims at theta 1e7.
    Fails (was seen to) when attn_type_list is read as HF's alternating default."""
    pub = published("MiniMax-M1")
    cfg = ModelConfig.from_hf(pub)
    want = tuple("full_attention" if t else "lightning_attention" for t in pub["attn_type_list"])
    assert cfg.model_type == "minimax" and cfg.layer_kinds == want and want[7] == "full_attention"
    assert cfg.full_attn_alpha == cfg.linear_attn_alpha == cfg.mlp_alpha == pytest.approx(3.5565588200778455)
    assert cfg.full_attn_beta == cfg.linear_attn_beta == cfg.mlp_beta == 1.0
    assert cfg.residual_from_norm and (cfg.rotary_dim, cfg.head_dim, cfg.rope_theta) == (64, 128, 1e7)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 2, 9216)


def test_minimax_published_and_hf_forms_read_alike():
    """Both forms of one MiniMax model give the same ModelConfig, with every residual scale distinct so a
    swapped pair shows. Fails (was seen to) with HF's form read with full-head RoPE, or the published full
    and linear attention scales swapped."""
    pub = published("MiniMax-M1")
    for i, k in enumerate(k for k in sorted(pub) if k.startswith("layernorm_")):
        pub[k] = 1.0 + 0.25 * i
    assert ModelConfig.from_hf(pub) == ModelConfig.from_hf({"model_type": "minimax", **minimax_hf_config(pub)})


def test_ignored_fields_are_logged_once(caplog):
    """The vision tower, M-RoPE sections and MTP head of Qwen3.5-MoE are logged (once, however often the
    config is read) and listed by `ignored_fields`. Fails (was seen to) without the logging."""
    pub = published("Qwen3.5-35B-A3B")
    pub["text_config"]["vocab_size"] += 1  # a config no other test has read (the log is once per config)
    with caplog.at_level(logging.INFO, logger="jhybrid.config"):
        for _ in range(3):
            ModelConfig.from_hf(pub)
    lines = [r.getMessage() for r in caplog.records if r.name == "jhybrid.config"]
    assert len(lines) == 3, lines  # wrapper, text model, rope parameters: one line each
    text = "\n".join(lines)
    for field in ("vision_config", "mtp_num_hidden_layers", "rope_parameters.mrope_section"):
        assert field in text
    assert {"vision_config", "image_token_id", "mtp_num_hidden_layers", "rope_parameters.mrope_interleaved"} <= set(
        ignored_fields(pub))


# ------------------------------------------------------------------------------------------ traps
def _raises(hf, *names):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(hf)
    for name in names:
        assert name in str(e.value), f"{name!r} not named in: {e.value}"
    return str(e.value)


def test_renamed_qwen3_5_moe_is_refused():
    """A Qwen3.5-MoE config renamed to the dense Qwen3.5 is refused, naming the expert fields, instead of
    building a dense model without its experts. Fails (was seen to) with the field check removed."""
    pub = published("Qwen3.5-35B-A3B")
    moe_fields = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size")
    text = {**pub["text_config"], "model_type": "qwen3_5_text"}
    assert "qwen3_5_moe" in _raises(text, *moe_fields)  # the text config alone
    _raises({**pub, "model_type": "qwen3_5", "text_config": text}, *moe_fields)  # wrapper and text renamed
    _raises({**pub, "model_type": "qwen3_5"}, "qwen3_5_moe_text")  # only the wrapper renamed
    dense = published("Qwen3.5-27B")
    _raises({**dense, "text_config": {**dense["text_config"], "num_experts": 8}}, "num_experts")


def test_renamed_published_minimax_is_refused():
    """A published MiniMax config renamed `minimax` (HF's form) is refused, naming the published fields HF's
    form would not read. Fails (was seen to) with the field check removed."""
    pub = published("MiniMax-M1")
    msg = _raises({**pub, "model_type": "minimax"}, "attn_type_list", "layernorm_mlp_alpha", "rotary_dim", "postnorm")
    assert "minimax_m1" in msg
    hf_form = {"model_type": "minimax", **minimax_hf_config(pub)}
    _raises({**hf_form, "model_type": "minimax_m1"}, "layer_types", "mlp_alpha_factor")  # and the other way round
    _raises({**hf_form, "rotary_dim": 64}, "rotary_dim")


def test_unsupported_fields_and_values_are_named():
    """Fields that would change the model and are not supported raise, naming them."""
    q = published("Qwen3.5-35B-A3B")
    _raises({**q, "quantization_config": {"quant_method": "fp8"}}, "quantization_config")
    _raises({**q, "text_config": {**q["text_config"], "mlp_only_layers": [3]}}, "mlp_only_layers")
    _raises({**q, "text_config": {**q["text_config"], "attn_output_gate": False}}, "attn_output_gate")
    _raises({**q, "text_config": {**q["text_config"], "sliding_window": 4096}}, "sliding_window")
    rope = {**q["text_config"]["rope_parameters"], "beta_fast": 32}
    _raises({**q, "text_config": {**q["text_config"], "rope_parameters": rope}}, "beta_fast")
    m = published("MiniMax-M1")
    _raises({**m, "shared_intermediate_size": 128}, "shared_intermediate_size")
    _raises({**m, "attn_type_list": [2] * 80}, "attn_type_list")
    _raises({**m, "quantization_config": {"quant_method": "fp8"}}, "quantization_config")
    n = published("Nemotron-3-Nano-30B-A3B-BF16")
    _raises({**n, "quantization_config": {"quant_method": "fp8"}}, "quantization_config")
    _raises({**n, "n_shared_experts": 2}, "n_shared_experts")
    _raises({**published("Nemotron-H-56B-Base-8K"), "attention_head_dim": 64}, "attention_head_dim")
    assert "num_nextn_predict_layers" in ignored_fields({**n, "num_nextn_predict_layers": 1})


# ------------------------------------------------------------------------------------------ parity
def hf_logits(hf_model, ids):
    with minimax_partial_rope(), torch.no_grad():
        out = hf_model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(hf_model, ids, n):
    """HF `generate`'s n greedy tokens (all-ones mask, an EOS outside the vocabulary: plain argmax)."""
    with minimax_partial_rope(), torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
            do_sample=False, pad_token_id=0, eos_token_id=VOCAB,
        )
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=[
    n if n == "Qwen3.5-35B-A3B" else pytest.param(n, marks=pytest.mark.slow) for n in QWEN3_5_MOE + MINIMAX])
def shrunk(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model, cfg_json, hf_form = make_published(path, request.param, seed=len(request.param))
    cfg, params = load_model(path, dtype="float32")  # the published dtype is bfloat16; compare in fp32
    return request.param, path, hf_model, cfg_json, hf_form, cfg, params


def test_shrunk_published_config_equals_hf(shrunk):
    """Prefill logits (relative error <= 1e-5) and 12 greedy tokens equal HF's, on the shrunk copy read in
    its published form; HF's re-serialised form of the same model reads into the same ModelConfig.
    The logits fail (were seen to) with Qwen3.5-MoE's top-k weights not renormalised, MiniMax's alpha scales
    read as 1 or its RoPE over the whole head; the checkpoint stops loading (its tensors named) with the
    shared-expert gate dropped or MiniMax's layer list alternating."""
    name, path, hf_model, cfg_json, hf_form, cfg, params = shrunk
    assert json.loads((path / "config.json").read_text()) == cfg_json  # jhybrid read the published form
    strip = {k: None for k in METADATA}
    assert dataclasses.replace(ModelConfig.from_hf(hf_form), **strip) == dataclasses.replace(cfg, **strip)
    runner = SequenceRunner(cfg, params, max_len=64)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=45).tolist()
    table, slot = runner.start()
    logits = runner.step(ids, 0, table, slot, all_logits=True)
    err = rel_err(logits, hf_logits(hf_model, ids))
    print(f"{name}: prefill logits relative error vs HF {err:.2e}")
    assert err <= 1e-5, f"{name}: prefill logits relative error {err:.2e} > 1e-5"
    tokens = [int(np.argmax(logits[-1]))]  # greedy: then one decode step per token
    for pos in range(len(ids), len(ids) + 11):
        tokens.append(int(np.argmax(runner.step([tokens[-1]], pos, table, slot))))
    assert tokens == hf_greedy(hf_model, ids, 12), f"{name}: greedy tokens differ from HF generate"
