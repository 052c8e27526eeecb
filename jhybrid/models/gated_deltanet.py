"""Gated DeltaNet layer (Qwen3-Next / Qwen3.5 linear attention) over state slots."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jhybrid.config import ModelConfig
from jhybrid.models.batch import Batch
from jhybrid.models.layers import conv_prefill_kernel, gated_rms_norm, l2_normalize, short_conv
from jhybrid.models.quant import in_projection, linear, out_projection
from jhybrid.parallel.layout import num_shards, split_packed
from pallas_kernels import chunk_gated_delta_rule, conv_update
from pallas_kernels import gated_delta_rule
from pallas_kernels.gated_delta_rule import gated_delta_decode, gated_delta_decode_packed

# where a prefill's q / k L2 norms happen. Off (the default): XLA normalises them first and the chunk kernels read
# the normalised copies as they are. JHYBRID_GDN_KERNEL_QK_NORM=1: the kernels normalise them as they load them
# (`qk_l2norm`), with no normalised copy written (qwen3_next's 8k prefill writes 2.4 GB less on the H200 compile,
# benchmarks/RESULTS.md session 33). That costs the sequential pass the registers of the fp32 round trip: the chunk
# kernels at T 32k took 1.440 ms that way against 1.250 with XLA's norm first, and the 8k prefill 71.5 against 68.6
# ms (session 48, H100).
KERNEL_QK_NORM = os.environ.get("JHYBRID_GDN_KERNEL_QK_NORM", "0") == "1"


def gated_deltanet_layer(
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
    """in_proj -> causal conv + SiLU (conv state) -> L2-normed q/k, beta = sigmoid(b),
    g = -exp(A_log) * softplus(a + dt_bias) -> gated delta rule (recurrent state) -> gated RMSNorm(z) ->
    out_proj. `decode` (static) means one token per row. Returns (out, conv_state, ssm_state). With `io` (a decode
    step: `jhybrid.models.hybrid._fused_io`) x is the layer's input before its norm, which the in_proj's kernel
    applies, and out already holds the residual added by the out_proj's kernel (`decode_linear`)."""
    num_tokens = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    c = cfg.conv_dim  # 2*HK*K + HV*V
    proj = in_projection(x, p["in_proj"], io)  # [T, C + HV*V + 2*HV]: the packed qkv, z, b, a projections
    shards = num_shards((kernels or {}).get("mesh"))  # packed shard-major under tensor parallelism
    if decode and shards == 1:
        o, conv_state, ssm_state = _decode_mixer(cfg, p, proj, conv_state, ssm_state, batch, kernels or {})
        return out_projection(o.reshape(num_tokens, hv * dv), p["out_proj"], io), conv_state, ssm_state
    qkv, z, b, a = split_packed(proj, (c, hv * dv, hv, hv), shards)  # [T, C] (shard-major), [T, HV*V], [T, HV] x2
    z = z.reshape(num_tokens, hv, dv)
    fused = None if shards != 1 else conv_prefill_kernel(  # q, k, v out of the conv kernel, read from proj in place
        proj, conv_state, p["conv_weight"], batch, decode, kernels, activation="silu", out_dtype=x.dtype,
        splits=(hk * dk, hk * dk, hv * dv))
    if fused is not None:
        (q, k, v), conv_state = fused
    else:
        qkv, conv_state = short_conv(qkv, conv_state, p["conv_weight"], batch, decode, kernels)
        qkv = jax.nn.silu(qkv.astype(jnp.float32)).astype(x.dtype)
        q, k, v = split_packed(qkv, (hk * dk, hk * dk, hv * dv), shards)
    q, k, v = q.reshape(num_tokens, hk, dk), k.reshape(num_tokens, hk, dk), v.reshape(num_tokens, hv, dv)
    if decode:  # the norms, gates, recurrence and output norm: one kernel where `FUSED_DECODE` (gated_delta_rule)
        o, ssm_state = gated_delta_decode(q, k, v, a, b, z, p["A_log"], p["dt_bias"], p["norm"], ssm_state,
                                          batch.slot_ids, eps=cfg.rms_norm_eps, **(kernels or {}))
        return linear(o.reshape(num_tokens, hv * dv), p["out_proj"]), conv_state, ssm_state
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    )
    # q and k L2-normalised in fp32 and fed as x.dtype: by XLA here, or by the kernels as they load them (no copy)
    if not KERNEL_QK_NORM:
        q, k = l2_normalize(q).astype(x.dtype), l2_normalize(k).astype(x.dtype)
    o, ssm_state = chunk_gated_delta_rule(q, k, v, g, beta, batch.cu_seqlens, ssm_state, batch.slot_ids,
                                          qk_l2norm=KERNEL_QK_NORM, **(kernels or {}))
    o = gated_rms_norm(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)  # [T, HV, V]
    out = linear(o.reshape(num_tokens, hv * dv), p["out_proj"])
    return out, conv_state, ssm_state


def _decode_mixer(cfg: ModelConfig, p: dict, proj: Array, conv_state: Array, ssm_state: Array, batch: Batch,
                  kernels: dict) -> tuple[Array, Array, Array]:
    """One device's decode step from the in_proj output to the gated-norm output `[B, HV, V]`: the conv with its
    SiLU, then `gated_delta_decode_packed`. The kernels read their parts of `proj` in place where they run (the
    conv kernel its first C columns; the fused decode kernel q, k, v from the conv's output and z, b, a from
    `proj`), so no slice of the packed arrays becomes a kernel of its own; else the same computation in parts. With
    `gated_delta_rule.CONV_DECODE` one kernel does both (`gated_delta_conv_decode_pallas`)."""
    dims = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    c, weight = cfg.conv_dim, p["conv_weight"]
    impl = kernels.get("impl", "auto")
    conv_pallas = conv_update.pallas_supported(proj, weight) and conv_update.resolve(impl, proj, weight) == "pallas"
    if conv_pallas and gated_delta_rule.conv_decode_applies(dims, weight.shape, proj.dtype, impl=impl):
        return gated_delta_rule.gated_delta_conv_decode_pallas(
            proj, conv_state, weight, p["A_log"], p["dt_bias"], p["norm"], ssm_state, batch.slot_ids, dims=dims,
            eps=cfg.rms_norm_eps, interpret=kernels.get("interpret", False))
    if conv_pallas:
        qkv, conv_state = conv_update.conv_update(proj, conv_state, weight, batch.slot_ids, activation="silu",
                                                  impl="pallas", interpret=kernels.get("interpret", False))
    else:
        qkv, conv_state = short_conv(proj[:, :c], conv_state, weight, batch, True, kernels)
        qkv = jax.nn.silu(qkv.astype(jnp.float32)).astype(proj.dtype)
    o, ssm_state = gated_delta_decode_packed(qkv, proj, p["A_log"], p["dt_bias"], p["norm"], ssm_state, batch.slot_ids,
                                             dims=dims, eps=cfg.rms_norm_eps, **kernels)
    return o, conv_state, ssm_state
