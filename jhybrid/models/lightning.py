"""MiniMax lightning attention (linear attention with a fixed per-head decay) over state slots."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jhybrid.config import LIGHTNING_NORM_EPS, ModelConfig
from jhybrid.models.batch import Batch
from jhybrid.models.layers import rms_norm
from jhybrid.models.quant import in_projection, linear, out_projection
from jhybrid.parallel.layout import num_shards, split_packed
from pallas_kernels.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla, lightning_decode

# A decode step's output norm with its per-row scale applied after out_proj (the norm's rsqrt commutes with the
# matmul), so that XLA can fuse the weight and the sigmoid gate into the projection's GEMM and the scale into its
# epilogue, leaving only the sum of squares as a kernel of its own. Off until timed (JHYBRID_LIGHTNING_SCALE_AFTER=1).
SCALE_AFTER_PROJ = os.environ.get("JHYBRID_LIGHTNING_SCALE_AFTER", "0") == "1"


def lightning_slopes(num_heads: int, layer_index: int, num_layers: int) -> np.ndarray:
    """Per-head decay rates `[H]` (fp32), as HF `MiniMaxLightningAttention.get_slope_rate`:
    `base^(h+1) * (1 - i / (L - 1 + 1e-5) + 1e-5)` with `base = 2^(-8/H)`; layer i of L decays slower the
    deeper it sits (the last layer barely decays at all)."""
    base = np.float32(1 / (2 ** (8 / num_heads)))
    rate = base ** np.arange(1, num_heads + 1, dtype=np.float32)
    factor = 1 - layer_index / (num_layers - 1 + 1e-5) + 1e-5
    return (rate * np.float32(factor)).astype(np.float32)


def lightning_attention_layer(
    cfg: ModelConfig,
    p: dict,
    x: Float[Array, "T D"],
    ssm_state: Array,
    batch: Batch,
    layer_index: int,
    decode: bool,
    kernels: dict | None = None,
    io: dict | None = None,
) -> tuple[Float[Array, "T D"], Array]:
    """in_proj -> SiLU on q, k, v (no 1/sqrt(d), no RoPE) -> `S_t = exp(-slope) S_{t-1} + k_t^T v_t`,
    `o_t = q_t S_t` (recurrent state `[S, H, hd, hd]`) -> RMSNorm over all heads -> sigmoid output gate ->
    out_proj. `decode` (static) means one token per row. Returns (out, ssm_state). `io`: as
    `gated_deltanet_layer`'s (the norm in the in_proj's kernel, the residual in the out_proj's)."""
    num_tokens = x.shape[0]
    h, hd = cfg.num_heads, cfg.head_dim
    proj = in_projection(x, p["in_proj"], io)  # [T, 4*H*hd]: the packed qkv_proj, output_gate
    shards = num_shards((kernels or {}).get("mesh"))
    qkv, gate = split_packed(proj, (3 * h * hd, h * hd), shards)  # [T, 3*H*hd], [T, H*hd]
    slopes = lightning_slopes(h, layer_index, cfg.num_layers)
    if decode and shards == 1:  # the SiLU, the split and the recurrence: one kernel where it runs
        o, ssm_state = lightning_decode(proj, jnp.asarray(slopes), ssm_state, batch.slot_ids, num_heads=h, head_dim=hd,
                                        **(kernels or {}))
        if SCALE_AFTER_PROJ and io is None:
            return _output_scaled_after(p, o, gate, x.dtype), ssm_state
        return _output(cfg, p, o, gate, x.dtype, io), ssm_state
    qkv = jax.nn.silu(qkv.astype(jnp.float32)).astype(x.dtype)
    qkv = qkv.reshape(num_tokens, h, 3, hd)  # per head: hd q dims, hd k dims, hd v dims
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [T, H, hd] x3
    g = jnp.broadcast_to(jnp.asarray(-slopes), (num_tokens, h))  # [T, H], constant in time
    if decode:
        o, ssm_state = fused_recurrent_simple_gla(q, k, v, g, ssm_state, batch.slot_ids, scale=1.0, **(kernels or {}))
    else:
        o, ssm_state = chunk_simple_gla(
            q, k, v, g, batch.cu_seqlens, ssm_state, batch.slot_ids, scale=1.0, **(kernels or {})
        )
    return _output(cfg, p, o, gate, x.dtype), ssm_state


def _output(cfg: ModelConfig, p: dict, o: Array, gate: Array, dtype, io: dict | None = None) -> Array:
    """RMSNorm over all heads of the recurrence's output `[T, H, hd]`, the sigmoid output gate, out_proj."""
    o = rms_norm(o.reshape(o.shape[0], -1).astype(dtype), p["norm"], LIGHTNING_NORM_EPS, False)
    return out_projection(jax.nn.sigmoid(gate) * o, p["out_proj"], io)


def _output_scaled_after(p: dict, o: Array, gate: Array, dtype) -> Array:
    """`_output` with the RMS scale applied to the projection's rows: `((sigmoid(gate) w o) @ W) / rms(o)`, equal to
    `(sigmoid(gate) (w o / rms(o))) @ W` up to where the bf16 roundings fall."""
    of = o.reshape(o.shape[0], -1).astype(jnp.float32)  # [T, H*hd]
    inv = jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + LIGHTNING_NORM_EPS)  # [T, 1]
    gated = jax.nn.sigmoid(gate) * (p["norm"] * of.astype(dtype))  # [T, H*hd]
    return (linear(gated, p["out_proj"]).astype(jnp.float32) * inv).astype(dtype)
