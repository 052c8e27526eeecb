"""Merging partial attentions by log-sum-exp.

Attention over a context split into two disjoint key sets A and B (say, KV blocks on the GPU and KV blocks
in host memory) is the LSE-weighted mix of the attention over each part:

    m = max(lse_a, lse_b);  w_x = exp(lse_x - m)
    o = (w_a * o_a + w_b * o_b) / (w_a + w_b);  lse = m + log(w_a + w_b)

An empty part has lse = -inf and weight 0, and its output is ignored (it may be NaN: 0/0); two empty parts
give o = 0 and lse = -inf. The same merge combines the Pallas decode kernel's KV splits.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float


def merge_attention(
    o1: Float[Array, "T H D"],
    lse1: Float[Array, "T H"],
    o2: Float[Array, "T H D"],
    lse2: Float[Array, "T H"],
) -> tuple[Float[Array, "T H D"], Float[Array, "T H"]]:
    """Attention over the union of two disjoint key sets from the attention over each.

    Args:
      o1, o2: normalised partial outputs `[T, H, D]` (any float dtype; merged in fp32).
      lse1, lse2: their natural-log sum-exp of the scaled scores `[T, H]`; -inf for an empty part.

    Returns:
      `o [T, H, D]` in o1's dtype and `lse [T, H]` fp32.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(f"merge_attention needs o [T, H, D] and lse [T, H] of equal shapes, got {o1.shape=} "
                         f"{lse1.shape=} {o2.shape=} {lse2.shape=}")
    lse1, lse2 = lse1.astype(jnp.float32), lse2.astype(jnp.float32)
    m = jnp.maximum(lse1, lse2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # both empty: weights 0, not exp(nan)
    w1, w2 = jnp.exp(lse1 - m_safe), jnp.exp(lse2 - m_safe)  # [T, H]; 0 for an empty part
    denom = w1 + w2
    part1 = jnp.where(w1[..., None] > 0, o1.astype(jnp.float32), 0.0) * w1[..., None]  # an empty part may be NaN
    part2 = jnp.where(w2[..., None] > 0, o2.astype(jnp.float32), 0.0) * w2[..., None]
    o = (part1 + part2) / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return o.astype(o1.dtype), lse


def merge_splits(o: Float[Array, "... S R D"], lse: Float[Array, "... S R"]) -> tuple[Array, Array]:
    """`merge_attention` over S disjoint key sets at once: partial outputs `o [..., S, R, D]` (fp32) and their
    `lse [..., S, R]` (-inf for an empty split) along axis -3 / -2 -> `o [..., R, D]`, `lse [..., R]` (the
    Pallas kernels' KV splits)."""
    m = lse.max(axis=-2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # every split empty: weights 0
    w = jnp.exp(lse - m[..., None, :])  # 0 for empty splits
    denom = w.sum(axis=-2)
    # an empty split's output may be unwritten (the decode kernel's `SKIP_EMPTY`): weight 0 must not meet a NaN
    parts = jnp.where(w[..., None] > 0, w[..., None] * o, 0.0)
    out = parts.sum(axis=-3) / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return out, jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
