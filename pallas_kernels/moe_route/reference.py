"""A softmax router's decision laid out as per-pair tiles, pure jnp: the ground truth of `kernel.py`.

A decode step of T tokens at top-k runs its P = T * k (token, expert) pairs as P row tiles of `block_m` rows, pair
p = (token p // k, its (p % k)-th expert) in the first row of tile p and zeros below (`jhybrid.models.layers`'
per-pair layout). From the router's logits `[T, E]` this gives
  * `tile_expert [P]` (int32): each tile's expert, -1 for the pairs of tokens from `num_real` on (a bucket's
    padding, which reads no expert);
  * `row_w [P * block_m]` (fp32): each tile's rows' combine weights, the pair's in the first row, zeros below and
    zeros for the padding's pairs.
The weights are HF's softmax router's: the top-k of `softmax(logits)` in fp32, renormalised to sum to one over
the k when `norm_topk_prob`. Ties pick the lower expert first (`lax.top_k`'s order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def pair_route_reference(logits: Float[Array, "T E"], num_real: Int[Array, ""] | None, *, top_k: int,
                         norm_topk_prob: bool, block_m: int = 16) -> tuple[Array, Array]:
    """Returns (`tile_expert [T * k]` int32, `row_w [T * k * block_m]` fp32); see the module docstring."""
    num_tokens = logits.shape[0]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [T, E]
    top_p, top_i = jax.lax.top_k(probs, top_k)  # [T, k]
    if norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    real = jnp.arange(num_tokens) < (num_tokens if num_real is None else num_real)  # [T]
    tile_expert = jnp.where(real[:, None], top_i, -1).astype(jnp.int32).reshape(-1)  # [P]
    pair_w = jnp.where(real[:, None], top_p, 0.0).reshape(-1, 1)  # [P, 1]
    row_w = jnp.pad(pair_w, ((0, 0), (0, block_m - 1))).reshape(-1)  # [P * block_m]
    return tile_expert, row_w
