"""Model configuration: one frozen dataclass for every supported hybrid family.

`ModelConfig.from_hf(config_dict)` reads an HF `config.json`; the per-layer layout (which layers are full
attention, which are linear, which MLPs are mixtures of experts) is data on the config, so one model
definition serves every family. The readers: config_text.py (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen3, Llama),
config_minimax.py (MiniMax, HF's and the published form), config_families.py (NemotronH, Bamba, Granite-4.0-H);
config_fields.py refuses fields the Qwen/Llama, MiniMax and NemotronH readers do not read, naming them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

from jhybrid.config_fields import collect_ignored, read_quantization_config
from jhybrid.config_text import TEXT_FIELDS, WRAPPERS, from_hf_text, text_config

# A layer is a mixer followed by an MLP, each pre-normed with its own residual; either may be absent
# ("none": NemotronH blocks are a mixer *or* an MLP). State-carrying ("linear") mixers: "linear_attention"
# (Gated DeltaNet), "lightning_attention" (MiniMax, fixed per-head decay) and "mamba2" (SSD).
LayerKind = Literal["full_attention", "linear_attention", "lightning_attention", "mamba2", "none"]
MlpKind = Literal["dense", "moe", "none"]
LAYER_KINDS = ("full_attention", "linear_attention", "lightning_attention", "mamba2", "none")
LINEAR_KINDS = ("linear_attention", "lightning_attention", "mamba2")
MLP_KINDS = ("dense", "moe", "none")
MLP_ACTS = ("silu", "relu2")
LIGHTNING_NORM_EPS = 1e-6  # HF MiniMaxLightningAttention's output RMSNorm uses the default eps, not rms_norm_eps

# Families parsed in jhybrid/config_families.py (lightning attention, Mamba2 hybrids); MiniMax in its HF
# (`minimax`) and its published (`minimax_m1`, `minimax_text_01`) form.
_FAMILY_MODEL_TYPES = ("minimax", "minimax_m1", "minimax_text_01", "nemotron_h", "bamba", "granitemoehybrid")
MOE_ROUTERS = ("softmax", "sigmoid_group")
SUPPORTED_MODEL_TYPES = tuple(WRAPPERS) + tuple(TEXT_FIELDS) + _FAMILY_MODEL_TYPES
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Everything the model definition needs, validated once.

    Attributes follow HF names where one exists. `layer_kinds[i]` names layer i's mixer: full softmax
    attention (paged KV), a linear mixer with fixed-size state (`LINEAR_KINDS`), or "none"; `mlp_kinds[i]`
    its MLP: dense, a mixture of experts, or "none".

    Residuals: `x = alpha * r + beta * f(norm(x))` with `r = x`, or `r = norm(x)` when `residual_from_norm`
    (MiniMax); alpha/beta per sublayer kind (`*_alpha`, `*_beta`; 1 for most families).

    Scalings (Granite; neutral for the other families): the embeddings are multiplied by
    `embedding_multiplier`, attention scores by `attention_scale` (None: `head_dim ** -0.5`), and the logits
    divided by `logits_scaling`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_kinds: tuple[LayerKind, ...]
    mlp_kinds: tuple[MlpKind, ...]
    rms_norm_eps: float = 1e-6
    norm_zero_centred: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits = lm_head(x) / logits_scaling
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # full attention
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attn_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate (Qwen3-Next / Qwen3.5)
    qk_norm: bool = False
    attention_bias: bool = False
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # leading head dims that rotate; the rest pass through
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # Gated DeltaNet (linear attention)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # Mamba2 (SSD) mixer: heads of dim `mamba_head_dim`, B/C shared by `mamba_n_groups` head groups
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 1
    ssm_state_size: int = 0
    mamba_conv_kernel: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_min: float = 0.0  # dt = clip(softplus(dt + dt_bias), dt_min, dt_max), in every step (see mamba2.py)
    mamba_dt_max: float = float("inf")
    mamba_norm_eps: float = 1e-5
    # residual scheme (module docstring)
    residual_from_norm: bool = False
    full_attn_alpha: float = 1.0
    full_attn_beta: float = 1.0
    linear_attn_alpha: float = 1.0
    linear_attn_beta: float = 1.0
    mlp_alpha: float = 1.0
    mlp_beta: float = 1.0
    # MLPs
    intermediate_size: int = 0
    mlp_act: str = "silu"  # "silu": gated SwiGLU (gate_proj, up_proj); "relu2": relu(up(x))^2, no gate
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True  # the shared expert's output is scaled by sigmoid(x @ shared_gate) (Qwen3-Next)
    norm_topk_prob: bool = True
    # "softmax": top-k of softmax(router logits) (Qwen3-Next, MiniMax); "sigmoid_group" (NemotronH,
    # DeepSeek-V3 style): sigmoid scores, experts chosen by score + router_bias within the best
    # `moe_topk_group` of `moe_n_group` expert groups, weights = scores (renormalised) * routed_scaling_factor
    moe_router: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if len(self.layer_kinds) != self.num_layers or len(self.mlp_kinds) != self.num_layers:
            raise ValueError(
                f"layer_kinds ({len(self.layer_kinds)}) and mlp_kinds ({len(self.mlp_kinds)}) must have "
                f"one entry per layer ({self.num_layers=})"
            )
        for i, (kind, mlp_kind) in enumerate(zip(self.layer_kinds, self.mlp_kinds)):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer {i}: unknown layer kind {kind!r}; expected one of {LAYER_KINDS}")
            if mlp_kind not in MLP_KINDS:
                raise ValueError(f"layer {i}: unknown mlp kind {mlp_kind!r}; expected one of {MLP_KINDS}")
            if kind == "none" and mlp_kind == "none":
                raise ValueError(f"layer {i} has neither a mixer nor an MLP")
        if self.num_full_layers:
            if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
                raise ValueError(f"full attention needs positive {self.num_heads=}, {self.num_kv_heads=}, {self.head_dim=}")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
            if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
                raise ValueError(f"{self.rotary_dim=} must be even and at most {self.head_dim=}")
            if self.rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported {self.rope_type=}; supported: {_SUPPORTED_ROPE_TYPES}")
        if "linear_attention" in self.layer_kinds:
            hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
            if hk <= 0 or hv <= 0 or hv % hk:
                raise ValueError(f"linear_num_value_heads ({hv}) must be a positive multiple of linear_num_key_heads ({hk})")
            if self.linear_conv_kernel < 1:
                raise ValueError(f"{self.linear_conv_kernel=} must be >= 1")
        if "moe" in self.mlp_kinds and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"MoE layers need 0 < {self.num_experts_per_tok=} <= {self.num_experts=}")
        if self.moe_router not in MOE_ROUTERS:
            raise ValueError(f"unsupported {self.moe_router=}; supported: {MOE_ROUTERS}")
        if "moe" in self.mlp_kinds and self.moe_router == "sigmoid_group":
            e, g = self.num_experts, self.moe_n_group
            if g < 1 or e % g or e // g < 2 or not 0 < self.moe_topk_group <= g:
                raise ValueError(
                    f"grouped routing needs experts split into groups of >= 2 and 0 < topk_group <= groups, got "
                    f"{self.num_experts=} {self.moe_n_group=} {self.moe_topk_group=}"
                )
            if self.moe_topk_group * (e // g) < self.num_experts_per_tok:
                raise ValueError(f"{self.moe_topk_group=} groups of {e // g} experts cannot hold top-{self.num_experts_per_tok}")
        if "lightning_attention" in self.layer_kinds and (self.num_heads <= 0 or self.head_dim <= 0):
            raise ValueError(f"lightning attention needs positive {self.num_heads=} and {self.head_dim=}")
        if "mamba2" in self.layer_kinds:
            h, p, g, n = self.mamba_num_heads, self.mamba_head_dim, self.mamba_n_groups, self.ssm_state_size
            if min(h, p, g, n) <= 0 or h % g:
                raise ValueError(
                    f"mamba2 needs positive heads, head dim, groups and state size with heads a multiple of groups, "
                    f"got {self.mamba_num_heads=} {self.mamba_head_dim=} {self.mamba_n_groups=} {self.ssm_state_size=}"
                )
            if self.mamba_conv_kernel < 1:
                raise ValueError(f"{self.mamba_conv_kernel=} must be >= 1")
        if self.logits_scaling == 0 or self.embedding_multiplier == 0:
            raise ValueError(f"{self.logits_scaling=} and {self.embedding_multiplier=} must be nonzero")
        if self.attention_scale is not None and not self.attention_scale > 0:
            raise ValueError(f"{self.attention_scale=} must be positive (or None for head_dim ** -0.5)")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported {self.hidden_act=}; only 'silu' is implemented")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"unsupported {self.mlp_act=}; supported: {MLP_ACTS}")

    # ----- derived sizes -----
    @property
    def num_full_layers(self) -> int:
        return sum(k == "full_attention" for k in self.layer_kinds)

    @property
    def num_linear_layers(self) -> int:
        """Layers with state slots (Gated DeltaNet, lightning attention, Mamba2)."""
        return sum(k in LINEAR_KINDS for k in self.layer_kinds)

    @property
    def linear_layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(k for k in self.layer_kinds if k in LINEAR_KINDS)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the Mamba2 depthwise conv: x, B and C concatenated."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.ssm_state_size

    def linear_state_shapes(self, kind: LayerKind) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-slot shapes of one linear layer's (conv state `[C, W-1]`, recurrent state `[H, K, V]`).

        Lightning attention has no conv: its conv state is a one-float `[1, 1]` placeholder that nothing reads. Not
        the empty `[0, 0]`: XLA makes a zero-size array a constant, so every program that takes the state donated
        and returns it copied that constant into the output buffer, a copy launched per lightning layer (10 of a
        MiniMax-shaped batch-1 step's 210 kernels on the H200 compile, benchmarks/RESULTS.md session 39); a
        non-empty array passes through aliased. Mamba2's recurrent state is `[heads, ssm_state_size, head_dim]`:
        K is the state (B/C) dim, V the head dim, as in `S += k^T v`.
        """
        if kind == "linear_attention":
            conv = (self.conv_dim, self.linear_conv_kernel - 1)
            return conv, (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)
        if kind == "lightning_attention":
            return (1, 1), (self.num_heads, self.head_dim, self.head_dim)
        if kind == "mamba2":
            conv = (self.mamba_conv_dim, self.mamba_conv_kernel - 1)
            return conv, (self.mamba_num_heads, self.ssm_state_size, self.mamba_head_dim)
        raise ValueError(f"{kind!r} is not a linear layer kind; expected one of {LINEAR_KINDS}")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache bytes one token costs across all full-attention layers."""
        return self.num_full_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def state_bytes_per_sequence(self) -> int:
        """fp32 linear-layer state (conv + recurrent) one sequence holds across all linear layers."""
        total = 0
        for kind in self.linear_layer_kinds:
            (c, w1), (h, k, v) = self.linear_state_shapes(kind)
            total += c * w1 + h * k * v
        return total * 4

    # ----- construction -----
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from an HF `config.json` dict (multimodal Qwen3.5 configs use their text part).

        A `quantization_config` (block-wise FP8 only; `jhybrid.config_fields.read_quantization_config`) is
        validated here and honoured by the loader, which dequantizes the weights (converters/fp8.py).

        Raises:
          ValueError: an unsupported model_type or quantization_config, a field that changes the model and is not supported (named),
            or inconsistent values. Fields ignored on purpose are logged once (jhybrid/config_fields.py).
        """
        if read_quantization_config(hf) is not None:  # block-wise FP8: dequantized at load (converters/fp8.py)
            hf = {k: v for k, v in hf.items() if k != "quantization_config"}
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; jhybrid supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in _FAMILY_MODEL_TYPES:
            from jhybrid.config_families import FAMILY_PARSERS
            from jhybrid.config_minimax import MINIMAX_PARSERS

            return (FAMILY_PARSERS | MINIMAX_PARSERS)[model_type](cls, hf)
        if model_type in WRAPPERS:
            return dataclasses.replace(from_hf_text(cls, *text_config(model_type, hf)), model_type=model_type)
        return from_hf_text(cls, model_type, hf)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads `config.json` (a file, or a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_hf(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        for key in ("layer_kinds", "mlp_kinds", "eos_token_ids"):
            d[key] = tuple(d[key])
        return cls(**d)


def ignored_fields(hf: dict[str, Any]) -> dict[str, str]:
    """`{field: why}` of the fields of an HF config that jhybrid ignores on purpose (a vision tower, M-RoPE
    sections, multi-token-prediction heads), for `jhybrid inspect`. Raises as `ModelConfig.from_hf` does."""
    with collect_ignored() as found:
        ModelConfig.from_hf(hf)
    return found
