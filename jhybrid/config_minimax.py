"""`ModelConfig.from_hf` for MiniMax-Text-01 / MiniMax-M1, in both forms a checkpoint comes in:

- published (`model_type: minimax_m1` / `minimax_text_01`, read with MiniMax's remote code): `attn_type_list`,
  `layernorm_*_alpha` / `_beta`, `postnorm`, `rotary_dim`, `rope_theta`;
- HF's converted form (`minimax`): `layer_types`, `*_alpha_factor` / `_beta_factor`, `rope_parameters`.

Both read into the same `ModelConfig` (model_type "minimax"). Each form's fields are checked
(jhybrid/config_fields.py): a published config renamed `minimax` is refused, naming its unread fields, instead
of read as HF's defaults (alternating layers, residual scales 1, RoPE over the whole head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from jhybrid.config_families import _common, _no_sliding_window
from jhybrid.config_fields import check_fields, check_rope_keys

if TYPE_CHECKING:
    from jhybrid.config import ModelConfig


# MiniMax fields both forms share; then each form's own names (jhybrid/config_fields.py refuses any other).
# `block_size` is the lightning kernel's block length: no effect on the result.
_MINIMAX_SHARED = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "sliding_window", "num_local_experts",
    "num_experts_per_tok", "rope_theta", "rope_scaling", "block_size",
)
_MINIMAX_SCALES = ("full_attn", "linear_attn", "mlp")  # jhybrid's and HF's prefixes
_PUBLISHED_SCALES = ("full_attention", "linear_attention", "mlp")  # published: layernorm_{...}_alpha / _beta
_MINIMAX_HF_ONLY = ("layer_types", "num_experts", "rope_parameters", "partial_rotary_factor") + tuple(
    f"{k}_{ab}_factor" for k in _MINIMAX_SCALES for ab in ("alpha", "beta"))
_MINIMAX_PUBLISHED_ONLY = (
    "attn_type_list", "rotary_dim", "postnorm", "shared_intermediate_size", "shared_moe_mode",
) + tuple(f"layernorm_{k}_{ab}" for k in _PUBLISHED_SCALES for ab in ("alpha", "beta"))
_MINIMAX_HINTS = {
    frozenset(_MINIMAX_PUBLISHED_ONLY): (
        "These are the names of MiniMax's published config (model_type 'minimax_m1' / 'minimax_text_01'): keep that "
        "model_type, or rename every one to HF's converted form (attn_type_list -> layer_types, "
        "layernorm_X_alpha/_beta -> X_alpha_factor/_beta_factor, rotary_dim -> partial_rotary_factor)."
    ),
    frozenset(_MINIMAX_HF_ONLY): "These are the names of HF's converted MiniMax form: its model_type is 'minimax'.",
}


def _minimax(cls: type[ModelConfig], hf: dict[str, Any], types: list[str], rotary_dim: int, rope_theta: float,
             residual_from_norm: bool, scales: dict[str, float]) -> ModelConfig:
    """The ModelConfig of either MiniMax form, from its layer list, RoPE width, residual form and scales."""
    common = _common(hf, "minimax")
    num_layers = int(hf["num_hidden_layers"])
    _no_sliding_window(hf, "minimax")
    if len(types) != num_layers:
        raise ValueError(f"minimax: the layer list has {len(types)} entries but num_hidden_layers={num_layers}")
    rename = {"full_attention": "full_attention", "linear_attention": "lightning_attention"}
    if unknown := set(types) - set(rename):
        raise ValueError(f"minimax: unknown layer_types {sorted(unknown)}; expected {sorted(rename)}")
    num_experts = int(hf.get("num_local_experts", hf.get("num_experts", 8)))
    inter = int(hf["intermediate_size"])
    return cls(
        **common,
        num_layers=num_layers,
        layer_kinds=tuple(rename[t] for t in types),
        mlp_kinds=("moe",) * num_layers,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        hidden_act=hf.get("hidden_act", "silu"),
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        intermediate_size=inter,
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=inter,  # every MiniMax expert has intermediate_size
        norm_topk_prob=True,  # MiniMax's router always renormalises the top-k weights
        residual_from_norm=residual_from_norm,
        **scales,
    )


def _minimax_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    rope = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    check_rope_keys(where, hf, rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{where}: unsupported {rope_type=}; only 'default' RoPE is implemented")
    return rope


def minimax(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """MiniMax-Text-01 / M1 in HF's converted form (`minimax`): lightning attention ("linear_attention" in
    `layer_types`) and softmax attention layers, every MLP a block-sparse MoE (softmax top-k, renormalised),
    residuals `alpha * norm(x) + beta * f(norm(x))` (`*_alpha_factor`, `*_beta_factor`).

    RoPE rotates the first `head_dim * partial_rotary_factor` dims of each head (the released checkpoints: 64
    of 128). HF's MiniMaxForCausalLM ignores `partial_rotary_factor` and rotates the whole head; jhybrid
    follows the config, as HF does for MiniMax-M2 (transformers#48241), so both forms read alike."""
    check_fields("minimax", hf, _MINIMAX_SHARED + _MINIMAX_HF_ONLY, hints=_MINIMAX_HINTS)
    rope = _minimax_rope(hf, "minimax")
    head_dim = _common(hf, "minimax")["head_dim"]
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    num_layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(num_layers)
    ]  # HF's default layout
    scales = {f"{k}_{ab}": float(hf.get(f"{k}_{ab}_factor", 1)) for k in _MINIMAX_SCALES for ab in ("alpha", "beta")}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 1e6)))
    return _minimax(cls, hf, list(types), int(head_dim * partial) // 2 * 2, theta, True, scales)


def minimax_published(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """MiniMax-M1 / MiniMax-Text-01 as published (`minimax_m1`, `minimax_text_01`, read with remote code):
    `attn_type_list` (0: lightning, 1: softmax attention), `layernorm_{full_attention,linear_attention,mlp}_
    {alpha,beta}` residual scales, `postnorm` (true: the residual is the normed input, as in HF's form),
    `rotary_dim` (RoPE over the first rotary_dim dims of each head). The same model as HF's `minimax` form."""
    model_type = hf["model_type"]
    check_fields(model_type, hf, _MINIMAX_SHARED + _MINIMAX_PUBLISHED_ONLY, hints=_MINIMAX_HINTS)
    _minimax_rope(hf, model_type)  # rope_scaling: default only
    if int(hf.get("shared_intermediate_size") or 0):
        raise ValueError(
            f"{model_type}: shared_intermediate_size={hf['shared_intermediate_size']} (a shared expert, "
            f"shared_moe_mode={hf.get('shared_moe_mode')!r}) is not supported"
        )
    if "attn_type_list" not in hf:
        raise ValueError(f"{model_type}: config has no attn_type_list (the per-layer attention kinds)")
    codes = {0: "linear_attention", 1: "full_attention"}
    if unknown := set(hf["attn_type_list"]) - set(codes):
        raise ValueError(f"{model_type}: attn_type_list holds {sorted(unknown)}; expected 0 (lightning) or 1 (softmax)")
    head_dim = _common(hf, model_type)["head_dim"]
    scales = {f"{k}_{ab}": float(hf.get(f"layernorm_{pk}_{ab}", 1))
              for k, pk in zip(_MINIMAX_SCALES, _PUBLISHED_SCALES) for ab in ("alpha", "beta")}
    types = [codes[t] for t in hf["attn_type_list"]]
    rotary_dim, theta = int(hf.get("rotary_dim") or head_dim), float(hf.get("rope_theta", 1e6))
    return _minimax(cls, hf, types, rotary_dim, theta, bool(hf.get("postnorm", False)), scales)


MINIMAX_PARSERS: dict[str, Callable[[type[ModelConfig], dict[str, Any]], ModelConfig]] = {
    "minimax": minimax,
    "minimax_m1": minimax_published,
    "minimax_text_01": minimax_published,
}
