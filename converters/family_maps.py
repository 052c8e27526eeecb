"""Name maps of the lightning-attention and Mamba2 hybrid families (see name_maps.py for the transforms).

MiniMax (`save_pretrained` writes the hub layout): `model.layers.{i}.self_attn.*` (softmax attention:
q/k/v/o_proj; lightning: `qkv_proj [3*H*hd, D]` per head [q, k, v], `output_gate`, `norm`, `out_proj`),
`input_layernorm`, `post_attention_layernorm`, and the MoE under `block_sparse_moe.`: router `gate.weight
[E, D]`, experts one per expert `experts.{e}.w1` (gate) / `w3` (up) `[Ie, D]` and `w2` (down) `[D, Ie]`.
The fused in-memory layout (`mlp.experts.gate_up_proj`, `mlp.gate.weight`) is accepted too.

NemotronH (hub layout, `backbone.` read as `model.` by `normalize_name`): `model.embeddings`,
`model.norm_f`, and per block `model.layers.{i}.norm.weight` plus `mixer.*`: Mamba2 (`in_proj [Im + Cm + Hm,
D]`, `conv1d.weight [Cm, 1, Wm]` (+ `conv1d.bias`), `dt_bias`, `A_log`, `D`, `norm.weight [Im]`, `out_proj`),
attention (`q/k/v/o_proj`), relu^2 MLP (`up_proj`, `down_proj`) or MoE (`gate.weight`,
`gate.e_score_correction_bias`, experts one per expert `experts.{e}.up_proj/down_proj.weight` or fused
`experts.up_proj [E, Ie, D]` / `experts.down_proj [E, D, Ie]`, `shared_experts.up_proj/down_proj`). The
block's single norm is `input_norm` for a mixer block and `post_norm` for an MLP block.

Bamba: `model.embed_tokens`, `model.final_layernorm`, per layer `input_layernorm`, `pre_ff_layernorm`,
`mamba.*` (as NemotronH's Mamba2 mixer) or `self_attn.*`, and a SwiGLU `feed_forward.{gate,up,down}_proj`.

Granite-4.0-H (GraniteMoeHybrid; `save_pretrained` writes the hub layout): as Bamba for the embeddings,
`model.norm`, `input_layernorm`, `post_attention_layernorm`, `mamba.*` and `self_attn.*`; the MoE under
`block_sparse_moe.`: `router.layer.weight [E, D]`, fused experts `input_linear.weight [E, 2*Ie, D]` (gate rows,
then up rows) and `output_linear.weight [E, D, Ie]` (in-memory names `router.weight`, `experts.gate_up_proj`,
`experts.down_proj` accepted too); the shared MLP `shared_mlp.input_linear.weight [2*Is, D]` (gate, then up)
and `shared_mlp.output_linear.weight [D, Is]`, which is the whole MLP when the config has no experts.
"""

from __future__ import annotations

from converters.layer_maps import attention, dense_mlp, embed_and_head
from converters.plan import Plan, Rule, array_module, identity, linear
from jhybrid.config import ModelConfig


def _prefixed(prefix: str, rules: dict[str, Rule]) -> Plan:
    return {prefix + k: r for k, r in rules.items()}


def _lightning(cfg: ModelConfig, p: str) -> dict[str, Rule]:
    d, hd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return {
        "qkv_proj": linear((d, 3 * hd), p + "qkv_proj.weight"),
        "output_gate": linear((d, hd), p + "output_gate.weight"),
        "norm": identity((hd,), p + "norm.weight"),
        "out_proj": linear((hd, d), p + "out_proj.weight"),
    }


def _stacked(names: list[str], shape: tuple[int, int]) -> Rule:
    """Per-expert torch Linear weights `[out, in]` -> stacked `[E, in, out]`."""
    return Rule(tuple(names), (shape,) * len(names), lambda *ws: array_module(ws[0]).stack([w.T for w in ws]))


def _minimax_moe(cfg: ModelConfig, hf: str, disk: set[str]) -> dict[str, Rule]:
    d, e, ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if f"{hf}mlp.experts.gate_up_proj" in disk:  # fused (in-memory) layout
        gate_up, down = hf + "mlp.experts.gate_up_proj", hf + "mlp.experts.down_proj"
        return {
            "router": linear((d, e), hf + "mlp.gate.weight"),
            "gate_proj": Rule((gate_up,), ((e, 2 * ie, d),), lambda w: w[:, :ie].transpose(0, 2, 1)),
            "up_proj": Rule((gate_up,), ((e, 2 * ie, d),), lambda w: w[:, ie:].transpose(0, 2, 1)),
            "down_proj": Rule((down,), ((e, d, ie),), lambda w: w.transpose(0, 2, 1)),
        }
    p = hf + "block_sparse_moe."
    experts = [f"{p}experts.{j}." for j in range(e)]
    return {
        "router": linear((d, e), p + "gate.weight"),
        "gate_proj": _stacked([x + "w1.weight" for x in experts], (ie, d)),
        "up_proj": _stacked([x + "w3.weight" for x in experts], (ie, d)),
        "down_proj": _stacked([x + "w2.weight" for x in experts], (d, ie)),
    }


