"""Scalar-decay linear recurrence (fla's "simple GLA") over ragged packed sequences and state slots, pure
jnp with fp32 accumulation.

Per value head, with state `S` of shape `[K, V]` and a scalar decay `g_t <= 0` (log space):

    S_t = exp(g_t) * S_{t-1} + k_t v_t^T
    o_t = scale * q_t^T S_t

This is the gated delta rule without the delta-rule correction. It covers
  * lightning attention (MiniMax): g_t = -slope (a constant per head), q/k/v after SiLU, scale 1;
  * Mamba2 SSD: k_t = B_t, q_t = C_t (per group: the "key heads"), v_t = dt_t x_t, g_t = dt_t A, scale 1
    (the D skip is added by the caller).

Sequences are packed along T and delimited by `cu_seqlens`; sequence b starts from `state[slot_ids[b]]`
(zeros when `slot_ids[b] == 0`, the null slot) and its final state is written back to that slot. Value head
j reads key head `j // (HV // H)` (grouped value heads; Mamba2: head j reads group `j // (heads / groups)`).

Three forms compute the same function:
  * `recurrent_simple_gla_reference`: one token at a time (`lax.scan` over T), the plain definition;
  * `chunk_simple_gla_reference`: chunks of C tokens (intra-chunk attention-like matmuls, one state pass
    per chunk), what prefill kernels compute;
  * `fused_recurrent_simple_gla_reference`: exactly one token per sequence (decode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.gated_delta_rule.reference import _expand_heads, _load_initial, _token_rows, chunk_layout


def _check(q, k, v, g, cu_seqlens, state, slot_ids):
    num_heads, key_dim = q.shape[1:]
    num_value_heads, value_dim = v.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have one shape, got {q.shape=} {k.shape=}")
    if num_value_heads % num_heads:
        raise ValueError(f"value heads ({num_value_heads}) must be a multiple of key heads ({num_heads})")
    if g.shape != v.shape[:-1]:
        raise ValueError(f"g must be [T, HV] = {v.shape[:-1]}, got {g.shape=}")
    if state.shape[1:] != (num_value_heads, key_dim, value_dim):
        raise ValueError(f"state must be [S, {num_value_heads}, {key_dim}, {value_dim}], got {state.shape}")
    if cu_seqlens.shape != (slot_ids.shape[0] + 1,):
        raise ValueError(f"cu_seqlens must be [B + 1] with B = {slot_ids.shape[0]}, got {cu_seqlens.shape}")


def recurrent_simple_gla_reference(
    q: Float[Array, "T H K"],
    k: Float[Array, "T H K"],
    v: Float[Array, "T HV V"],
    g: Float[Array, "T HV"],
    cu_seqlens: Int[Array, "B+1"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float = 1.0,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """Token-by-token scalar-decay recurrence over packed sequences.

    Returns `o [T, HV, V]` (v's dtype; zero for padding tokens) and the state with every row's slot
    replaced by its final state.
    """
    _check(q, k, v, g, cu_seqlens, state, slot_ids)
    num_tokens = q.shape[0]
    num_value_heads = v.shape[1]
    rows, valid = _token_rows(cu_seqlens, num_tokens)
    qf = _expand_heads(q.astype(jnp.float32), num_value_heads) * scale  # [T, HV, K]
    kf = _expand_heads(k.astype(jnp.float32), num_value_heads)

    def step(h_all, xs):
        q_t, k_t, v_t, g_t, row, ok = xs
        h = h_all[row] * jnp.exp(g_t)[:, None, None] + k_t[:, :, None] * v_t[:, None, :]  # [HV, K, V]
        o_t = jnp.einsum("hkv,hk->hv", h, q_t)
        h_all = h_all.at[row].set(jnp.where(ok, h, h_all[row]))
        return h_all, jnp.where(ok, o_t, 0.0)

    xs = (qf, kf, v.astype(jnp.float32), g.astype(jnp.float32), rows, valid)
    h_all, o = jax.lax.scan(step, _load_initial(state, slot_ids), xs)
    return o.astype(v.dtype), state.at[slot_ids].set(h_all.astype(state.dtype))


def fused_recurrent_simple_gla_reference(
    q: Float[Array, "B H K"],
    k: Float[Array, "B H K"],
    v: Float[Array, "B HV V"],
    g: Float[Array, "B HV"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float = 1.0,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """One decode step: row b advances `state[slot_ids[b]]` by its single token."""
    batch = q.shape[0]
    _check(q, k, v, g, jnp.zeros((batch + 1,), jnp.int32), state, slot_ids)
    num_value_heads = v.shape[1]
    qf = _expand_heads(q.astype(jnp.float32), num_value_heads) * scale  # [B, HV, K]
    kf = _expand_heads(k.astype(jnp.float32), num_value_heads)
    h = _load_initial(state, slot_ids) * jnp.exp(g.astype(jnp.float32))[..., None, None]  # [B, HV, K, V]
    h = h + kf[..., None] * v.astype(jnp.float32)[:, :, None, :]
    o = jnp.einsum("bhkv,bhk->bhv", h, qf)
    return o.astype(v.dtype), state.at[slot_ids].set(h.astype(state.dtype))


def chunk_simple_gla_reference(
    q: Float[Array, "T H K"],
    k: Float[Array, "T H K"],
    v: Float[Array, "T HV V"],
    g: Float[Array, "T HV"],
    cu_seqlens: Int[Array, "B+1"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float = 1.0,
    chunk_size: int = 64,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """The chunked form of `recurrent_simple_gla_reference`, same arguments and results.

    Every sequence is cut into chunks of `chunk_size` tokens that start at the sequence's first token, so
    a chunk never mixes sequences; `N = ceil(T / C) + B` chunk buffers bound the count statically.
    Within chunk n (tokens i, j; G the in-chunk cumulative sum of g; decay(i, j) = exp(G_i - G_j)):

        o  = scale (q exp(G)) S + lower(scale q_i.k_j decay(i, j)) v
        S' = exp(G_last) S + (k exp(G_last - G))^T v

    Every exponent is <= 0 (masked entries are -inf before the exp), so large decays underflow to 0
    rather than overflow.
    """
    _check(q, k, v, g, cu_seqlens, state, slot_ids)
    num_tokens = q.shape[0]
    num_value_heads = v.shape[1]
    c = chunk_size
    lay = chunk_layout(cu_seqlens, num_tokens, c)
    to_chunks = lay.to_chunks

    qc = to_chunks(_expand_heads(q, num_value_heads)) * scale  # [N, C, HV, K]
    kc = to_chunks(_expand_heads(k, num_value_heads))  # [N, C, HV, K]
    vc, gc = to_chunks(v), to_chunks(g)  # [N, C, HV, V], [N, C, HV]

    # --- intra-chunk work, all chunks at once (heads first: [N, HV, C, ...]) ---
    qc, kc, vc = (x.transpose(0, 2, 1, 3) for x in (qc, kc, vc))
    cum = jnp.cumsum(gc.transpose(0, 2, 1), axis=-1)  # [N, HV, C]
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, HV, C, C]
    attn = jnp.einsum("nhik,nhjk->nhij", qc, kc) * decay  # [N, HV, C, C], zero above the diagonal
    o_intra = jnp.einsum("nhij,nhjv->nhiv", attn, vc)  # [N, HV, C, V]
    q_dec = qc * jnp.exp(cum)[..., None]
    kv = jnp.einsum("nhck,nhcv->nhkv", kc * jnp.exp(cum[..., -1:] - cum)[..., None], vc)  # [N, HV, K, V]
    chunk_decay = jnp.exp(cum[..., -1])  # [N, HV]

    # --- inter-chunk state pass ---
    def step(h_all, xs):
        qd_n, kv_n, cd_n, row, ok = xs
        h = h_all[row]  # [HV, K, V]
        o_n = jnp.einsum("hck,hkv->hcv", qd_n, h)
        h_next = cd_n[:, None, None] * h + kv_n
        h_all = h_all.at[row].set(jnp.where(ok, h_next, h))
        return h_all, o_n

    h_all, o_inter = jax.lax.scan(step, _load_initial(state, slot_ids), (q_dec, kv, chunk_decay, lay.chunk_row, lay.chunk_valid))
    oc = (o_intra + o_inter).transpose(0, 2, 1, 3)  # [N, C, HV, V]
    o = oc[jnp.minimum(lay.token_chunk, lay.num_chunks - 1), lay.token_lane]  # [T, HV, V]
    o = jnp.where(lay.valid[:, None, None], o, 0.0)
    return o.astype(v.dtype), state.at[slot_ids].set(h_all.astype(state.dtype))


def mamba2_gated_norm_reference(
    o: Float[Array, "T HV V"],
    xbc: Float[Array, "T C"],
    z: Float[Array, "T Z"],
    d_skip: Float[Array, "HV"],
    weight: Float[Array, "I"],
    *,
    group_size: int,
    eps: float,
    out_dtype,
    x_activated: bool = False,
) -> Array:
    """A Mamba2 mixer's prefill output after its scan, to its out projection's input: the D skip `y = o + D x` in
    fp32 (x = SiLU of the conv output's first `I = HV V` columns; with `x_activated`, those columns as they are:
    SiLU(x) made by the conv kernel, `chunk_mamba2_operands`), y rounded to `out_dtype`, the gate `y SiLU(z)` in
    fp32 (z: the in_proj output's first I columns), then the RMS norm over consecutive groups of `group_size` channels
    times `weight`, normed in `out_dtype` (the parts' `chunk_mamba2_in_parts` and the layer's `grouped_rms_norm`, in
    one function). Returns `[T, I]` in the dtype of `weight * out_dtype`."""
    num_tokens, heads, head_dim = o.shape
    inner = heads * head_dim
    x = xbc[:, :inner].astype(jnp.float32)
    x = (x if x_activated else jax.nn.silu(x)).reshape(num_tokens, heads, head_dim)
    y = (o.astype(jnp.float32) + x * d_skip.astype(jnp.float32)[:, None]).astype(out_dtype)
    h = y.astype(jnp.float32) * jax.nn.silu(z[:, :inner].reshape(num_tokens, heads, head_dim).astype(jnp.float32))
    h = h.reshape(num_tokens, inner // group_size, group_size)  # [T, G, I/G]
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.reshape(num_tokens, inner).astype(out_dtype)
