"""Block-wise FP8 matmul, pure jnp: the ground truth of `kernel.py` and the path off the GPU.

The scheme (DeepSeek-V3's, which the FP8 checkpoints on the hub and transformers' `finegrained_fp8` use):
a weight `W [N, K]` (stored `[out, in]`, as `torch.nn.Linear` stores it) is split into 128 x 128 blocks,
each held as float8_e4m3fn with one float32 scale (`W ~ W_fp8 * scale` per block); an activation row is
quantized at run time per group of 128 along K the same way. The product sums, over the K blocks, the FP8
block products scaled by the row's group scale and the weight's block scale:

    y[m, n] = sum_b  s_x[m, b] * s_w[n // 128, b] * sum_{k in block b} x_fp8[m, k] * W_fp8[n, k]

`N` is padded to a multiple of 128 in storage (zero rows); `K` must be a multiple of 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

BLOCK = 128  # the quantization block along N and K (weights) and along K (activations)
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_TINY = 1e-12  # floor of a scale, so an all-zero group quantizes to zeros, not NaN


def quantize_rows(x: Float[Array, "M K"], block: int = BLOCK, barrier: bool = True) -> tuple[Array, Float[Array, "M KB"]]:
    """Each row of `x`, per group of `block` along K, as float8_e4m3fn and its float32 scale (amax / 448).
    `barrier=False` lets XLA fuse the quantization into its producer (for an FP8 consumer: a kernel's operand)."""
    m, k = x.shape
    groups = x.astype(jnp.float32).reshape(m, k // block, block)  # [M, KB, BK]
    scale = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), _TINY) / FP8_MAX  # [M, KB]
    q = to_fp8(groups / scale[..., None]) if barrier else _saturate(groups / scale[..., None])
    return q.reshape(m, k), scale


def _saturate(v: Array) -> Array:
    return jnp.clip(v, -FP8_MAX, FP8_MAX).astype(FP8)


def to_fp8(v: Array) -> Array:
    """float8_e4m3fn of `v` (saturated to +-448, rounded to nearest even), kept as FP8 under jit: XLA on GPU
    (its excess-precision default) would otherwise drop a float32 -> FP8 -> float32 round trip, and with it
    the activations' quantization (seen on the H200: the reference then differed from the kernel by 2.6e-2)."""
    return jax.lax.optimization_barrier(_saturate(v))


def quantize_weight(w: Float[Array, "K N"], block: int = BLOCK) -> tuple[Array, Float[Array, "NB KB"]]:
    """A weight stored `[in, out]` (the model's layout) -> (`W_fp8 [Npad, K]` in `[out, in]` order, with N padded
    by zero rows to a multiple of `block`, and its float32 scales `[Npad / block, K / block]`, amax / 448 per
    block). The block's values are rounded to nearest; a block of zeros gets the floor scale."""
    k, n = w.shape
    if k % block:
        raise ValueError(f"FP8 block quantization needs the input dim to be a multiple of {block}, got {k}")
    n_pad = -n % block
    wt = jnp.pad(w.astype(jnp.float32).T, ((0, n_pad), (0, 0)))  # [Npad, K]
    blocks = wt.reshape((n + n_pad) // block, block, k // block, block)  # [NB, BN, KB, BK]
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(1, 3)), _TINY) / FP8_MAX  # [NB, KB]
    q = to_fp8(blocks / scale[:, None, :, None])
    return q.reshape(n + n_pad, k), scale


def dequantize_weight(w: Array, scale: Float[Array, "NB KB"], n: int, block: int = BLOCK) -> Float[Array, "K N"]:
    """Inverse of `quantize_weight` up to its rounding: float32 `[K, n]` (the model's `[in, out]` layout)."""
    n_pad, k = w.shape
    blocks = w.astype(jnp.float32).reshape(n_pad // block, block, k // block, block) * scale[:, None, :, None]
    return blocks.reshape(n_pad, k)[:n].T


def fp8_matmul_reference(x: Float[Array, "M K"], w: Array, scale: Float[Array, "NB KB"], n: int) -> Float[Array, "M N"]:
    """`x @ W` with `W` held as `quantize_weight` holds it, `x` quantized per row and 128-group at run time;
    float32 products and sums of the FP8 values (exact: an FP8 product has 8 significant bits), the result in
    `x.dtype`, `[M, n]`."""
    q, s = quantize_rows(x)
    m, k = x.shape
    xd = (q.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK) * s[..., None]).reshape(m, k)
    wd = dequantize_weight(w, scale, n)
    return jnp.dot(xd, wd, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
