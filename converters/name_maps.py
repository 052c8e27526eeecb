"""Per-family maps from HF on-disk tensor names to jhybrid flat parameter names.

jhybrid names are those of `jhybrid.models.params.flatten_shapes(param_shapes(cfg))`, e.g.
`layers.3.attn.q_proj`. Transforms:

- torch Linear weights `[out, in]` -> `[in, out]`; `lm_head.weight [V, D]` -> `lm_head [D, V]`;
  embeddings stay `[V, D]`; conv1d `[C, 1, W]` -> `conv_weight [C, W]`.
- Qwen3-Next `in_proj_qkvz [HK*(2K + 2rV), D]` is packed per key-head group g as `[q_g (K), k_g (K),
  v_g (r*V), z_g (r*V)]` (r = HV/HK); jhybrid wants `in_proj_qkv [D, HK*K + HK*K + HV*V]` with all q
  heads, then all k heads, then all v heads (value head g*r + j is head j of group g), and `in_proj_z
  [D, HV*V]`. `in_proj_ba [HK*2r, D]` is packed per group as `[b_g (r), a_g (r)]` -> `in_proj_b`,
  `in_proj_a [D, HV]` (see HF `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`).
- Qwen3.5 and Qwen3.5-MoE store flat `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (transpose only);
  Qwen3.5-MoE's MLPs are Qwen3-Next's (router `mlp.gate`, experts, `shared_expert`, `shared_expert_gate`).
- MoE experts, on disk one per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused
  (`mlp.experts.gate_up_proj [E, 2*Ie, D]`, gate rows first; `mlp.experts.down_proj [E, D, Ie]`), ->
  stacked `gate_proj`, `up_proj [E, D, Ie]`, `down_proj [E, Ie, D]`.

Ignored on-disk tensors: `model.visual.*` (Qwen3.5 vision tower), `mtp.*` (multi-token prediction
heads), `*.rotary_emb.inv_freq`, MiniMax's derived lightning-decay buffers (`*.slope_rate`,
`*.query_decay`, `*.key_decay`, `*.diagonal_decay`: jhybrid recomputes the slopes from the layer index),
and `lm_head.weight` when the embeddings are tied.

The lightning-attention and Mamba2 families (MiniMax, NemotronH, Bamba, Granite-4.0-H) have their maps in
`family_maps.py`; the embeddings, attention and dense MLP maps that every family uses are in `layer_maps.py`.
Multimodal Qwen3.5 (and Qwen3.5-MoE) checkpoints keep the text model under `model.language_model.`, read as
`model.`. Ignored tensors are logged once per checkpoint (converters/load.py).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from converters.family_maps import FAMILY_PLANS
from converters.layer_maps import attention, dense_mlp, embed_and_head
from converters.plan import Plan, Rule, array_module, identity, linear
from jhybrid.config import ModelConfig

_IGNORED_GROUPS = (
    ("model.visual.", "vision tower: text model only"), ("visual.", "vision tower: text model only"),
    ("mtp.", "multi-token prediction: not run"), ("model.mtp.", "multi-token prediction: not run"),
)
_IGNORED_PREFIXES = tuple(p for p, _ in _IGNORED_GROUPS)
_IGNORED_SUFFIXES = (
    ".rotary_emb.inv_freq", ".self_attn.slope_rate", ".self_attn.query_decay", ".self_attn.key_decay",
    ".self_attn.diagonal_decay",
)


def normalize_name(name: str) -> str:
    """`model.language_model.X` (multimodal Qwen3.5) and `backbone.X` (NemotronH hub checkpoints) ->
    `model.X`; other names unchanged."""
    for prefix in ("model.language_model.", "backbone."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return name


def ignored_group(name: str) -> str:
    """What an ignored tensor is, for the load log: "model.visual.* (vision tower)", "mtp.* (...)", ..."""
    for prefix, what in _IGNORED_GROUPS:
        if name.startswith(prefix):
            return f"{prefix}* ({what})"
    for suffix in _IGNORED_SUFFIXES:
        if name.endswith(suffix):
            return f"*{suffix} (derived buffer, recomputed)"
    return f"{name} (tied to the embeddings)"


def is_ignored(name: str, cfg: ModelConfig) -> bool:
    """Whether a normalised on-disk tensor is deliberately not converted."""
    if name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def build_plan(cfg: ModelConfig, disk_names: Iterable[str]) -> Plan:
    """The rule for every jhybrid parameter of `cfg`.

    Args:
      cfg: the model config.
      disk_names: normalised on-disk names; only used to choose between equivalent layouts (fused or
        per-expert MoE weights), never to decide what is required.
    """
    disk = set(disk_names)
    if cfg.model_type in FAMILY_PLANS:
        return FAMILY_PLANS[cfg.model_type](cfg, disk)
    d = cfg.hidden_size
    plan = embed_and_head(cfg)
    for i, (kind, mlp_kind) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds)):
        hf, jh = f"model.layers.{i}.", f"layers.{i}."
        plan[jh + "input_norm"] = identity((d,), hf + "input_layernorm.weight")
        plan[jh + "post_norm"] = identity((d,), hf + "post_attention_layernorm.weight")
        if kind == "full_attention":
            mixer = attention(cfg, hf + "self_attn.")
        elif cfg.model_type == "qwen3_next":
            mixer = _gdn_packed(cfg, hf + "linear_attn.")
        else:
            mixer = _gdn_flat(cfg, hf + "linear_attn.")
        plan.update({f"{jh}{'attn' if kind == 'full_attention' else 'gdn'}.{k}": r for k, r in mixer.items()})
        if mlp_kind == "moe":
            mlp = _moe(cfg, hf + "mlp.", fused=f"{hf}mlp.experts.gate_up_proj" in disk)
        else:
            mlp = dense_mlp(d, cfg.intermediate_size, hf + "mlp.", cfg.mlp_bias)
        plan.update({f"{jh}mlp.{k}": r for k, r in mlp.items()})
    return plan


def _gdn_common(cfg: ModelConfig, p: str) -> dict[str, Rule]:
    hv, c, w = cfg.linear_num_value_heads, cfg.conv_dim, cfg.linear_conv_kernel
    return {
        "conv_weight": Rule((p + "conv1d.weight",), ((c, 1, w),), lambda x: x[:, 0, :]),  # [C, 1, W] -> [C, W]
        "dt_bias": identity((hv,), p + "dt_bias"),
        "A_log": identity((hv,), p + "A_log"),
        "norm": identity((cfg.linear_value_head_dim,), p + "norm.weight"),
        "out_proj": linear((cfg.linear_value_dim, cfg.hidden_size), p + "out_proj.weight"),
    }


def _gdn_flat(cfg: ModelConfig, p: str) -> dict[str, Rule]:
    d, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv": linear((d, cfg.conv_dim), p + "in_proj_qkv.weight"),
        "in_proj_z": linear((d, cfg.linear_value_dim), p + "in_proj_z.weight"),
        "in_proj_b": linear((d, hv), p + "in_proj_b.weight"),
        "in_proj_a": linear((d, hv), p + "in_proj_a.weight"),
    } | _gdn_common(cfg, p)


def _gdn_packed(cfg: ModelConfig, p: str) -> dict[str, Rule]:
    d, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k, vd, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    group = 2 * k + 2 * r * vd
    qkvz_shape, ba_shape = (hk * group, d), (hk * 2 * r, d)

    def qkvz_parts(w: np.ndarray) -> tuple[np.ndarray, ...]:
        w = w.reshape(hk, group, d)  # [HK, K + K + rV + rV, D]
        q, kk = w[:, :k], w[:, k : 2 * k]  # [HK, K, D]
        val, z = w[:, 2 * k : 2 * k + r * vd], w[:, 2 * k + r * vd :]  # [HK, rV, D]: value head g*r + j
        return tuple(x.reshape(-1, d) for x in (q, kk, val, z))  # [HK*K, D] x2, [HV*V, D] x2

    def qkv(w: np.ndarray) -> np.ndarray:
        q, kk, val, _ = qkvz_parts(w)
        return array_module(w).concatenate([q, kk, val], axis=0).T  # [D, 2*HK*K + HV*V]

    def z(w: np.ndarray) -> np.ndarray:
        return qkvz_parts(w)[3].T  # [D, HV*V]

    def ba(w: np.ndarray, which: int) -> np.ndarray:
        w = w.reshape(hk, 2 * r, d)  # [HK, b (r) + a (r), D]
        return w[:, which * r : (which + 1) * r].reshape(hv, d).T  # [D, HV]

    qkvz_name, ba_name = p + "in_proj_qkvz.weight", p + "in_proj_ba.weight"
    return {
        "in_proj_qkv": Rule((qkvz_name,), (qkvz_shape,), qkv),
        "in_proj_z": Rule((qkvz_name,), (qkvz_shape,), z),
        "in_proj_b": Rule((ba_name,), (ba_shape,), lambda w: ba(w, 0)),
        "in_proj_a": Rule((ba_name,), (ba_shape,), lambda w: ba(w, 1)),
    } | _gdn_common(cfg, p)


def _moe(cfg: ModelConfig, p: str, fused: bool) -> dict[str, Rule]:
    d, e, ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    rules = {"router": linear((d, e), p + "gate.weight")}
    if fused:
        gate_up, down = p + "experts.gate_up_proj", p + "experts.down_proj"
        rules |= {
            "gate_proj": Rule((gate_up,), ((e, 2 * ie, d),), lambda w: w[:, :ie].transpose(0, 2, 1)),
            "up_proj": Rule((gate_up,), ((e, 2 * ie, d),), lambda w: w[:, ie:].transpose(0, 2, 1)),
            "down_proj": Rule((down,), ((e, d, ie),), lambda w: w.transpose(0, 2, 1)),  # -> [E, Ie, D]
        }
    else:
        def stacked(proj: str, shape: tuple[int, int]) -> Rule:
            names = tuple(f"{p}experts.{j}.{proj}.weight" for j in range(e))
            return Rule(names, (shape,) * e, lambda *ws: array_module(ws[0]).stack([w.T for w in ws]))

        rules |= {
            "gate_proj": stacked("gate_proj", (ie, d)),
            "up_proj": stacked("up_proj", (ie, d)),
            "down_proj": stacked("down_proj", (d, ie)),
        }
    if cfg.shared_expert_intermediate_size:
        shared = dense_mlp(d, cfg.shared_expert_intermediate_size, p + "shared_expert.")
        rules |= {f"shared.{k}": r for k, r in shared.items()}
        rules["shared_gate"] = linear((d, 1), p + "shared_expert_gate.weight")
    return rules
