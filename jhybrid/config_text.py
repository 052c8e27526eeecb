"""`ModelConfig.from_hf` for the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) and the dense
Qwen3 / Llama, and the multimodal Qwen3.5 wrappers, read as their text model.

Every field is accounted for (jhybrid/config_fields.py): read here, neutral, or ignored on purpose (the
vision tower, M-RoPE sections, multi-token-prediction heads); any other raises, naming it. So a Qwen3.5-MoE
config renamed `qwen3_5_text` is refused (its expert fields are named) instead of read as a dense model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jhybrid.config_fields import MTP_REASON, check_fields, check_rope_keys

if TYPE_CHECKING:  # each reader is handed the class (`cls`): config.py imports this module
    from jhybrid.config import LayerKind, MlpKind, ModelConfig

# Multimodal wrappers read as their text model (`text_config`): wrapper -> text model_type
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Gated DeltaNet hybrids; their RMSNorm weights are stored zero-centred (the norm multiplies by (1 + w)).
_QWEN_HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

_VISION_REASON = "vision tower: jhybrid runs the text model only"
_WRAPPER_IGNORED = {k: _VISION_REASON for k in (
    "vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
# fields every text reader reads; then per model_type the rest (jhybrid/config_fields.py refuses any other)
_BASE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "max_position_embeddings", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "intermediate_size",
)
_GDN_FIELDS = (
    "layer_types", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "attn_output_gate",
    "mamba_ssm_dtype",  # the dtype serving engines keep the GDN state in; jhybrid always keeps it in float32
)
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
_SLIDING_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers")
TEXT_FIELDS = {
    "llama": _BASE_FIELDS + ("mlp_bias", "pretraining_tp"),  # pretraining_tp: a training-time split of the matmuls
    "qwen3": _BASE_FIELDS + _SLIDING_FIELDS + ("layer_types",),
    "qwen3_next": _BASE_FIELDS + _GDN_FIELDS + _MOE_FIELDS + _SLIDING_FIELDS,
    "qwen3_5_text": _BASE_FIELDS + _GDN_FIELDS + ("mlp_only_layers",),
    "qwen3_5_moe_text": _BASE_FIELDS + _GDN_FIELDS + _MOE_FIELDS,
}
_MTP_IGNORED = {k: MTP_REASON for k in ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")}
_QWEN3_5_MOE_HINT = {
    frozenset(("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")): (
        "These are mixture-of-experts fields: Qwen3.5 MoE checkpoints (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B) "
        "have model_type 'qwen3_5_moe' (text_config 'qwen3_5_moe_text'); keep the published model_type."
    )
}


def text_config(model_type: str, hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A multimodal wrapper's `(text model_type, text config)`; checks the wrapper's own fields."""
    check_fields(model_type, hf, ("model_type", "text_config", "tie_word_embeddings", "dtype", "torch_dtype"),
                 ignored=_WRAPPER_IGNORED)
    if "text_config" not in hf:
        raise ValueError(f"{model_type}: a multimodal wrapper config needs its text_config")
    text, want = dict(hf["text_config"]), WRAPPERS[model_type]
    if text.get("model_type", want) != want:
        raise ValueError(
            f"{model_type}: text_config has model_type {text['model_type']!r}, expected {want!r}: a renamed wrapper "
            f"reads the wrong model; keep the published model_type of both"
        )
    text["model_type"] = want
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return want, text


def _layer_kinds(hf: dict[str, Any], num_layers: int, hybrid: bool) -> tuple[LayerKind, ...]:
    if not hybrid:
        types = hf.get("layer_types") or ["full_attention"] * num_layers
        if set(types) != {"full_attention"}:
            raise ValueError(f"{hf['model_type']}: layer_types {sorted(set(types))}: only full_attention is supported")
        return ("full_attention",) * num_layers
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
    if unknown := set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"{hf['model_type']}: unknown layer_types {sorted(unknown)}")
    return tuple(types)


