"""Top-k / top-p thresholds of a sampler, pure jnp: the ground truth of `kernel.py` and the path off the GPU.

vLLM's definitions, over the float32 logits of each row (`jhybrid.engine.sampling._filter_top_k_top_p`):
  * the top-k set is every token at or above the k-th largest logit (ties kept); k = 0 (off) or k >= V: all;
  * top-p then keeps, over the softmax of the top-k set, the tokens whose more likely tokens hold less than
    `top_p` of the mass: every token at or above the largest logit t with mass(logits >= t) >= top_p (so at
    least the most likely one); top_p >= 1: all.
Both thresholds are uint32 *order keys* (`order_keys`: unsigned order = float32 order, -inf above 0, key 0 below
every float), found by a radix select one bit at a time from the top:

    kth = max t with count(keys >= t) >= k          pth = max t with mass(keys >= t) >= top_p  (0: none)

and a token is kept iff `key >= max(kth, pth)` (`apply_thresholds`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def order_keys(x: Float[Array, "..."]) -> Array:
    """uint32 keys whose unsigned order is the float32 order of `x` (-inf lowest of the floats; no NaN)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(1 << 31))


def clamp_top_k(top_k: Int[Array, "B"], vocab: int) -> Int[Array, "B"]:
    """k as a count: 0 (or below) means off, i.e. the whole vocabulary; at most V."""
    return jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.int32)


def radix_select(keys: Array, weights: Float[Array, "B V"], target: Float[Array, "B"]) -> Array:
    """Per row, the largest uint32 t with sum(weights[keys >= t]) >= target (0 where none reaches it), for
    non-negative weights: 32 passes, one bit each, from the top (float32 sums)."""

    def one_bit(i, ans):
        cand = ans | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))  # [B]
        mass = jnp.sum(jnp.where(keys >= cand[:, None], weights, 0.0), axis=-1)
        return jnp.where(mass >= target, cand, ans)

    return jax.lax.fori_loop(0, 32, one_bit, jnp.zeros(keys.shape[:1], jnp.uint32))


def top_k_top_p_thresholds_reference(
    logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"]
) -> tuple[Array, Array]:
    """(kth, pth), each `[B]` uint32 order keys, as the module docstring defines them. `top_k` 0 or -1: off;
    `top_p` >= 1: off (pth = 0)."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    keys = order_keys(logits)
    k = clamp_top_k(top_k, vocab).astype(jnp.float32)  # counts are exact in float32 up to 2**24
    kth = radix_select(keys, jnp.ones_like(logits), k)
    probs = jax.nn.softmax(jnp.where(keys >= kth[:, None], logits, -jnp.inf), axis=-1)  # over the top-k set
    pth = radix_select(keys, probs, jnp.where(top_p < 1.0, top_p, 2.0))  # 2: unreachable, pth stays 0
    return kth, pth


def apply_thresholds(logits: Float[Array, "B V"], kth: Array, pth: Array) -> Float[Array, "B V"]:
    """`logits` with every token below either threshold (`[B]` uint32 order keys) set to -inf."""
    keep = order_keys(logits) >= jnp.maximum(kth, pth)[:, None]
    return jnp.where(keep, logits, -jnp.inf)
