"""The parameter pytree: its layout, shapes, and random initialisation.

Layout (every matrix is stored `[in, out]`, so `x @ w` applies it):

    embed                      [V, D]
    final_norm                 [D]
    lm_head                    [D, V]          absent when the embeddings are tied
    layers: tuple, one dict per layer:
      input_norm [D]           before the mixer (absent when the layer has none)
      post_norm [D]            before the MLP (absent when the layer has none)
      attn (full layers):      q_proj [D, H*hd*(2 if gated)]  per head: hd query dims then hd gate dims
                               k_proj, v_proj [D, KVH*hd]; o_proj [H*hd, D]
                               q_norm, k_norm [hd] (qk_norm); q_bias/k_bias/v_bias/o_bias (attention_bias)
      gdn (linear layers):     in_proj_qkv [D, 2*HK*K + HV*V]   q (HK heads), k (HK heads), v (HV heads)
                               in_proj_z [D, HV*V]; in_proj_b, in_proj_a [D, HV]
                               conv_weight [C, W] (C = conv_dim, W = conv kernel), dt_bias [HV], A_log [HV],
                               norm [V], out_proj [HV*V, D]
      lightning (lightning):   qkv_proj [D, 3*H*hd]  per head: hd q dims, hd k dims, hd v dims
                               output_gate [D, H*hd]; norm [H*hd]; out_proj [H*hd, D]
      mamba (mamba2):          in_proj [D, Im + Cm + Hm]  z (Im = Hm*P), then x|B|C (Cm = Im + 2*G*N), then dt
                               (in_proj_bias [Im + Cm + Hm] with mamba_proj_bias); conv_weight [Cm, Wm]
                               (conv_bias [Cm] with mamba_conv_bias); dt_bias, A_log, D [Hm]; norm [Im];
                               out_proj [Im, D] (out_bias [D] with mamba_proj_bias)
      mlp (dense, silu):       gate_proj, up_proj [D, I]; down_proj [I, D]
      mlp (dense, relu2):      up_proj [D, I]; down_proj [I, D]
      mlp (moe):               router [D, E]; gate_proj, up_proj [E, D, Ie]; down_proj [E, Ie, D]
                               shared: {gate_proj, up_proj [D, Is], down_proj [Is, D]}, shared_gate [D, 1]
                               (relu2 experts: no gate_proj; sigmoid_group routing: router_bias [E])

Letters: D hidden, V vocab (in `embed`) or value head dim (in gdn), H/KVH query/kv heads, hd head dim,
HK/HV linear key/value heads, K key head dim, E experts, I intermediate sizes; Mamba2: Hm heads of dim P,
G groups, N state size, Wm conv width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.config import ModelConfig

Params = dict[str, Any]


def _attn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_out = h * hd * (2 if cfg.attn_output_gate else 1)
    shapes = {"q_proj": (d, q_out), "k_proj": (d, kvh * hd), "v_proj": (d, kvh * hd), "o_proj": (h * hd, d)}
    if cfg.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    if cfg.attention_bias:
        shapes |= {"q_bias": (q_out,), "k_bias": (kvh * hd,), "v_bias": (kvh * hd,), "o_bias": (d,)}
    return shapes


def _gdn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv": (d, cfg.conv_dim),
        "in_proj_z": (d, cfg.linear_value_dim),
        "in_proj_b": (d, hv),
        "in_proj_a": (d, hv),
        "conv_weight": (cfg.conv_dim, cfg.linear_conv_kernel),
        "dt_bias": (hv,),
        "A_log": (hv,),
        "norm": (cfg.linear_value_head_dim,),
        "out_proj": (cfg.linear_value_dim, d),
    }


def _lightning_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return {"qkv_proj": (d, 3 * hd), "output_gate": (d, hd), "norm": (hd,), "out_proj": (hd, d)}


def _mamba_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, h, inner, conv = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_intermediate_size, cfg.mamba_conv_dim
    proj = inner + conv + h
    shapes = {"in_proj": (d, proj), "conv_weight": (conv, cfg.mamba_conv_kernel)}
    if cfg.mamba_conv_bias:
        shapes["conv_bias"] = (conv,)
    shapes |= {"dt_bias": (h,), "A_log": (h,), "D": (h,), "norm": (inner,), "out_proj": (inner, d)}
    if cfg.mamba_proj_bias:
        shapes |= {"in_proj_bias": (proj,), "out_bias": (d,)}
    return shapes


def _dense_mlp_shapes(d: int, i: int, bias: bool = False, gated: bool = True) -> dict[str, tuple[int, ...]]:
    shapes = {"gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)} if gated else {"up_proj": (d, i), "down_proj": (i, d)}
    if bias:
        shapes |= {"gate_bias": (i,), "up_bias": (i,), "down_bias": (d,)} if gated else {"up_bias": (i,), "down_bias": (d,)}
    return shapes


def _moe_shapes(cfg: ModelConfig) -> dict[str, Any]:
    d, e, ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gated = cfg.mlp_act == "silu"
    shapes: dict[str, Any] = {"router": (d, e)}
    if cfg.moe_router == "sigmoid_group":
        shapes["router_bias"] = (e,)  # added to the scores for expert choice only (HF e_score_correction_bias)
    if gated:
        shapes |= {"gate_proj": (e, d, ie)}
    shapes |= {"up_proj": (e, d, ie), "down_proj": (e, ie, d)}
    if cfg.shared_expert_intermediate_size:
        shapes["shared"] = _dense_mlp_shapes(d, cfg.shared_expert_intermediate_size, cfg.mlp_bias, gated)
        if cfg.shared_expert_gate:
            shapes["shared_gate"] = (d, 1)
    return shapes


# layer kind -> (the layer dict's key for the mixer's parameters, their shapes)
MIXER_PARAMS = {
    "full_attention": ("attn", _attn_shapes),
    "linear_attention": ("gdn", _gdn_shapes),
    "lightning_attention": ("lightning", _lightning_shapes),
    "mamba2": ("mamba", _mamba_shapes),
}


def param_shapes(cfg: ModelConfig) -> Params:
    """The expected shape of every parameter, as a pytree of tuples mirroring the parameter pytree."""
    layers = []
    for kind, mlp_kind in zip(cfg.layer_kinds, cfg.mlp_kinds):
        layer: dict[str, Any] = {}
        if kind != "none":
            layer["input_norm"] = (cfg.hidden_size,)
            key, shapes = MIXER_PARAMS[kind]
            layer[key] = shapes(cfg)
        if mlp_kind != "none":
            layer["post_norm"] = (cfg.hidden_size,)
        if mlp_kind == "moe":
            layer["mlp"] = _moe_shapes(cfg)
        elif mlp_kind == "dense":
            layer["mlp"] = _dense_mlp_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.mlp_act == "silu")
        layers.append(layer)
    shapes: Params = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "final_norm": (cfg.hidden_size,),
        "layers": tuple(layers),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def flatten_shapes(shapes: Params, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """`{"layers.0.attn.q_proj": (D, ...), ...}`: dotted names for messages and checkpoints."""
    out: dict[str, tuple[int, ...]] = {}
    items = shapes.items() if isinstance(shapes, dict) else enumerate(shapes)
    for key, value in items:
        name = f"{prefix}{key}"
        if is_shape(value):
            out[name] = value
        else:
            out.update(flatten_shapes(value, name + "."))
    return out


def unflatten(flat: dict[str, Any], cfg: ModelConfig) -> Params:
    """Inverse of `flatten_shapes` for arrays, using the config's layout to rebuild tuples."""
    return unflatten_shapes(flat, param_shapes(cfg))