def minimax_plan(cfg: ModelConfig, disk: set[str]) -> Plan:
    d = cfg.hidden_size
    plan = embed_and_head(cfg)
    for i, kind in enumerate(cfg.layer_kinds):
        hf, jh = f"model.layers.{i}.", f"layers.{i}."
        plan[jh + "input_norm"] = identity((d,), hf + "input_layernorm.weight")
        plan[jh + "post_norm"] = identity((d,), hf + "post_attention_layernorm.weight")
        if kind == "full_attention":
            plan |= _prefixed(jh + "attn.", attention(cfg, hf + "self_attn."))
        else:
            plan |= _prefixed(jh + "lightning.", _lightning(cfg, hf + "self_attn."))
        plan |= _prefixed(jh + "mlp.", _minimax_moe(cfg, hf, disk))
    return plan


def _mamba2(cfg: ModelConfig, p: str) -> dict[str, Rule]:
    d, h, inner, conv = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_intermediate_size, cfg.mamba_conv_dim
    proj, w = inner + conv + h, cfg.mamba_conv_kernel
    rules = {
        "in_proj": linear((d, proj), p + "in_proj.weight"),
        "conv_weight": Rule((p + "conv1d.weight",), ((conv, 1, w),), lambda x: x[:, 0, :]),  # [C, 1, W] -> [C, W]
        "dt_bias": identity((h,), p + "dt_bias"),
        "A_log": identity((h,), p + "A_log"),
        "D": identity((h,), p + "D"),
        "norm": identity((inner,), p + "norm.weight"),
        "out_proj": linear((inner, d), p + "out_proj.weight"),
    }
    if cfg.mamba_conv_bias:
        rules["conv_bias"] = identity((conv,), p + "conv1d.bias")
    if cfg.mamba_proj_bias:
        rules |= {"in_proj_bias": identity((proj,), p + "in_proj.bias"), "out_bias": identity((d,), p + "out_proj.bias")}
    return rules


def _relu2_mlp(d: int, i: int, p: str, bias: bool) -> dict[str, Rule]:
    rules = {"up_proj": linear((d, i), p + "up_proj.weight"), "down_proj": linear((i, d), p + "down_proj.weight")}
    if bias:
        rules |= {"up_bias": identity((i,), p + "up_proj.bias"), "down_bias": identity((d,), p + "down_proj.bias")}
    return rules


def _nemotron_moe(cfg: ModelConfig, p: str, disk: set[str]) -> dict[str, Rule]:
    d, e, ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    rules = {"router": linear((d, e), p + "gate.weight"), "router_bias": identity((e,), p + "gate.e_score_correction_bias")}
    if p + "experts.up_proj" in disk:  # fused (in-memory) layout
        rules |= {
            "up_proj": Rule((p + "experts.up_proj",), ((e, ie, d),), lambda w: w.transpose(0, 2, 1)),
            "down_proj": Rule((p + "experts.down_proj",), ((e, d, ie),), lambda w: w.transpose(0, 2, 1)),
        }
    else:
        rules |= {
            "up_proj": _stacked([f"{p}experts.{j}.up_proj.weight" for j in range(e)], (ie, d)),
            "down_proj": _stacked([f"{p}experts.{j}.down_proj.weight" for j in range(e)], (d, ie)),
        }
    if cfg.shared_expert_intermediate_size:
        shared = _relu2_mlp(d, cfg.shared_expert_intermediate_size, p + "shared_experts.", cfg.mlp_bias)
        rules |= _prefixed("shared.", shared)
    return rules


