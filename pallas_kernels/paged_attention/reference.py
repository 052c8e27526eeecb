"""Paged attention over block tables, pure jnp: the ground truth for the Pallas kernels.

One function covers decode (one query per sequence) and ragged prefill (many packed queries per sequence):
query token t belongs to batch row `token_seq[t]`, sits at `positions[t]` in its sequence, and attends to
the cached keys at positions `0..positions[t]` of that row (causal), read through the row's block table.
The new tokens' K/V must already be written to the pages (`write_kv_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def write_kv_pages(
    k_pages: Float[Array, "P BS KVH D"],
    v_pages: Float[Array, "P BS KVH D"],
    k: Float[Array, "T KVH D"],
    v: Float[Array, "T KVH D"],
    slot_mapping: Int[Array, "T"],
) -> tuple[Array, Array]:
    """Writes token t's K/V at flat cache position `slot_mapping[t] = page * BS + offset`.

    Padded tokens point into page 0, the null page (see pallas_kernels/README.md).
    """
    num_pages, block_size = k_pages.shape[:2]
    flat_k = k_pages.reshape(num_pages * block_size, *k_pages.shape[2:])
    flat_v = v_pages.reshape(num_pages * block_size, *v_pages.shape[2:])
    flat_k = flat_k.at[slot_mapping].set(k.astype(k_pages.dtype))
    flat_v = flat_v.at[slot_mapping].set(v.astype(v_pages.dtype))
    return flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)


def paged_attention_reference(
    q: Float[Array, "T H D"],
    k_pages: Float[Array, "P BS KVH D"],
    v_pages: Float[Array, "P BS KVH D"],
    block_tables: Int[Array, "B M"],
    token_seq: Int[Array, "T"],
    positions: Int[Array, "T"],
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
) -> Float[Array, "T H D"] | tuple[Float[Array, "T H D"], Float[Array, "T H"]]:
    """Causal attention of packed queries over their sequences' paged KV.

    Args:
      q: queries `[T, H, D]`; `H % KVH == 0` (GQA: query head h reads kv head `h // (H // KVH)`).
      k_pages, v_pages: the cache `[P, BS, KVH, D]`.
      block_tables: `[B, M]` page ids of each row (entries past a row's length are ignored).
      token_seq: `[T]` batch row of each query token (padding tokens may point at any valid row).
      positions: `[T]` position of each query in its sequence; it attends to keys `0..positions[t]`.
      scale: softmax scale, default `D ** -0.5`.
      sliding_window: if set, keys at positions `<= positions[t] - sliding_window` are masked too.
      soft_cap: if set, scores become `soft_cap * tanh(scores / soft_cap)` before the softmax.
      return_lse: also return the natural-log sum-exp of the scaled scores `[T, H]` (fp32).

    Returns:
      `o [T, H, D]` in q's dtype (and `lse [T, H]`). Unread pages may hold anything, NaN included.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} must be a multiple of kv heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    max_len = block_tables.shape[1] * block_size

    def one_token(q_t, row, pos):
        pages = block_tables[row]  # [M]
        k_t = k_pages[pages].reshape(max_len, num_kv_heads, head_dim).astype(jnp.float32)
        v_t = v_pages[pages].reshape(max_len, num_kv_heads, head_dim).astype(jnp.float32)
        key_pos = jnp.arange(max_len)
        mask = key_pos <= pos
        if sliding_window is not None:
            mask &= key_pos > pos - sliding_window
        v_t = jnp.where(mask[:, None, None], v_t, 0.0)  # unread pages may hold NaN
        q_g = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        s = jnp.einsum("kgd,skd->kgs", q_g, k_t) * scale  # [KVH, G, S]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("kgs,skd->kgd", p, v_t) / denom
        lse = (m + jnp.log(denom))[..., 0]
        return o.reshape(num_heads, head_dim), lse.reshape(num_heads)

    o, lse = jax.vmap(one_token)(q, token_seq, positions)
    o = o.astype(q.dtype)
    return (o, lse) if return_lse else o
