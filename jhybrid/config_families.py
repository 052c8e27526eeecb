"""`ModelConfig.from_hf` for the lightning-attention and Mamba2 hybrid families: NemotronH, Bamba,
Granite-4.0-H here, MiniMax (both its forms) in config_minimax.py.

Each parser reads an HF `config.json` dict into the one `ModelConfig`; the per-layer layout becomes the
`layer_kinds` / `mlp_kinds` tuples. HF quirks are followed, not fixed (each is noted where it is read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from jhybrid.config_fields import MTP_REASON, check_fields

if TYPE_CHECKING:  # each parser is handed the class (`cls`): config.py imports this module when it parses
    from jhybrid.config import ModelConfig


def _eos(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))


def _common(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    hidden = int(hf["hidden_size"])
    num_heads = int(hf["num_attention_heads"])
    return dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf),
        pad_token_id=hf.get("pad_token_id"),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
    )


def _no_sliding_window(hf: dict[str, Any], model_type: str) -> None:
    if hf.get("sliding_window") is not None:
        raise ValueError(
            f"{model_type}: sliding_window={hf['sliding_window']} is not supported (full attention layers attend "
            "to the whole context); set it to null"
        )


# NemotronH block names (current and legacy, and the one-letter `hybrid_override_pattern`) -> (mixer, mlp)
_NEMOTRON_BLOCKS = {
    "linear_attention": ("mamba2", "none"), "mamba": ("mamba2", "none"), "M": ("mamba2", "none"),
    "full_attention": ("full_attention", "none"), "attention": ("full_attention", "none"), "*": ("full_attention", "none"),
    "mlp": ("none", "dense"), "-": ("none", "dense"),
    "moe": ("none", "moe"), "E": ("none", "moe"),
}


_NEMOTRON_READ = (
    "model_type", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "attention_head_dim", "tie_word_embeddings", "max_position_embeddings", "dtype", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "sliding_window", "attention_bias", "layers_block_type", "layer_types",
    "hybrid_override_pattern", "num_hidden_layers", "moe_latent_size", "layer_norm_epsilon", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_shared_experts",
    "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor", "mlp_hidden_act", "use_bias",
    "mamba_hidden_act", "mamba_num_heads", "mamba_head_dim", "n_groups", "mamba_n_groups", "ssm_state_size",
    "conv_kernel", "mamba_d_conv", "use_conv_bias", "mamba_conv_bias", "time_step_min", "mamba_dt_min",
    "intermediate_size", "mlp_bias",
    # read by HF's NemotronH at training or kernel level only, or not at all (it has no RoPE, takes the norm eps
    # from layer_norm_epsilon, the Mamba2 width from heads x head dim, the projection bias from use_bias)
    "chunk_size", "mamba_chunk_size", "expand", "mamba_expand", "time_step_max", "mamba_dt_max", "time_step_floor",
    "mamba_dt_init_floor", "time_step_limit", "mamba_dt_limit", "time_step_rank", "rescale_prenorm_residual",
    "residual_in_fp32", "use_mamba_kernels", "num_logits_to_keep", "mamba_ssm_cache_dtype",
    "moe_shared_expert_overlap", "rms_norm_eps", "norm_eps", "rope_theta", "partial_rotary_factor", "rope_scaling",
    "rope_parameters", "mamba_proj_bias",
)
_NEMOTRON_MTP = {k: MTP_REASON for k in (
    "num_nextn_predict_layers", "mtp_layers_block_type", "mtp_hybrid_override_pattern")}


def nemotron_h(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """NemotronH: each block is ONE of Mamba2, attention (no RoPE), a relu^2 MLP or a relu^2 MoE (sigmoid
    grouped routing + a shared expert), pre-normed with its own residual. Layout from `layers_block_type`
    (or the legacy `hybrid_override_pattern`, e.g. "M-M*-E"). HF clamps dt to `[time_step_min, inf)`
    in its chunked prefill only; jhybrid clamps in every step (see models/mamba2.py)."""
    mtp = int(hf.get("num_nextn_predict_layers") or 0) > 0  # without MTP layers their fields are neutral
    check_fields("nemotron_h", hf, _NEMOTRON_READ if mtp else _NEMOTRON_READ + tuple(_NEMOTRON_MTP),
                 ignored=_NEMOTRON_MTP if mtp else None)
    common = _common(hf, "nemotron_h")
    _no_sliding_window(hf, "nemotron_h")
    if hf.get("attention_head_dim", common["head_dim"]) != common["head_dim"]:
        raise ValueError(f"nemotron_h: attention_head_dim={hf['attention_head_dim']} but head_dim={common['head_dim']}")
    if int(hf.get("n_shared_experts", 1)) != 1:
        raise ValueError(f"nemotron_h: n_shared_experts={hf['n_shared_experts']} is not supported (one shared expert)")
    blocks = hf.get("layers_block_type") or hf.get("layer_types") or list(hf.get("hybrid_override_pattern") or "")
    if not blocks:
        raise ValueError("nemotron_h: config has neither layers_block_type nor hybrid_override_pattern")
    if unknown := set(blocks) - set(_NEMOTRON_BLOCKS):
        raise ValueError(f"nemotron_h: unknown block types {sorted(unknown)}; expected {sorted(_NEMOTRON_BLOCKS)}")
    if hf.get("moe_latent_size") is not None:
        raise ValueError(f"nemotron_h: moe_latent_size={hf['moe_latent_size']} (latent MoE projections) is not supported")
    eps = float(hf.get("layer_norm_epsilon", 1e-5))
    num_experts = int(hf.get("n_routed_experts", 0) or 0) if any(_NEMOTRON_BLOCKS[b][1] == "moe" for b in blocks) else 0
    moe = dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
        shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size", 0)),
        shared_expert_gate=False,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_router="sigmoid_group",
        moe_n_group=int(hf.get("n_group", 1)),
        moe_topk_group=int(hf.get("topk_group", 1)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    ) if num_experts else {}
    mlp_act = hf.get("mlp_hidden_act", "relu2")
    if mlp_act != "relu2":
        raise ValueError(f"nemotron_h: unsupported mlp_hidden_act={mlp_act!r}; only 'relu2' is implemented")
    use_bias = bool(hf.get("use_bias", False))  # HF's Mamba2 in_proj/out_proj take their bias from use_bias
    return cls(
        **common,
        num_layers=len(blocks),
        layer_kinds=tuple(_NEMOTRON_BLOCKS[b][0] for b in blocks),
        mlp_kinds=tuple(_NEMOTRON_BLOCKS[b][1] for b in blocks),
        rms_norm_eps=eps,
        hidden_act=hf.get("mamba_hidden_act", "silu"),
        rotary_dim=0,  # no RoPE
        attention_bias=False,  # HF NemotronHAttention builds its projections without bias
        mamba_num_heads=int(hf["mamba_num_heads"]),
        mamba_head_dim=int(hf["mamba_head_dim"]),
        mamba_n_groups=int(hf.get("mamba_n_groups", hf.get("n_groups", 8))),
        ssm_state_size=int(hf["ssm_state_size"]),
        mamba_conv_kernel=int(hf.get("mamba_d_conv", hf.get("conv_kernel", 4))),
        mamba_conv_bias=bool(hf.get("mamba_conv_bias", hf.get("use_conv_bias", True))),  # the legacy names win, as in HF
        mamba_proj_bias=use_bias,
        mamba_dt_min=float(hf.get("mamba_dt_min", hf.get("time_step_min", 0.001))),  # HF NemotronH: (time_step_min, inf)
        mamba_norm_eps=eps,
        intermediate_size=int(hf.get("intermediate_size", 0)),
        mlp_act="relu2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        **moe,
    )


def _time_step_limit(hf: dict[str, Any]) -> tuple[float, float]:
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    hi = limit[1]
    hi = float(hi.get("__float__", "inf")) if isinstance(hi, dict) else float(hi)  # HF serialises inf as a dict
    return float(limit[0]), hi


def _bamba_mamba2(hf: dict[str, Any], hidden: int, eps: float, family: str) -> dict[str, Any]:
    """The Mamba2 fields of a Bamba-style config (Bamba, Granite-4.0-H): heads, head size (`"auto"`: the
    inner width over the heads), groups, state, conv, biases, the dt clamp from `time_step_limit`, and the
    gated norm's eps (HF passes rms_norm_eps)."""
    heads = int(hf.get("mamba_n_heads", 128))
    inner = int(hf.get("mamba_expand", 2)) * hidden
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != inner:
        raise ValueError(
            f"{family}: mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must equal mamba_expand x "
            f"hidden_size ({inner})"
        )
    dt_min, dt_max = _time_step_limit(hf)
    return dict(
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_n_groups=int(hf.get("mamba_n_groups", 1)),
        ssm_state_size=int(hf.get("mamba_d_state", 256)),
        mamba_conv_kernel=int(hf.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
        mamba_dt_min=dt_min,
        mamba_dt_max=dt_max,
        mamba_norm_eps=eps,
    )


def bamba(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """Bamba: every layer is Mamba2 or attention (at `attn_layer_indices`; RoPE on the first half of each
    head, HF hard-codes partial_rotary_factor 0.5) followed by a SwiGLU MLP, both pre-normed."""
    common = _common(hf, "bamba")
    num_layers = int(hf["num_hidden_layers"])
    attn = set(hf.get("attn_layer_indices") or [])
    eps = float(hf.get("rms_norm_eps", 1e-5))
    mamba = _bamba_mamba2(hf, common["hidden_size"], eps, "bamba")
    rope = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"bamba: unsupported rope_type {rope.get('rope_type')!r}; only 'default' is implemented")
    return cls(
        **common,
        num_layers=num_layers,
        layer_kinds=tuple("full_attention" if i in attn else "mamba2" for i in range(num_layers)),
        mlp_kinds=("dense",) * num_layers,
        rms_norm_eps=eps,
        hidden_act=hf.get("hidden_act", "silu"),
        attention_bias=bool(hf.get("attention_bias", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_dim=int(common["head_dim"] * 0.5) // 2 * 2,
        **mamba,
        intermediate_size=int(hf["intermediate_size"]),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


# Granite `layer_types`: current HF names and the legacy ones of hub configs (HF remaps the same way)
_GRANITE_LAYERS = {
    "linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "full_attention", "attention": "full_attention",
}
_GRANITE_POSITIONS = {"rope": True, "nope": False, None: False}


def granitemoehybrid(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """Granite-4.0-H (GraniteMoeHybrid): every layer is Mamba2 (as Bamba's) or attention, then a SwiGLU
    MLP: with `num_local_experts > 0` a softmax top-k MoE (experts of `intermediate_size`, weights = softmax
    over the top-k logits, i.e. renormalised) plus an ungated shared MLP of `shared_intermediate_size`;
    with 0 experts the shared MLP alone (a dense MLP). Granite's scalings: embeddings times
    `embedding_multiplier`, attention scores times `attention_multiplier` (instead of 1/sqrt(head_dim)),
    each sublayer's output times `residual_multiplier` before its residual add, logits divided by
    `logits_scaling`. RoPE over the whole head when `position_embedding_type == "rope"`, none otherwise.
    HF clamps dt to `time_step_limit` only in its chunked prefill; jhybrid clamps in every step (mamba2.py).
    """
    common = _common(hf, "granitemoehybrid")
    num_layers = int(hf["num_hidden_layers"])
    _no_sliding_window(hf, "granitemoehybrid")
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers  # HF: all Mamba2
    if len(types) != num_layers:
        raise ValueError(f"granitemoehybrid: layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
    if unknown := set(types) - set(_GRANITE_LAYERS):
        raise ValueError(f"granitemoehybrid: unknown layer_types {sorted(unknown)}; expected {sorted(_GRANITE_LAYERS)}")
    position = hf.get("position_embedding_type")
    if position not in _GRANITE_POSITIONS:
        raise ValueError(
            f"granitemoehybrid: unsupported position_embedding_type={position!r}; expected 'rope', 'nope' or null"
        )
    rope = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if _GRANITE_POSITIONS[position] and rope_type != "default":
        raise ValueError(f"granitemoehybrid: unsupported {rope_type=}; only 'default' RoPE is implemented")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    mamba = _bamba_mamba2(hf, common["hidden_size"], eps, "granitemoehybrid")
    num_experts = int(hf.get("num_local_experts", 8) or 0)
    inter, shared = int(hf.get("intermediate_size", 11008)), int(hf.get("shared_intermediate_size", 1024))
    if num_experts:
        mlp = dict(
            intermediate_size=inter,
            num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=shared,
            shared_expert_gate=False,
            norm_topk_prob=True,  # softmax over the top-k logits == top-k of the softmax, renormalised
        )
    elif shared > 0:
        mlp = dict(intermediate_size=shared)  # the shared MLP is the layer's whole MLP
    else:
        raise ValueError("granitemoehybrid: num_local_experts=0 and shared_intermediate_size=0 leave no MLP")
    residual = float(hf.get("residual_multiplier", 1.0))
    return cls(
        **common,
        num_layers=num_layers,
        layer_kinds=tuple(_GRANITE_LAYERS[t] for t in types),
        mlp_kinds=("moe" if num_experts else "dense",) * num_layers,
        rms_norm_eps=eps,
        hidden_act=hf.get("hidden_act", "silu"),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_scale=float(hf.get("attention_multiplier", 1.0)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_dim=common["head_dim"] if _GRANITE_POSITIONS[position] else 0,
        **mamba,
        full_attn_beta=residual,
        linear_attn_beta=residual,
        mlp_beta=residual,
        **mlp,
    )


FAMILY_PARSERS: dict[str, Callable[[type[ModelConfig], dict[str, Any]], ModelConfig]] = {
    "nemotron_h": nemotron_h,
    "bamba": bamba,
    "granitemoehybrid": granitemoehybrid,
}
