"""Mamba2 (SSD) mixer of the NemotronH / Bamba / Granite-4.0-H hybrids over state slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jhybrid.config import ModelConfig
from jhybrid.models.batch import Batch
from jhybrid.models.layers import conv_prefill_kernel, grouped_gated_rms_norm, grouped_rms_norm, short_conv
from jhybrid.models.quant import in_projection, linear, out_projection
from jhybrid.parallel.layout import num_shards, split_packed
from pallas_kernels import conv_update, simple_gla
from pallas_kernels.simple_gla import (chunk_mamba2, chunk_simple_gla, fused_recurrent_simple_gla, mamba2_decode,
                                       mamba2_norm_impl)


def mamba2_layer(
    cfg: ModelConfig,
    p: dict,
    x: Float[Array, "T D"],
    conv_state: Array,
    ssm_state: Array,
    batch: Batch,
    decode: bool,
    kernels: dict | None = None,
    io: dict | None = None,
) -> tuple[Float[Array, "T D"], Array, Array]:
    """in_proj -> [z | x B C | dt] -> causal conv (+ bias) + SiLU over x, B, C (conv state) ->
    dt = clip(softplus(dt + dt_bias), dt_min, dt_max), A = -exp(A_log) ->
    `S_t = exp(dt_t A) S_{t-1} + B_t^T (dt_t x_t)`, `y_t = C_t S_t + D x_t` (recurrent state `[S, Hm, N, P]`;
    head h reads B/C group `h // (Hm / G)`) -> grouped gated RMSNorm with z -> out_proj.

    HF clamps dt only in its chunked (prefill) path, not in its one-token update; jhybrid clamps in both so
    chunked prefill, one-shot prefill and decode compute one function (the clamp is inactive for any
    realistic dt_bias: `time_step_min` is 1e-3 by default). Returns (out, conv_state, ssm_state). `io`: as
    `gated_deltanet_layer`'s (the norm in the in_proj's kernel, the residual in the out_proj's; no biases).
    """
    kernels = kernels or {}
    num_tokens = x.shape[0]
    h, hp, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_n_groups, cfg.ssm_state_size
    inner, conv_dim = cfg.mamba_intermediate_size, cfg.mamba_conv_dim
    proj = in_projection(x, p["in_proj"], io)  # [T, Im + Cm + Hm]
    if "in_proj_bias" in p:
        proj = proj + p["in_proj_bias"]
    shards = num_shards(kernels.get("mesh"))  # packed shard-major under tensor parallelism
    if decode and shards == 1:
        y, conv_state, ssm_state = _decode_mixer(cfg, p, proj, conv_state, ssm_state, batch, kernels, x.dtype)
        y = grouped_rms_norm(y.reshape(num_tokens, inner), p["norm"], inner // g, cfg.mamba_norm_eps, x.dtype)
        out = out_projection(y, p["out_proj"], io)
        return (out + p["out_bias"] if "out_bias" in p else out), conv_state, ssm_state
    z, xbc, dt = split_packed(proj, (inner, conv_dim, h), shards)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))  # [T, Hm]
    dt = jnp.clip(dt, cfg.mamba_dt_min, cfg.mamba_dt_max)
    decay = dt * -jnp.exp(p["A_log"].astype(jnp.float32))  # [T, Hm], log space
    fused_norm = not decode and shards == 1 and mamba2_norm_impl(
        kernels.get("impl", "auto"), inner, inner // g, kernels.get("mesh")) == "pallas"
    operands = None if not fused_norm else simple_gla.mamba2_operands_dtype(  # the dtype, where the conv makes them
        kernels.get("impl", "auto"), (h, hp, g, n), x.dtype, kernels.get("mesh"))
    fused = None if shards != 1 else conv_prefill_kernel(  # the conv (+ bias) read from proj in place
        proj, conv_state, p["conv_weight"], batch, decode, kernels, offset=inner, bias=p.get("conv_bias"),
        **(dict(activation="silu", out_dtype=operands, splits=(inner, g * n, g * n), scale=dt, scale_group=hp)
           if operands is not None else {}))
    made = fused is not None and operands is not None  # SiLU(x), B, C and v = x dt from the conv kernel
    if made:
        (xbc, b, c, v), conv_state = fused  # xbc: SiLU(x) alone
    elif fused is not None:
        (xbc,), conv_state = fused
    else:
        xbc, conv_state = short_conv(xbc, conv_state, p["conv_weight"], batch, decode, kernels)
        if "conv_bias" in p:
            xbc = xbc + p["conv_bias"]
    if fused_norm:  # the scan, then the D skip, the gate and the norm in one kernel (x and z read in place)
        if made:
            o, ssm_state = simple_gla.chunk_mamba2_operands(
                c.reshape(num_tokens, g, n), b.reshape(num_tokens, g, n), v.reshape(num_tokens, h, hp), decay,
                batch.cu_seqlens, ssm_state, batch.slot_ids, **kernels)
        else:
            o, ssm_state = chunk_mamba2(xbc, dt, decay, None, batch.cu_seqlens, ssm_state, batch.slot_ids,
                                        dims=(h, hp, g, n), out_dtype=x.dtype, **kernels)
        y = simple_gla.mamba2_gated_norm_pallas(o, xbc, proj, p["D"], p["norm"], group_size=inner // g,
                                                eps=cfg.mamba_norm_eps, out_dtype=x.dtype, x_activated=made,
                                                interpret=kernels.get("interpret", False))
    elif not decode and shards == 1:  # SiLU, x / B / C, v = x dt, the D skip and the gate (z: proj's first columns)
        y, ssm_state = chunk_mamba2(xbc, dt, decay, p["D"], batch.cu_seqlens, ssm_state, batch.slot_ids, proj,
                                    dims=(h, hp, g, n), out_dtype=x.dtype, **kernels)
        y = grouped_rms_norm(y.reshape(num_tokens, inner), p["norm"], inner // g, cfg.mamba_norm_eps, x.dtype)
    else:
        xbc = jax.nn.silu(xbc.astype(jnp.float32))  # [T, Cm]
        xs, b, c = split_packed(xbc, (inner, g * n, g * n), shards)
        xs = xs.reshape(num_tokens, h, hp)  # [T, Hm, P]
        b = b.reshape(num_tokens, g, n)  # [T, G, N]: the keys
        c = c.reshape(num_tokens, g, n)  # [T, G, N]: the queries
        v = xs * dt[..., None]  # [T, Hm, P]
        if decode:
            y, ssm_state = fused_recurrent_simple_gla(c, b, v, decay, ssm_state, batch.slot_ids, scale=1.0,
                                                      **kernels)
        else:
            y, ssm_state = chunk_simple_gla(c, b, v, decay, batch.cu_seqlens, ssm_state, batch.slot_ids, scale=1.0,
                                            **kernels)
        y = y + xs * p["D"].astype(jnp.float32)[:, None]  # D skip
        y = grouped_gated_rms_norm(y.reshape(num_tokens, inner).astype(x.dtype), z, p["norm"], inner // g,
                                   cfg.mamba_norm_eps)
    out = linear(y, p["out_proj"])
    if "out_bias" in p:
        out = out + p["out_bias"]
    return out, conv_state, ssm_state


def _decode_mixer(cfg: ModelConfig, p: dict, proj: Array, conv_state: Array, ssm_state: Array, batch: Batch,
                  kernels: dict, dtype) -> tuple[Array, Array, Array]:
    """One device's decode step from the in_proj output `[z | xBC | dt]` to the gated norm's input (`y *
    silu(z)`, `[B, Hm, P]` fp32, y rounded to the activations' `dtype` first): the conv with its bias and SiLU (fp32
    out), then `simple_gla.mamba2_decode`. Where the kernels run they read their parts of `proj` in place, so no slice of the
    packed arrays becomes a kernel of its own; else the same computation in parts."""
    h, hp, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_n_groups, cfg.ssm_state_size
    inner, conv_dim, weight = cfg.mamba_intermediate_size, cfg.mamba_conv_dim, p["conv_weight"]
    impl = kernels.get("impl", "auto")
    form = dict(bias=p.get("conv_bias"), activation="silu", out_dtype=jnp.float32)
    if (inner % 16 == 0 and conv_update.pallas_supported(proj, weight)
            and conv_update.resolve(impl, proj, weight) == "pallas"):
        xbc, conv_state = conv_update.conv_update(proj, conv_state, weight, batch.slot_ids, offset=inner, **form,
                                                  impl="pallas", interpret=kernels.get("interpret", False))
    else:
        xbc, conv_state = short_conv(proj[:, inner : inner + conv_dim], conv_state, weight, batch, True, kernels)
        xbc = conv_update.finish(xbc, **form)
    y, ssm_state = mamba2_decode(xbc, proj, p["dt_bias"], p["A_log"], p["D"], ssm_state, batch.slot_ids,
                                 dims=(h, hp, g, n), dt_offset=inner + conv_dim,
                                 dt_range=(cfg.mamba_dt_min, cfg.mamba_dt_max), out_dtype=dtype, gated=True,
                                 **kernels)
    return y, conv_state, ssm_state