def nemotron_h_plan(cfg: ModelConfig, disk: set[str]) -> Plan:
    d = cfg.hidden_size
    plan = embed_and_head(cfg, embed="model.embeddings.weight", norm="model.norm_f.weight")
    for i, (kind, mlp_kind) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds)):
        hf, jh = f"model.layers.{i}.", f"layers.{i}."
        norm = identity((d,), hf + "norm.weight")
        mixer = hf + "mixer."
        if kind == "mamba2":
            plan |= {jh + "input_norm": norm} | _prefixed(jh + "mamba.", _mamba2(cfg, mixer))
        elif kind == "full_attention":
            plan |= {jh + "input_norm": norm} | _prefixed(jh + "attn.", attention(cfg, mixer))
        elif mlp_kind == "dense":
            plan |= {jh + "post_norm": norm} | _prefixed(jh + "mlp.", _relu2_mlp(d, cfg.intermediate_size, mixer, cfg.mlp_bias))
        else:
            plan |= {jh + "post_norm": norm} | _prefixed(jh + "mlp.", _nemotron_moe(cfg, mixer, disk))
    return plan


def bamba_plan(cfg: ModelConfig, disk: set[str]) -> Plan:
    d = cfg.hidden_size
    plan = embed_and_head(cfg, norm="model.final_layernorm.weight")
    for i, kind in enumerate(cfg.layer_kinds):
        hf, jh = f"model.layers.{i}.", f"layers.{i}."
        plan[jh + "input_norm"] = identity((d,), hf + "input_layernorm.weight")
        plan[jh + "post_norm"] = identity((d,), hf + "pre_ff_layernorm.weight")
        if kind == "full_attention":
            plan |= _prefixed(jh + "attn.", attention(cfg, hf + "self_attn."))
        else:
            plan |= _prefixed(jh + "mamba.", _mamba2(cfg, hf + "mamba."))
        plan |= _prefixed(jh + "mlp.", dense_mlp(d, cfg.intermediate_size, hf + "feed_forward.", cfg.mlp_bias))
    return plan


def _granite_shared(d: int, i: int, p: str) -> dict[str, Rule]:
    """`input_linear [2I, D]` (gate rows, then up rows) and `output_linear [D, I]` -> a SwiGLU MLP."""
    gate_up = p + "input_linear.weight"
    return {
        "gate_proj": Rule((gate_up,), ((2 * i, d),), lambda w: w[:i].T),
        "up_proj": Rule((gate_up,), ((2 * i, d),), lambda w: w[i:].T),
        "down_proj": linear((i, d), p + "output_linear.weight"),
    }


def _granite_moe(cfg: ModelConfig, p: str, disk: set[str]) -> dict[str, Rule]:
    d, e, ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if p + "experts.gate_up_proj" in disk:  # fused in-memory names
        router, gate_up, down = p + "router.weight", p + "experts.gate_up_proj", p + "experts.down_proj"
    else:  # hub names
        router, gate_up, down = p + "router.layer.weight", p + "input_linear.weight", p + "output_linear.weight"
    return {
        "router": linear((d, e), router),
        "gate_proj": Rule((gate_up,), ((e, 2 * ie, d),), lambda w: w[:, :ie].transpose(0, 2, 1)),  # -> [E, D, Ie]
        "up_proj": Rule((gate_up,), ((e, 2 * ie, d),), lambda w: w[:, ie:].transpose(0, 2, 1)),
        "down_proj": Rule((down,), ((e, d, ie),), lambda w: w.transpose(0, 2, 1)),  # -> [E, Ie, D]
    }


def granitemoehybrid_plan(cfg: ModelConfig, disk: set[str]) -> Plan:
    d = cfg.hidden_size
    plan = embed_and_head(cfg)
    for i, (kind, mlp_kind) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds)):
        hf, jh = f"model.layers.{i}.", f"layers.{i}."
        plan[jh + "input_norm"] = identity((d,), hf + "input_layernorm.weight")
        plan[jh + "post_norm"] = identity((d,), hf + "post_attention_layernorm.weight")
        if kind == "full_attention":
            plan |= _prefixed(jh + "attn.", attention(cfg, hf + "self_attn."))
        else:
            plan |= _prefixed(jh + "mamba.", _mamba2(cfg, hf + "mamba."))
        if mlp_kind == "moe":
            plan |= _prefixed(jh + "mlp.", _granite_moe(cfg, hf + "block_sparse_moe.", disk))
            if cfg.shared_expert_intermediate_size:
                shared = _granite_shared(d, cfg.shared_expert_intermediate_size, hf + "shared_mlp.")
                plan |= _prefixed(jh + "mlp.shared.", shared)
        else:
            plan |= _prefixed(jh + "mlp.", _granite_shared(d, cfg.intermediate_size, hf + "shared_mlp."))
    return plan


FAMILY_PLANS = {
    "minimax": minimax_plan,
    "nemotron_h": nemotron_h_plan,
    "bamba": bamba_plan,
    "granitemoehybrid": granitemoehybrid_plan,
}
