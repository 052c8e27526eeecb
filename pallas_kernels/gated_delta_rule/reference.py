"""Gated delta rule over ragged packed sequences and state slots, pure jnp (fp32 accumulation).

Per value head, with state `S` of shape `[K, V]` and scalar decay `g_t <= 0` (log space):

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - k_t^T S_t))^T        (delta-rule correction)
    o_t = scale * q_t^T S_t

Sequences are packed along T and delimited by `cu_seqlens`; sequence b starts from
`state[slot_ids[b]]` (zeros when `slot_ids[b] == 0`, the null slot) and its final state is written back to
that slot. Value head j reads key head `j // (HV // H)` (grouped value heads).

Three forms compute the same function:
  * `recurrent_gated_delta_rule_reference`: one token at a time (`lax.scan` over T), the plain definition;
  * `chunk_gated_delta_rule_reference`: chunks of C tokens in the WY form (a triangular solve per chunk,
    then one state pass per chunk), what prefill kernels compute;
  * `fused_recurrent_gated_delta_rule_reference`: exactly one token per sequence (decode).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _expand_heads(x: Array, num_value_heads: int) -> Array:
    """[..., H, K] -> [..., HV, K]: value head j uses key head j // (HV // H)."""
    return jnp.repeat(x, num_value_heads // x.shape[-2], axis=-2)


def _load_initial(state: Array, slot_ids: Array) -> Array:
    h0 = state[slot_ids].astype(jnp.float32)  # [B, HV, K, V]
    return jnp.where((slot_ids == 0)[:, None, None, None], 0.0, h0)


def _token_rows(cu_seqlens: Array, num_tokens: int) -> tuple[Array, Array]:
    """Batch row of each packed token and whether the token is real (not trailing padding)."""
    t = jnp.arange(num_tokens)
    # compare_all: T x B comparisons in one fusion (the default `scan` is an XLA while loop, whose every trip the
    # GPU runtime drives from the host; the paged prefill kernel's layout runs this in every prefill step)
    rows = jnp.searchsorted(cu_seqlens[1:], t, side="right", method="compare_all")
    valid = t < cu_seqlens[-1]
    return jnp.minimum(rows, cu_seqlens.shape[0] - 2), valid


class ChunkLayout(NamedTuple):
    """Where each packed token sits when every row is cut into chunks of C tokens starting at its first
    token (a chunk never mixes rows); `N = ceil(T / C) + B` chunk buffers bound the count statically."""

    chunk_size: int
    num_chunks: int
    valid: Array  # [T] the token is real (not trailing padding)
    token_chunk: Array  # [T] chunk of each token; N (out of range, dropped) for padding
    token_lane: Array  # [T] position inside its chunk
    chunk_row: Array  # [N] row of each chunk
    chunk_valid: Array  # [N] the chunk holds tokens

    def to_chunks(self, x: Array) -> Array:
        """[T, ...] -> [N, C, ...] in fp32, zeros in unused lanes."""
        buf = jnp.zeros((self.num_chunks, self.chunk_size, *x.shape[1:]), jnp.float32)
        return buf.at[self.token_chunk, self.token_lane].set(x.astype(jnp.float32), mode="drop")


def chunk_layout(cu_seqlens: Array, num_tokens: int, chunk_size: int) -> ChunkLayout:
    batch = cu_seqlens.shape[0] - 1
    num_chunks = -(-num_tokens // chunk_size) + batch
    rows, valid = _token_rows(cu_seqlens, num_tokens)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    chunks_per_row = (lengths + chunk_size - 1) // chunk_size
    chunk_end = jnp.cumsum(chunks_per_row)  # [B]
    local = jnp.arange(num_tokens) - cu_seqlens[rows]
    token_chunk = jnp.where(valid, chunk_end[rows] - chunks_per_row[rows] + local // chunk_size, num_chunks)
    chunk_ids = jnp.arange(num_chunks)
    chunk_row = jnp.minimum(jnp.searchsorted(chunk_end, chunk_ids, side="right", method="compare_all"), batch - 1)
    return ChunkLayout(chunk_size, num_chunks, valid, token_chunk, local % chunk_size, chunk_row,
                       chunk_ids < chunk_end[-1])


def _check(q, k, v, g, beta, cu_seqlens, state, slot_ids):
    num_tokens, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have one shape, got {q.shape=} {k.shape=}")
    if num_value_heads % num_heads:
        raise ValueError(f"value heads ({num_value_heads}) must be a multiple of key heads ({num_heads})")
    if g.shape != v.shape[:-1] or beta.shape != v.shape[:-1]:
        raise ValueError(f"g and beta must be [T, HV] = {v.shape[:-1]}, got {g.shape=} {beta.shape=}")
    if state.shape[1:] != (num_value_heads, key_dim, value_dim):
        raise ValueError(f"state must be [S, {num_value_heads}, {key_dim}, {value_dim}], got {state.shape}")
    if cu_seqlens.shape != (slot_ids.shape[0] + 1,):
        raise ValueError(f"cu_seqlens must be [B + 1] with B = {slot_ids.shape[0]}, got {cu_seqlens.shape}")


def recurrent_gated_delta_rule_reference(
    q: Float[Array, "T H K"],
    k: Float[Array, "T H K"],
    v: Float[Array, "T HV V"],
    g: Float[Array, "T HV"],
    beta: Float[Array, "T HV"],
    cu_seqlens: Int[Array, "B+1"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """Token-by-token gated delta rule over packed sequences.

    Returns `o [T, HV, V]` (v's dtype; zero for padding tokens) and the state with every row's slot
    replaced by its final state.
    """
    _check(q, k, v, g, beta, cu_seqlens, state, slot_ids)
    num_tokens, _, key_dim = q.shape
    num_value_heads = v.shape[1]
    scale = key_dim**-0.5 if scale is None else scale
    rows, valid = _token_rows(cu_seqlens, num_tokens)
    qf = _expand_heads(q.astype(jnp.float32), num_value_heads) * scale
    kf = _expand_heads(k.astype(jnp.float32), num_value_heads)
    h_all = _load_initial(state, slot_ids)

    def step(h_all, xs):
        q_t, k_t, v_t, g_t, b_t, row, ok = xs
        h = h_all[row] * jnp.exp(g_t)[:, None, None]  # [HV, K, V]
        v_err = v_t - jnp.einsum("hkv,hk->hv", h, k_t)
        h = h + k_t[:, :, None] * (b_t[:, None] * v_err)[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", h, q_t)
        h_all = h_all.at[row].set(jnp.where(ok, h, h_all[row]))
        return h_all, jnp.where(ok, o_t, 0.0)

    xs = (qf, kf, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), rows, valid)
    h_all, o = jax.lax.scan(step, h_all, xs)
    return o.astype(v.dtype), state.at[slot_ids].set(h_all.astype(state.dtype))


def fused_recurrent_gated_delta_rule_reference(
    q: Float[Array, "B H K"],
    k: Float[Array, "B H K"],
    v: Float[Array, "B HV V"],
    g: Float[Array, "B HV"],
    beta: Float[Array, "B HV"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """One decode step: row b advances `state[slot_ids[b]]` by its single token."""
    batch = q.shape[0]
    _check(q, k, v, g, beta, jnp.zeros((batch + 1,), jnp.int32), state, slot_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    num_value_heads = v.shape[1]
    qf = _expand_heads(q.astype(jnp.float32), num_value_heads) * scale
    kf = _expand_heads(k.astype(jnp.float32), num_value_heads)
    h = _load_initial(state, slot_ids) * jnp.exp(g.astype(jnp.float32))[..., None, None]  # [B, HV, K, V]
    v_err = v.astype(jnp.float32) - jnp.einsum("bhkv,bhk->bhv", h, kf)
    h = h + kf[..., None] * (beta.astype(jnp.float32)[..., None] * v_err)[:, :, None, :]
    o = jnp.einsum("bhkv,bhk->bhv", h, qf)
    return o.astype(v.dtype), state.at[slot_ids].set(h.astype(state.dtype))


def chunk_gated_delta_rule_reference(
    q: Float[Array, "T H K"],
    k: Float[Array, "T H K"],
    v: Float[Array, "T HV V"],
    g: Float[Array, "T HV"],
    beta: Float[Array, "T HV"],
    cu_seqlens: Int[Array, "B+1"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """The chunked (WY) form of `recurrent_gated_delta_rule_reference`, same arguments and results.

    Every sequence is cut into chunks of `chunk_size` tokens that start at the sequence's first token, so
    a chunk never mixes sequences; `N = ceil(T / C) + B` chunk buffers bound the count statically.
    Within chunk n (tokens i, j; G the in-chunk cumulative sum of g; decay(i, j) = exp(G_i - G_j)):

        A     = strict_lower(beta_i k_i.k_j decay(i, j)),   W = (I + A)^-1
        u     = W (beta v),  w = W (beta k exp(G))            pseudo-values and their state read-out
        v_new = u - w S                                      values corrected by the incoming state
        o     = scale (q exp(G)) S + lower(scale q_i.k_j decay(i, j)) v_new
        S'    = exp(G_last) S + (k exp(G_last - G))^T v_new
    """
    _check(q, k, v, g, beta, cu_seqlens, state, slot_ids)
    num_tokens, _, key_dim = q.shape
    num_value_heads, value_dim = v.shape[-2:]
    c = chunk_size
    scale = key_dim**-0.5 if scale is None else scale

    lay = chunk_layout(cu_seqlens, num_tokens, c)
    to_chunks = lay.to_chunks

    qc = to_chunks(_expand_heads(q, num_value_heads)) * scale  # [N, C, HV, K]
    kc = to_chunks(_expand_heads(k, num_value_heads))  # [N, C, HV, K]
    vc, gc, bc = to_chunks(v), to_chunks(g), to_chunks(beta)  # [N, C, HV, V], [N, C, HV] x2

    # --- intra-chunk work, all chunks at once (heads first: [N, HV, C, ...]) ---
    qc, kc, vc = (x.transpose(0, 2, 1, 3) for x in (qc, kc, vc))
    gc, bc = gc.transpose(0, 2, 1), bc.transpose(0, 2, 1)  # [N, HV, C]
    cum = jnp.cumsum(gc, axis=-1)  # [N, HV, C]
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, HV, C, C]
    a = jnp.einsum("nhik,nhjk->nhij", kc * bc[..., None], kc) * decay
    a = jnp.where(jnp.tril(lower, -1), a, 0.0)
    eye = jnp.eye(c, dtype=jnp.float32)
    rhs = jnp.concatenate([vc * bc[..., None], kc * (bc * jnp.exp(cum))[..., None]], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
    u, w = solved[..., :value_dim], solved[..., value_dim:]  # [N, HV, C, V], [N, HV, C, K]
    attn = jnp.einsum("nhik,nhjk->nhij", qc, kc) * decay  # [N, HV, C, C], zero above the diagonal
    q_dec = qc * jnp.exp(cum)[..., None]
    k_dec = kc * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [N, HV]

    # --- inter-chunk state pass ---
    def step(h_all, xs):
        u_n, w_n, attn_n, qd_n, kd_n, cd_n, row, ok = xs
        h = h_all[row]  # [HV, K, V]
        v_new = u_n - jnp.einsum("hck,hkv->hcv", w_n, h)
        o_n = jnp.einsum("hck,hkv->hcv", qd_n, h) + jnp.einsum("hij,hjv->hiv", attn_n, v_new)
        h_next = cd_n[:, None, None] * h + jnp.einsum("hck,hcv->hkv", kd_n, v_new)
        h_all = h_all.at[row].set(jnp.where(ok, h_next, h))
        return h_all, o_n

    h_all = _load_initial(state, slot_ids)
    xs = (u, w, attn, q_dec, k_dec, chunk_decay, lay.chunk_row, lay.chunk_valid)
    h_all, oc = jax.lax.scan(step, h_all, xs)  # oc: [N, HV, C, V]
    o = oc.transpose(0, 2, 1, 3)[jnp.minimum(lay.token_chunk, lay.num_chunks - 1), lay.token_lane]  # [T,HV,V]
    o = jnp.where(lay.valid[:, None, None], o, 0.0)
    return o.astype(v.dtype), state.at[slot_ids].set(h_all.astype(state.dtype))
