"""Shrunk copies of published configs and the HF transformers models built from them: the references of
tests/test_real_configs.py.

`tests/real_configs/NAME/config.json` are the published files, verbatim. A shrunk copy keeps every published
field and value (layer kinds, residual scales, RoPE fractions, router sizes relative to each other) and
reduces only sizes: width, heads, experts, vocabulary, number of layers (a prefix of the published layer
list). `make_published(path, NAME)` builds HF's model from the shrunk copy with every weight random
(`tests.hf_models.randomize_`), saves it with `save_pretrained` and writes the shrunk copy as the checkpoint's
`config.json` (and as `config.shrunk_published.json` beside it), so jhybrid reads the published form.

- Qwen3.5-MoE (`qwen3_5_moe`): HF's `Qwen3_5MoeConfig` reads the published wrapper as it is; the model is
  `Qwen3_5MoeForConditionalGeneration` (text weights under `model.language_model.`, a one-block vision tower
  under `model.visual.`, experts saved one per expert).
- MiniMax-M1 (`minimax_m1`): HF has no reader for the published names, so `minimax_hf_config` renames them
  to HF's converted form (attn_type_list -> layer_types, 0 = lightning, 1 = softmax; layernorm_X_alpha/_beta
  -> X_alpha_factor/_beta_factor; rotary_dim -> partial_rotary_factor). HF's MiniMax rotates the whole
  head whatever partial_rotary_factor says; the published model rotates `rotary_dim` dims, so the HF model
  gets HF's own partial RoPE of MiniMax-M2 (same checkpoints' convention: the first rotary_dim dims,
  rotate-half within them, frequencies over rotary_dim): `MiniMaxM2RotaryEmbedding`, and inside
  `minimax_partial_rope()` MiniMax-M2's `apply_rotary_pos_emb`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from tests.hf_models import randomize_

REAL_CONFIGS = Path(__file__).parent / "real_configs"
QWEN3_5_MOE = ("Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B")
MINIMAX = ("MiniMax-M1",)
VOCAB = 512


def published(name: str) -> dict[str, Any]:
    with open(REAL_CONFIGS / name / "config.json") as f:
        return json.load(f)


def _sections(sections: list[int], pairs: int) -> list[int]:
    """M-RoPE sections rescaled to `pairs` rotary pairs (they must add up to rotary_dim / 2)."""
    total = sum(sections)
    out = [s * pairs // total for s in sections]
    out[0] += pairs - sum(out)
    return out


def shrink_qwen3_5_moe(pub: dict[str, Any], num_layers: int = 4) -> dict[str, Any]:
    """Hidden 64, heads of 32 (a quarter of the query heads, the published KV heads), linear heads 2 key /
    2r value (r as published) of dim 16, experts / 32 with top-2, experts and shared expert of 32, vocab 512,
    the first `num_layers` published layers, a one-block vision tower."""
    cfg = copy.deepcopy(pub)
    t = cfg["text_config"]
    r = t["linear_num_value_heads"] // t["linear_num_key_heads"]
    t.update(
        hidden_size=64, head_dim=32, num_attention_heads=t["num_attention_heads"] // 4,
        linear_num_key_heads=2, linear_num_value_heads=2 * r, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=t["num_experts"] // 32, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32 * t["shared_expert_intermediate_size"] // t["moe_intermediate_size"],
        vocab_size=VOCAB, num_hidden_layers=num_layers, layer_types=t["layer_types"][:num_layers],
    )
    rope = t.get("rope_parameters") or {}
    if "mrope_section" in rope:
        rope["mrope_section"] = _sections(rope["mrope_section"], int(32 * rope.get("partial_rotary_factor", 0.25)) // 2)
    cfg["vision_config"].update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                num_position_embeddings=64)
    return cfg


def shrink_minimax(pub: dict[str, Any], num_layers: int = 8) -> dict[str, Any]:
    """Hidden 64, 4 query / 2 KV heads of 32 (rotary_dim in the published fraction of head_dim), 4 experts of
    32 (top-k as published), vocab 512, the first `num_layers` entries of the published attn_type_list (7
    lightning, then softmax attention). Residual scales, postnorm and rope_theta as published."""
    cfg = copy.deepcopy(pub)
    cfg.update(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rotary_dim=pub["rotary_dim"] * 32 // pub["head_dim"], intermediate_size=32, num_local_experts=4,
        vocab_size=VOCAB, num_hidden_layers=num_layers, attn_type_list=pub["attn_type_list"][:num_layers],
    )
    return cfg


def minimax_hf_config(pub: dict[str, Any]) -> dict[str, Any]:
    """The published MiniMax config in HF's converted names (HF `MiniMaxConfig` kwargs)."""
    if not pub.get("postnorm", False) or pub.get("shared_intermediate_size", 0):
        raise ValueError("HF's MiniMax is postnorm without a shared expert")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "num_local_experts", "num_experts_per_tok", "bos_token_id", "eos_token_id")
    names = (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp"))
    scales = {f"{k}_{ab}_factor": pub[f"layernorm_{pk}_{ab}"] for k, pk in names for ab in ("alpha", "beta")}
    return {
        **{k: pub[k] for k in keep},
        **scales,
        "layer_types": ["full_attention" if t else "linear_attention" for t in pub["attn_type_list"]],
        "rope_parameters": {"rope_type": "default", "rope_theta": float(pub["rope_theta"]),
                            "partial_rotary_factor": pub["rotary_dim"] / pub["head_dim"]},
        "block_size": 16,  # HF's lightning block: prompts span several blocks
    }


@contextlib.contextmanager
def minimax_partial_rope():
    """HF MiniMax attention applies RoPE with MiniMax-M2's partial `apply_rotary_pos_emb` (the first
    `cos.shape[-1]` dims rotate; with full-width cos it is the same function as MiniMax's own)."""
    from transformers.models.minimax import modeling_minimax
    from transformers.models.minimax_m2.modeling_minimax_m2 import apply_rotary_pos_emb

    saved = modeling_minimax.apply_rotary_pos_emb
    modeling_minimax.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        yield
    finally:
        modeling_minimax.apply_rotary_pos_emb = saved


def _write_json(path: Any, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def make_published(path: Any, name: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]:
    """Builds, randomises (fp32) and saves HF's model of the shrunk copy of published config `name`.

    Returns:
      (HF model in eval mode, the shrunk published config (now the checkpoint's config.json), the config
      HF's `save_pretrained` wrote (HF's form of the same model)).
    """
    import transformers

    pub = published(name)
    if pub["model_type"] == "qwen3_5_moe":
        shrunk = shrink_qwen3_5_moe(pub)
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**copy.deepcopy(shrunk)))
        zero_centred = True
    elif pub["model_type"] == "minimax_m1":
        shrunk = shrink_minimax(pub)
        model = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(**minimax_hf_config(shrunk)))
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

        model.model.rotary_emb = MiniMaxM2RotaryEmbedding(model.config)  # reads partial_rotary_factor
        zero_centred = False
    else:
        raise ValueError(f"no HF builder for {name} ({pub['model_type']})")
    model = model.float()  # the published dtype (bfloat16) would make HF build some modules in bf16
    randomize_(model, seed, zero_centred_norms=zero_centred)
    model.eval()
    model.save_pretrained(os.fspath(path))
    with open(os.path.join(path, "config.json")) as f:
        hf_form = json.load(f)
    _write_json(os.path.join(path, "config.json"), shrunk)
    _write_json(os.path.join(path, "config.shrunk_published.json"), shrunk)
    return model, shrunk, hf_form
