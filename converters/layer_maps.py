"""Name maps every family shares: embeddings, final norm and LM head; softmax attention; the dense gated MLP.

`name_maps.py` (Qwen3-Next, Qwen3.5, Qwen3, Llama) and `family_maps.py` (MiniMax, NemotronH, Bamba,
Granite-4.0-H) build their plans from these; the transforms are described in name_maps.py.
"""

from __future__ import annotations

from converters.plan import Plan, Rule, identity, linear
from jhybrid.config import ModelConfig


def embed_and_head(cfg: ModelConfig, embed: str = "model.embed_tokens.weight", norm: str = "model.norm.weight") -> Plan:
    d, v = cfg.hidden_size, cfg.vocab_size
    plan: Plan = {"embed": identity((v, d), embed), "final_norm": identity((d,), norm)}
    if not cfg.tie_word_embeddings:
        plan["lm_head"] = linear((d, v), "lm_head.weight")
    return plan


def attention(cfg: ModelConfig, p: str) -> dict[str, Rule]:
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_out = h * hd * (2 if cfg.attn_output_gate else 1)  # gated: per head, hd query dims then hd gate dims
    rules = {
        "q_proj": linear((d, q_out), p + "q_proj.weight"),
        "k_proj": linear((d, kvh * hd), p + "k_proj.weight"),
        "v_proj": linear((d, kvh * hd), p + "v_proj.weight"),
        "o_proj": linear((h * hd, d), p + "o_proj.weight"),
    }
    if cfg.qk_norm:
        rules |= {"q_norm": identity((hd,), p + "q_norm.weight"), "k_norm": identity((hd,), p + "k_norm.weight")}
    if cfg.attention_bias:
        for name, n in (("q", q_out), ("k", kvh * hd), ("v", kvh * hd), ("o", d)):
            rules[f"{name}_bias"] = identity((n,), f"{p}{name}_proj.bias")
    return rules


def dense_mlp(d: int, i: int, p: str, bias: bool = False) -> dict[str, Rule]:
    rules = {
        "gate_proj": linear((d, i), p + "gate_proj.weight"),
        "up_proj": linear((d, i), p + "up_proj.weight"),
        "down_proj": linear((i, d), p + "down_proj.weight"),
    }
    if bias:
        rules |= {
            "gate_bias": identity((i,), p + "gate_proj.bias"),
            "up_bias": identity((i,), p + "up_proj.bias"),
            "down_bias": identity((d,), p + "down_proj.bias"),
        }
    return rules
