"""The hybrid decoder: embeddings, a stack of layers (a mixer — full attention, Gated DeltaNet, lightning
attention or Mamba2 — and an MLP, either of which may be absent), the LM head.

`forward(cfg, params, state, batch, decode=..., all_logits=...)` is a pure function of its arguments:
it returns logits and the new state pytree. Which layer is which comes from `cfg.layer_kinds` and
`cfg.mlp_kinds`; linear layer j (in order, whatever its kind) owns `state.conv[j]` and `state.ssm[j]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jhybrid.cache.state import HybridState
from jhybrid.config import ModelConfig
from jhybrid.models.attention import attention_layer
from jhybrid.models.batch import Batch
from jhybrid.models.gated_deltanet import gated_deltanet_layer
from jhybrid.models.layers import dense_mlp, moe, rms_norm, rope_inv_freq
from jhybrid.models.lightning import lightning_attention_layer
from jhybrid.models.mamba2 import mamba2_layer
from jhybrid.models.params import is_packed
from jhybrid.parallel.layout import num_shards


def forward(
    cfg: ModelConfig,
    params: dict,
    state: HybridState,
    batch: Batch,
    *,
    decode: bool = False,
    all_logits: bool = False,
    return_hidden: bool = False,
    kernel_impl: str = "auto",
    interpret: bool = False,
    mesh=None,
    host_attention=None,
) -> tuple[Float[Array, "B V"] | Float[Array, "T V"], HybridState]:
    """Runs one step over a ragged batch.

    Args:
      cfg: the model config (static).
      params: the parameter pytree (`jhybrid.models.params`).
      state: KV pages and state slots; the rows' slots and blocks are read and updated.
      batch: packed tokens and their metadata (`jhybrid.models.batch.Batch`).
      decode: every row has exactly one token (selects the decode forms of the kernels).
      all_logits: return logits for every packed token `[T, V]` instead of each row's last `[B, V]`.
      return_hidden: return every packed token's final hidden state `[T, D]` (before the final norm; `lm_head`
        turns it into logits) instead of logits, for a caller that needs logits at many positions.
      kernel_impl: the kernels' `impl` ("auto": Pallas on GPU where supported, the references on CPU;
        "reference"; "pallas"), with `interpret` to run Pallas in interpret mode (CPU tests).
      mesh: the tensor-parallel mesh (`jhybrid.parallel`) when the parameters are sharded over several
        devices (their packed projections then shard-major); the Pallas kernels then run per shard.
      host_attention: offloaded attention (`jhybrid.engine.offload.HostPart`): rows with KV blocks in the
        host tier; full layer i attends in two parts merged by LSE (`attention_layer`'s `host`).

    Returns:
      fp32 logits and the updated state.
    """
    if not is_packed(params):
        raise ValueError("forward runs on packed parameters: call jhybrid.models.params.pack_params(params) once")
    kernels = (("impl", kernel_impl), ("interpret", interpret), ("mesh", mesh))
    shards = num_shards(mesh)
    x = embed(cfg, params, batch)  # [T, D]
    inv_freq = rope_inv_freq(cfg) if cfg.num_full_layers else None
    k_pages, v_pages = list(state.k_pages), list(state.v_pages)
    conv, ssm = list(state.conv), list(state.ssm)
    i_full = i_lin = 0
    for i, (kind, mlp_kind, p) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds, params["layers"])):
        if kind == "full_attention":
            host = None if host_attention is None else host_attention.layer(i_full)
            run = _layer if host is None else _layer.__wrapped__  # offloaded attention: traced per layer
            x, (k_pages[i_full], v_pages[i_full]) = run(
                cfg, kind, mlp_kind, None, p, x, (k_pages[i_full], v_pages[i_full]), batch, inv_freq,
                decode, kernels, shards, host)
            i_full += 1
        elif kind != "none":
            # the slope of a lightning layer depends on its index; other kinds trace once for all layers
            index = i if kind == "lightning_attention" else None
            x, (conv[i_lin], ssm[i_lin]) = _layer(cfg, kind, mlp_kind, index, p, x, (conv[i_lin], ssm[i_lin]),
                                                  batch, inv_freq, decode, kernels, shards)
            i_lin += 1
        else:
            x = mlp_block(cfg, mlp_kind, p, x, shards, dict(kernels), num_real=batch.cu_seqlens[-1], decode=decode)
    new_state = dataclasses.replace(state, k_pages=tuple(k_pages), v_pages=tuple(v_pages), conv=tuple(conv), ssm=tuple(ssm))
    if return_hidden:
        return x, new_state
    if not all_logits:
        x = x[batch.logits_index]  # [B, D]
    return lm_head(cfg, params, x), new_state


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 9, 10, 11, 12))
def _layer(cfg: ModelConfig, kind: str, mlp_kind: str, index: int | None, p: dict, x: Float[Array, "T D"],
           cache: tuple[Array, Array], batch: Batch, inv_freq, decode: bool, kernels: tuple, shards: int,
           host=None) -> tuple[Float[Array, "T D"], tuple[Array, Array]]:
    """One layer: norm, mixer (its cache: KV pages `(k, v)` for full attention, `(conv, ssm)` slots for the
    linear kinds), residual, then the MLP block. Jitted (XLA inlines it into the step), so the model's
    repeated layers are traced and lowered once per (kind, shapes) rather than once per layer."""
    kernels = dict(kernels)
    io = _fused_io(cfg, kind, p, x, kernels) if decode and host is None else None
    if io is not None:  # the mixer's in_proj takes the norm, its out_proj the residual (`decode_linear`)
        if kind == "full_attention":
            x, *cache = attention_layer(cfg, p["attn"], x, *cache, batch, inv_freq, decode, kernels, io=io)
        else:
            x, *cache = _linear_mixer(cfg, kind, p, x, *cache, batch, index, decode, kernels, io=io)
        cache = tuple(cache)
        return mlp_block(cfg, mlp_kind, p, x, shards, kernels, num_real=batch.cu_seqlens[-1], decode=decode), cache
    normed = rms_norm(x, p["input_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
    if kind == "full_attention":
        h, k, v = attention_layer(cfg, p["attn"], normed, *cache, batch, inv_freq, decode, kernels, host=host)
        cache, alpha, beta = (k, v), cfg.full_attn_alpha, cfg.full_attn_beta
    else:
        h, conv, ssm = _linear_mixer(cfg, kind, p, normed, *cache, batch, index, decode, kernels)
        cache, alpha, beta = (conv, ssm), cfg.linear_attn_alpha, cfg.linear_attn_beta
    x = _residual(normed if cfg.residual_from_norm else x, h, alpha, beta)
    return mlp_block(cfg, mlp_kind, p, x, shards, kernels, num_real=batch.cu_seqlens[-1], decode=decode), cache


def embed(cfg: ModelConfig, params: dict, batch: Batch) -> Float[Array, "T D"]:
    x = params["embed"][batch.token_ids]  # [T, D]
    if cfg.embedding_multiplier != 1.0:  # Granite
        x = x * cfg.embedding_multiplier
    return x


def lm_head(cfg: ModelConfig, params: dict, x: Float[Array, "B D"]) -> Float[Array, "B V"]:
    """Final norm and the LM head: fp32 logits."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = (x @ head).astype(jnp.float32)
    if cfg.logits_scaling != 1.0:  # Granite divides its logits
        logits = logits / cfg.logits_scaling
    return logits


def mlp_block(cfg: ModelConfig, mlp_kind: str, p: dict, x: Float[Array, "T D"], shards: int = 1,
              kernels: dict | None = None, num_real: Array | None = None, decode: bool = False) -> Float[Array, "T D"]:
    """A layer's MLP (dense or MoE) with its norm and residual; `x` unchanged for kind "none". `kernels`: the
    forward's kernel options (the MoE layer's routed experts take them). `num_real` (a traced count): the tokens
    from it on are a bucket's padding, which the MoE layer routes to no expert (their outputs are not used). In a
    decode step a plain dense block may run as two kernels (`pallas_kernels.decode_linear.decode_mlp`, where it
    resolves to them: `DECODE_MLP`)."""
    if mlp_kind == "none":
        return x
    if decode and mlp_kind == "dense" and shards == 1:
        fused = _decode_mlp(cfg, p, x, kernels or {})
        if fused is not None:
            return fused
    normed = rms_norm(x, p["post_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
    if mlp_kind == "moe":
        h = moe(p["mlp"], normed, cfg.num_experts_per_tok, cfg.norm_topk_prob, act=cfg.mlp_act, kernels=kernels,
                router=cfg.moe_router, n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
                scaling=cfg.routed_scaling_factor, num_shards=shards, num_real=num_real)
    else:
        h = dense_mlp(p["mlp"], normed, cfg.mlp_act, shards)
    return _residual(normed if cfg.residual_from_norm else x, h, cfg.mlp_alpha, cfg.mlp_beta)


def _decode_mlp(cfg: ModelConfig, p: dict, x: Array, kernels: dict) -> Array | None:
    """`mlp_block` of a plain dense layer (no biases, FP8 weights, scaled residual or residual from the norm) as
    `decode_mlp`'s two kernels, or None where they do not run."""
    from pallas_kernels import decode_linear

    mlp, act = p["mlp"], cfg.mlp_act
    w_in = mlp.get("gate_up_proj" if act == "silu" else "up_proj")
    if (w_in is None or cfg.residual_from_norm or cfg.mlp_alpha != 1.0 or cfg.mlp_beta != 1.0
            or any(k.endswith("bias") for k in mlp)
            or not decode_linear.mlp_supported(x, w_in, mlp["down_proj"], act)):  # (plain weights only: no FP8)
        return None
    applies = decode_linear.resolve(kernels.get("impl", "auto"), decode_linear.DECODE_MLP, True, "decode MLP")
    if applies != "pallas":
        return None
    return decode_linear.decode_mlp(x, p["post_norm"], w_in, mlp["down_proj"], eps=cfg.rms_norm_eps,
                                    zero_centred=cfg.norm_zero_centred, act=act, impl="pallas",
                                    interpret=kernels.get("interpret", False))


def _residual(r: Array, h: Array, alpha: float, beta: float) -> Array:
    """`alpha * r + beta * h` (multiplications by 1 skipped: most families use plain `r + h`)."""
    r = r if alpha == 1.0 else r * alpha
    h = h if beta == 1.0 else h * beta
    return r + h


# each mixer's parameters and the names of its in and out projections
_MIXERS = {"linear_attention": ("gdn", "in_proj", "out_proj"),
           "lightning_attention": ("lightning", "in_proj", "out_proj"),
           "mamba2": ("mamba", "in_proj", "out_proj"), "full_attention": ("attn", "qkv_proj", "o_proj")}


def _fused_io(cfg: ModelConfig, kind: str, p: dict, x: Array, kernels: dict) -> dict | None:
    """For a decode step's mixer whose in and out projections `decode_linear` runs (`DECODE_LINEAR` or impl
    "pallas"; plain weights, no biases, a plain residual `x + h`, one device): the `io` its layer function takes
    (the input norm fused into its in projection, the residual into its out projection). Else None."""
    from pallas_kernels import decode_linear

    name, in_name, out_name = _MIXERS.get(kind, ("", "", ""))
    mixer = p.get(name)
    full = kind == "full_attention"
    alpha, beta = (cfg.full_attn_alpha, cfg.full_attn_beta) if full else (cfg.linear_attn_alpha, cfg.linear_attn_beta)
    if (mixer is None or in_name not in mixer or kernels.get("mesh") is not None or cfg.residual_from_norm
            or alpha != 1.0 or beta != 1.0 or {"in_proj_bias", "out_bias"} & set(mixer)
            or (full and cfg.attention_bias)):
        return None
    w_in, w_out = mixer[in_name], mixer[out_name]
    out_rows = jax.ShapeDtypeStruct((x.shape[0], w_out.shape[0]), x.dtype)
    if not (decode_linear.linear_supported(x, w_in) and decode_linear.linear_supported(out_rows, w_out)):
        return None
    impl = kernels.get("impl", "auto")
    if decode_linear.resolve(impl, decode_linear.DECODE_LINEAR, True, "decode linear") != "pallas":
        return None
    return dict(norm_w=p["input_norm"], eps=cfg.rms_norm_eps, zero_centred=cfg.norm_zero_centred, residual=x,
                interpret=kernels.get("interpret", False))


def _linear_mixer(cfg, kind, p, x, conv, ssm, batch, layer_index, decode, kernels, io: dict | None = None):
    """Runs a state-slot mixer; returns (out, conv, ssm). Lightning attention has no conv (its conv state
    is a `[S, 1, 1]` placeholder and passes through). With `io` (`_fused_io`) x is the layer's input before its norm,
    and out the residual stream after the mixer."""
    if kind == "linear_attention":
        return gated_deltanet_layer(cfg, p["gdn"], x, conv, ssm, batch, decode, kernels, io=io)
    if kind == "lightning_attention":
        h, ssm = lightning_attention_layer(cfg, p["lightning"], x, ssm, batch, layer_index, decode, kernels, io=io)
        return h, conv, ssm
    if kind == "mamba2":
        return mamba2_layer(cfg, p["mamba"], x, conv, ssm, batch, decode, kernels, io=io)
    raise ValueError(f"layer {layer_index}: no model code for layer kind {kind!r}")