def unflatten_shapes(flat: dict[str, Any], shapes: Any, prefix: str = "") -> Any:
    """`flat` (dotted names relative to `shapes`, a pytree of shape tuples such as one layer of `param_shapes`)
    rebuilt in the structure of `shapes`. (Plain recursion: a recursive closure would be a reference cycle holding
    `flat`, whose arrays then outlive the call until the garbage collector runs.)"""
    if is_shape(shapes):
        return flat[prefix[:-1]]
    if isinstance(shapes, dict):
        return {k: unflatten_shapes(flat, v, f"{prefix}{k}.") for k, v in shapes.items()}
    return tuple(unflatten_shapes(flat, v, f"{prefix}{i}.") for i, v in enumerate(shapes))


def flatten_params(params: Params) -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = params.items() if isinstance(params, dict) else enumerate(params)
    for key, value in items:
        if isinstance(value, (dict, tuple, list)):
            out.update({f"{key}.{k}": v for k, v in flatten_params(value).items()})
        else:
            out[str(key)] = value
    return out


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, scale: float = 0.1) -> Params:
    """Random parameters (every weight randomised, norms included): for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in flatten_shapes(param_shapes(cfg)).items():
        if name.endswith("A_log"):
            value = np.log(rng.uniform(0.5, 4.0, shape))
        elif name.endswith("dt_bias"):
            value = rng.uniform(-1.0, 1.0, shape)
        elif name.endswith("norm"):
            centred = cfg.norm_zero_centred and not name.endswith(("gdn.norm", "lightning.norm", "mamba.norm"))
            value = rng.normal(0.0, 0.2, shape) + (0.0 if centred else 1.0)
        else:
            value = rng.normal(0.0, scale, shape)
        flat[name] = jnp.asarray(value, dtype=dtype)
    return unflatten(flat, cfg)


def count_params(params: Params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------- runtime layout
# The model runs on *packed* parameters: projections that read the same input are concatenated along
# their output dim so one matmul replaces several (at decode, each is a weight-bandwidth-bound GEMV,
# and fewer, larger ones waste less launch time and bandwidth):
#   gdn.in_proj        = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]      [D, C + HV*V + 2*HV]
#   lightning.in_proj  = [qkv_proj | output_gate]                               [D, 4*H*hd]
#   attn.qkv_proj      = [q_proj | k_proj | v_proj]  (qkv_bias likewise)        [D, Q + 2*KVH*hd]
#   mlp.gate_up_proj   = [gate_proj | up_proj]       (gate_up_bias likewise)    [D, 2I]   ([E, D, 2Ie] for experts)
# Checkpoints keep the separate (HF-like) layout of `param_shapes`; `pack_params` converts once at load.

_PACKS = {
    "gdn": (("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),),
    "lightning": (("in_proj", ("qkv_proj", "output_gate")),),
    "attn": (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("qkv_bias", ("q_bias", "k_bias", "v_bias"))),
    "mlp": (("gate_up_proj", ("gate_proj", "up_proj")), ("gate_up_bias", ("gate_bias", "up_bias"))),
}


def _pack_dict(p: dict, packs) -> dict:
    out = dict(p)
    for fused, parts in packs:
        if all(part in out for part in parts):
            out[fused] = jnp.concatenate([out.pop(part) for part in parts], axis=-1)
    return out


def pack_params(params: Params) -> Params:
    """Canonical (checkpoint) layout -> the packed runtime layout the model runs on. Idempotent."""
    return {**params, "layers": tuple(pack_layer(layer) for layer in params["layers"])}


def pack_layer(layer: dict) -> dict:
    """One layer of `pack_params`."""
    layer = dict(layer)
    for key, packs in _PACKS.items():
        if key in layer:
            layer[key] = _pack_dict(layer[key], packs)
    if "shared" in layer.get("mlp", {}):
        layer["mlp"]["shared"] = _pack_dict(layer["mlp"]["shared"], _PACKS["mlp"])
    return layer


def is_packed(params: Params) -> bool:
    """Whether no group of projections that `pack_params` fuses is still stored separately."""

    def unpacked(p: dict, packs) -> bool:
        return any(all(part in p for part in parts) for _, parts in packs)

    for layer in params["layers"]:
        for key, packs in _PACKS.items():
            if key in layer and unpacked(layer[key], packs):
                return False
        if "shared" in layer.get("mlp", {}) and unpacked(layer["mlp"]["shared"], _PACKS["mlp"]):
            return False
    return True