def _rope(hf: dict[str, Any], head_dim: int, default_partial: float) -> dict[str, Any]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    check_rope_keys(hf["model_type"], hf, params)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return dict(
        rope_theta=float(theta),
        rotary_dim=int(head_dim * partial) // 2 * 2,
        rope_type=rope_type,
        rope_factor=float(params.get("factor", 1.0)),
        rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _mlp_kinds(model_type: str, hf: dict[str, Any], num_layers: int) -> tuple[tuple[MlpKind, ...], int]:
    """Per-layer MLP kinds and the expert count. Qwen3-Next: MoE where `(i + 1) % decoder_sparse_step == 0`
    outside `mlp_only_layers`; Qwen3.5-MoE: every layer (HF reads neither field, so both must be neutral)."""
    if model_type == "qwen3_5_moe_text":
        num_experts = int(hf.get("num_experts") or 0)
        if num_experts <= 0:
            raise ValueError(f"qwen3_5_moe_text: num_experts={hf.get('num_experts')} must be positive")
        odd = {k: hf[k] for k, neutral in (("mlp_only_layers", []), ("decoder_sparse_step", 1), ("norm_topk_prob", True))
               if hf.get(k, neutral) != neutral}
        if odd:
            raise ValueError(
                f"qwen3_5_moe_text: {odd} not supported: every Qwen3.5-MoE layer is a mixture of experts with "
                "renormalised top-k weights (HF transformers reads none of these fields)"
            )
        return ("moe",) * num_layers, num_experts
    num_experts = int(hf.get("num_experts", 0) or 0) if model_type == "qwen3_next" else 0
    sparse_step = int(hf.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(hf.get("mlp_only_layers") or []) if model_type == "qwen3_next" else set()
    kinds = tuple("moe" if num_experts and i not in mlp_only and (i + 1) % sparse_step == 0 else "dense"
                  for i in range(num_layers))
    return kinds, num_experts


def from_hf_text(cls: type[ModelConfig], model_type: str, hf: dict[str, Any]) -> ModelConfig:
    mtp = model_type.startswith("qwen3_5") and int(hf.get("mtp_num_hidden_layers") or 0) > 0
    read = TEXT_FIELDS[model_type] + (tuple(_MTP_IGNORED) if model_type.startswith("qwen3_5") and not mtp else ())
    check_fields(model_type, hf, read, ignored=_MTP_IGNORED if mtp else None,
                 hints=_QWEN3_5_MOE_HINT if model_type == "qwen3_5_text" else None)
    sliding = hf.get("use_sliding_window") if "use_sliding_window" in hf else hf.get("sliding_window") is not None
    if sliding:
        raise ValueError(f"{model_type}: sliding-window attention (use_sliding_window / sliding_window) is not supported")
    num_layers = int(hf["num_hidden_layers"])
    hidden = int(hf["hidden_size"])
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    hybrid = model_type in _QWEN_HYBRIDS
    if hybrid and not hf.get("attn_output_gate", True):
        raise ValueError(f"{model_type}: attn_output_gate=false is not supported (HF's Qwen attention always gates)")
    mlp_kinds, num_experts = _mlp_kinds(model_type, hf, num_layers)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return cls(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_kinds=_layer_kinds(hf, num_layers, hybrid),
        mlp_kinds=mlp_kinds,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_zero_centred=hybrid,
        hidden_act=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        attn_output_gate=hybrid,
        qk_norm=hybrid or model_type == "qwen3",
        attention_bias=bool(hf.get("attention_bias", False)),
        **_rope(hf, head_dim, 0.25 if hybrid else 1.0),
        linear_num_key_heads=int(hf.get("linear_num_key_heads", 0) or 0) if hybrid else 0,
        linear_num_value_heads=int(hf.get("linear_num_value_heads", 0) or 0) if hybrid else 0,
        linear_key_head_dim=int(hf.get("linear_key_head_dim", 0) or 0) if hybrid else 0,
        linear_value_head_dim=int(hf.get("linear_value_head_dim", 0) or 0) if hybrid else 0,
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)) if hybrid else 4,
        intermediate_size=int(hf.get("intermediate_size", 0) or 0),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 0) or 0) if num_experts else 0,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0) or 0) if num_experts else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )
