"""Pallas (Triton lowering) kernels for the chunked (WY) gated delta rule over ragged packed sequences.

Chunks are laid out as in `chunk_gated_delta_rule_reference`: each sequence is cut into chunks of C
tokens starting at its first token, `N = ceil(T / C) + B` chunk slots bound the count statically. The
kernels read the packed tokens directly (a chunk is a masked `[C, ...]` window starting at its first
token), so nothing is gathered into chunk buffers.

1. `_wy_kernel`, grid `(N, HV)`, all chunks in parallel: the in-chunk cumulative decay G, the strictly
   lower `A = beta_i k_i.k_j exp(G_i - G_j)`, `W = (I + A)^-1` by the product form
   `(I - A)(I + A^2)(I + A^4)...` (A is nilpotent, so log2(C) squarings are exact), and the
   pseudo-values `u = W (beta v)` and read-outs `w = W (beta exp(G) k)`, stored per chunk. By default
   (`wy_precision="bf16"`) every dot takes the input dtype (bf16 tensor cores, fp32 accumulation). It also
   stores G itself (`gcum`) and the output's masked decayed scores `lower(q.k exp(G_i - G_j)) scale`
   (`scores`), so that
2. the sequential pass, grid `(G, HV, V // BV)` (program g walks the g-th, (g+G)-th, ... row of more than
   one token, `_row_groups`), over each sequence's chunks from `state[slot_ids[b]]`
   (zeros on the null slot 0), final state written back into the slot (aliased, in place under jit with a
   donated state), does no scan, reduction or `[C, C]` exp per chunk: `v_new = u - w S`,
   `o = exp(G) scale (q S) + scores v_new` and `S' = exp(G_last) S + k^T (exp(G_last - G) v_new)`, with
   G_last one scalar load (`_state_kernel`). With `fused_output=False` (`_state_only_kernel`) the pass
   stores the state entering each chunk and `v_new`, and
3. `_output_kernel`, grid `(N, HV, V // BV')`, computes the output over all chunks in parallel, as in fla.
4. `_single_token_kernel`, grid `(B, HV, V // BV'')`: rows of exactly one token, which a serving engine's
   mixed step has many of (its decode rows), skip stages 1-3 (their chunk slots stay unused) and take the
   decode kernel's recurrent update instead. A one-token chunk would cost a full `[C, ...]` chunk's work in
   a program sized for it; the decode update costs what a decode step costs. Its programs past the last row
   write zeros for the padding tokens: no stage fills the output with zeros first (`zero_padding`).
Programs with nothing to do (unused chunk slots) exit at once, and the sequential pass launches a few
programs per value tile rather than one per row, so a step padded to many rows costs what its real rows cost.
The older forms stay selectable and tested: `gcum=False` (the pass scans g per chunk), `scores=False`,
`wy_precision="input"` or TF32 for the inverse.
Dot operands are in v's dtype (q and k are cast), accumulation, the decays and the state are fp32; w, u,
the scores, the per-chunk states and v_new are stored in v's dtype. Tokens past a chunk's end are masked
to zero on load, so their g = 0 keeps `G_last = G[C - 1]` right.
H200 timings of every stage and variant, against fla in the same run: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.gated_delta_rule.fused_decode import _l2_normalize
from pallas_kernels.gated_delta_rule.fused_recurrent import recurrent_step
from pallas_kernels.null_slot import load_state

_WHOLE = pl.no_block_spec  # the whole array, indexed inside the kernel
_DOT = (((1,), (0,)), ((), ()))  # a @ b
_DOT_T = (((1,), (1,)), ((), ()))  # a @ b.T
_T_DOT = (((0,), (0,)), ((), ()))  # a.T @ b


def _load_chunk(ref, start, valid, *idx, dtype=jnp.float32):
    """Masked `[C, ...]` window of packed tokens `ref[start:start + C, *idx]`; zeros past the chunk."""
    kept = sum(isinstance(i, slice) for i in idx)  # trailing dims the window keeps
    mask = valid.reshape(valid.shape + (1,) * kept)
    return plt.load(ref.at[(pl.ds(start, valid.shape[0]), *idx)], mask=mask, other=0).astype(dtype)


def _wy_kernel(
    chunk_start_ref,  # [N] first packed token of each chunk
    chunk_len_ref,  # [N] tokens in each chunk (0 for unused chunk slots)
    q_ref,  # [T, H, K] (whole; read only with `scores`)
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    beta_ref,  # [T, HV] (whole)
    w_ref,  # [C, K] of chunk n, value head j
    u_ref,  # [C, V]
    *extra_refs,  # [C] in-chunk cumulative g (gcum); [C, C] masked decayed scores (scores); q, k normalised
    #               [T, H, K] (whole; `write_qk`)
    chunk_size: int,
    group: int,
    precision,
    input_dots: bool,
    bf16_inverse: bool,
    gcum: bool,
    scores: bool,
    scale: float,
    l2norm: bool,
    write_qk: bool,
):
    n, j = pl.program_id(0), pl.program_id(1)
    length = chunk_len_ref[n]

    @pl.when(length > 0)  # unused chunk slots and one-token rows' chunks do nothing
    def _():
        _wy_chunk(chunk_start_ref[n], length, j, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref,
                  *extra_refs, chunk_size=chunk_size, group=group, precision=precision, input_dots=input_dots,
                  bf16_inverse=bf16_inverse, gcum=gcum, scores=scores, scale=scale, l2norm=l2norm,
                  write_qk=write_qk)


def _wy_chunk(start, length, j, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, *extra_refs,
              chunk_size, group, precision, input_dots, bf16_inverse, gcum, scores, scale, l2norm, write_qk):
    """The WY stage of one non-empty chunk (`_wy_kernel`)."""
    lane = jnp.arange(chunk_size)
    valid = lane < length
    k_in = _load_qk(k_ref, start, valid, j // group, k_ref.dtype, l2norm)  # [C, K]
    k = k_in.astype(jnp.float32)
    v = _load_chunk(v_ref, start, valid, j, slice(None))  # [C, V]
    g = _load_chunk(g_ref, start, valid, j)  # [C]
    beta = _load_chunk(beta_ref, start, valid, j)  # [C]
    cum = jnp.cumsum(g)  # [C]
    causal = lane[:, None] >= lane[None, :]
    decay_incl = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))  # [C, C], 0 above the diagonal
    decay = jnp.where(lane[:, None] > lane[None, :], decay_incl, 0.0)  # strictly lower
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    # input_dots: k k^T and the products with the inverse take the input dtype (bf16 tensor cores, as fla's
    # kkt and w/u kernels); the inverse itself stays in fp32 dots unless bf16_inverse
    dt = v_ref.dtype if input_dots else jnp.float32
    io_dot = dot if dt == jnp.float32 else functools.partial(
        jax.lax.dot_general, preferred_element_type=jnp.float32)
    k_dt = k_in if k_in.dtype == dt else k.astype(dt)  # the dots' k, not taken through fp32 and back
    eye = (lane[:, None] == lane[None, :]).astype(jnp.float32)
    inv_dot = dot
    if bf16_inverse:  # the squarings in bf16 operands (fp32 accumulation): half the tensor-core time of TF32
        inv_dot = lambda x, y, dims: jax.lax.dot_general(  # noqa: E731
            x.astype(dt), y.astype(dt), dims, precision=precision, preferred_element_type=jnp.float32)
    a = io_dot((k * beta[:, None]).astype(dt), k_dt, _DOT_T) * decay  # [C, C] strictly lower
    x = -a
    inv = eye + x  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...
    steps = chunk_size.bit_length() - 2  # log2(C) - 1 more factors
    for _ in range(steps):
        x = inv_dot(x, x, _DOT)
        inv = inv + inv_dot(inv, x, _DOT)
    inv = inv.astype(dt)
    u_ref[...] = io_dot(inv, (v * beta[:, None]).astype(dt), _DOT).astype(u_ref.dtype)
    w_ref[...] = io_dot(inv, (k * (beta * jnp.exp(cum))[:, None]).astype(dt), _DOT).astype(w_ref.dtype)
    extra = list(extra_refs)
    if gcum:  # the sequential pass then reads G and G_last instead of scanning g (zeros past the end keep G flat)
        extra.pop(0)[...] = cum
    if scores:  # the output's masked decayed scores, so the fused pass computes neither q k^T nor a [C, C] exp
        s_ref = extra.pop(0)
        q = _load_qk(q_ref, start, valid, j // group, q_ref.dtype, l2norm)  # [C, K]
        s_ref[...] = (io_dot(q.astype(dt), k_dt, _DOT_T) * (decay_incl * scale)).astype(s_ref.dtype)
        if write_qk:  # the chunk's normalised q and k for the later stages, by the first value head of the group
            qn_ref, kn_ref = extra

            @pl.when(j % group == 0)
            def _():
                rows, mask = pl.ds(start, chunk_size), valid[:, None]
                plt.store(qn_ref.at[rows, j // group, :], q, mask=mask)  # (both in q's and k's dtype)
                plt.store(kn_ref.at[rows, j // group, :], k_in, mask=mask)


def _chunk_decays(g_ref, n, start, valid, j, chunk_size: int, gcum: bool):
    """(G [C], G_last) of a chunk: loaded from the WY stage's `[N, C, HV]` G (`gcum`: no scan or reduction
    in the sequential loop), or a scan and a sum of the packed g."""
    if gcum:
        return g_ref[n, :, j], g_ref[n, chunk_size - 1, j]
    g = _load_chunk(g_ref, start, valid, j)  # [C]
    return jnp.cumsum(g), jnp.sum(g)


def _state_kernel(
    num_multi_ref,  # [1] rows of more than one token
    multi_rows_ref,  # [B] those rows first
    row_chunks_ref,  # [B + 1] first chunk slot of each row (cumulative)
    slot_ids_ref,  # [B]
    cu_seqlens_ref,  # [B + 1]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    g_ref,  # [N, C, HV] (whole) the WY stage's G (gcum), or the packed g [T, HV]
    w_ref,  # [N, C, HV, K] (whole)
    u_ref,  # [N, C, HV, V] (whole)
    s_ref,  # [N, C, HV, C] (whole) the WY stage's masked decayed scores (scores), else unused
    state_in_ref,  # [S, HV, K, V] (whole, aliased with state_ref)
    o_ref,  # [T, HV, V] (whole; tokens of no multi-token row are `_single_token_kernel`'s)
    state_ref,  # [S, HV, K, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
    gcum: bool,
    scores: bool,
    row_groups: int,
    l2norm: bool,
):
    """The fused pass. Per chunk: `v_new = u - w S`, `o = exp(G) scale (q S) + scores v_new` and
    `S' = exp(G_last) S + k^T (exp(G_last - G) v_new)`; the decays scale `[C, BV]` tiles, not `[C, K]` ones."""
    j, i = pl.program_id(1), pl.program_id(2)
    v_slice = pl.ds(i * block_v, block_v)

    def row(b):  # empty rows (padding) and one-token rows (`_single_token_kernel`) never come here
        slot = slot_ids_ref[b]
        h = jnp.where(slot == 0, 0.0, state_in_ref[slot, j, :, v_slice].astype(jnp.float32))  # [K, BV]
        _state_chunks(h, slot, j, v_slice, cu_seqlens_ref[b], cu_seqlens_ref[b + 1], row_chunks_ref[b], q_ref, k_ref,
                      g_ref, w_ref, u_ref, s_ref, o_ref, state_ref, chunk_size=chunk_size, group=group, scale=scale,
                      precision=precision, gcum=gcum, scores=scores, l2norm=l2norm)

    _for_each_multi_row(num_multi_ref, multi_rows_ref, row_groups, row)


def _state_chunks(h, slot, j, v_slice, seq_start, seq_end, first_chunk, q_ref, k_ref, g_ref, w_ref, u_ref, s_ref,
                  o_ref, state_ref, *, chunk_size, group, scale, precision, gcum, scores, l2norm):
    """`_state_kernel`'s loop over the chunks of a row of more than one token."""
    lane = jnp.arange(chunk_size)
    causal = lane[:, None] >= lane[None, :]
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    dt = w_ref.dtype  # dot operands in the input dtype (bf16 tensor cores), fp32 accumulation

    def body(c, h):
        start = seq_start + c * chunk_size
        valid = lane < seq_end - start
        n = first_chunk + c
        q = _load_qk(q_ref, start, valid, j // group, dt, l2norm)  # [C, K]
        k = _load_qk(k_ref, start, valid, j // group, dt, l2norm)  # [C, K]
        cum, cum_last = _chunk_decays(g_ref, n, start, valid, j, chunk_size, gcum)
        hb = h.astype(dt)
        v_new = u_ref[n, :, j, v_slice].astype(jnp.float32) - dot(w_ref[n, :, j, :], hb, _DOT)  # [C, BV]
        if scores:
            attn = s_ref[n, :, j, :]
        else:
            decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
            attn = (dot(q, k, _DOT_T) * (decay * scale)).astype(dt)  # [C, C]
        o = dot(q, hb, _DOT) * (jnp.exp(cum) * scale)[:, None] + dot(attn, v_new.astype(dt), _DOT)
        plt.store(o_ref.at[pl.ds(start, chunk_size), j, v_slice], o.astype(o_ref.dtype), mask=valid[:, None])
        v_dec = (v_new * jnp.exp(cum_last - cum)[:, None]).astype(dt)
        return jnp.exp(cum_last) * h + dot(k, v_dec, _T_DOT)

    num_chunks = (seq_end - seq_start + chunk_size - 1) // chunk_size
    h = jax.lax.fori_loop(0, num_chunks, body, h)
    state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def _state_only_kernel(
    num_multi_ref,  # [1]
    multi_rows_ref,  # [B]
    row_chunks_ref,  # [B + 1]
    slot_ids_ref,  # [B]
    cu_seqlens_ref,  # [B + 1]
    k_ref,  # [T, H, K] (whole)
    g_ref,  # [N, C, HV] (whole) the WY stage's G (gcum), or the packed g [T, HV]
    w_ref,  # [N, C, HV, K] (whole)
    u_ref,  # [N, C, HV, V] (whole)
    state_in_ref,  # [S, HV, K, V] (whole, aliased with state_ref)
    h_ref,  # [N, HV, K, V] (whole) state entering each chunk
    v_new_ref,  # [N, C, HV, V] (whole) corrected values
    state_ref,  # [S, HV, K, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    precision,
    gcum: bool,
    row_groups: int,
    l2norm: bool,
):
    """The sequential part only: per chunk, snapshot S, `v_new = u - w S`,
    `S' = exp(G_last) S + k^T (exp(G_last - G) v_new)`."""
    j, i = pl.program_id(1), pl.program_id(2)

    def row(b):
        _state_only_chunks(slot_ids_ref[b], j, pl.ds(i * block_v, block_v), cu_seqlens_ref[b], cu_seqlens_ref[b + 1],
                           row_chunks_ref[b], k_ref, g_ref, w_ref, u_ref, state_in_ref, h_ref, v_new_ref, state_ref,
                           chunk_size=chunk_size, group=group, precision=precision, gcum=gcum, l2norm=l2norm)

    _for_each_multi_row(num_multi_ref, multi_rows_ref, row_groups, row)


def _state_only_chunks(slot, j, v_slice, seq_start, seq_end, first_chunk, k_ref, g_ref, w_ref, u_ref, state_in_ref,
                       h_ref, v_new_ref, state_ref, *, chunk_size, group, precision, gcum, l2norm):
    h = state_in_ref[slot, j, :, v_slice].astype(jnp.float32)  # [K, BV]
    h = jnp.where(slot == 0, 0.0, h)
    lane = jnp.arange(chunk_size)
    dt = w_ref.dtype
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)

    def body(c, h):
        start = seq_start + c * chunk_size
        valid = lane < seq_end - start
        n = first_chunk + c
        h_ref[n, j, :, v_slice] = h.astype(h_ref.dtype)
        v_new = u_ref[n, :, j, v_slice].astype(jnp.float32) - dot(w_ref[n, :, j, :], h.astype(dt), _DOT)
        v_new_ref[n, :, j, v_slice] = v_new.astype(v_new_ref.dtype)
        cum, cum_last = _chunk_decays(g_ref, n, start, valid, j, chunk_size, gcum)
        k = _load_qk(k_ref, start, valid, j // group, dt, l2norm)  # [C, K]
        v_dec = (v_new * jnp.exp(cum_last - cum)[:, None]).astype(dt)
        return jnp.exp(cum_last) * h + dot(k, v_dec, _T_DOT)

    num_chunks = (seq_end - seq_start + chunk_size - 1) // chunk_size
    h = jax.lax.fori_loop(0, num_chunks, body, h)
    state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def _output_kernel(
    chunk_start_ref,  # [N]
    chunk_len_ref,  # [N]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    g_ref,  # [T, HV] (whole), or the in-chunk cumulative g [C] of chunk n with gcum
    h_ref,  # [K, BV] state entering chunk n
    v_new_ref,  # [C, BV]
    o_ref,  # [T, HV, V] (whole; tokens of no multi-token row are `_single_token_kernel`'s)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
    gcum: bool,
    l2norm: bool,
):
    """All chunks in parallel: o = (q exp(G)) S_n + lower(q.k exp(G_i - G_j)) v_new."""
    n, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = chunk_len_ref[n]

    @pl.when(length > 0)  # unused chunk slots do nothing
    def _():
        _output_chunk(chunk_start_ref[n], length, j, i, q_ref, k_ref, g_ref, h_ref, v_new_ref, o_ref,
                      chunk_size=chunk_size, group=group, block_v=block_v, scale=scale, precision=precision,
                      gcum=gcum, l2norm=l2norm)


def _output_chunk(start, length, j, i, q_ref, k_ref, g_ref, h_ref, v_new_ref, o_ref, *, chunk_size, group, block_v,
                  scale, precision, gcum, l2norm):
    lane = jnp.arange(chunk_size)
    valid = lane < length
    dt = q_ref.dtype
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    q = _load_qk(q_ref, start, valid, j // group, dt, l2norm)  # [C, K]
    k = _load_qk(k_ref, start, valid, j // group, dt, l2norm)
    cum = g_ref[...] if gcum else jnp.cumsum(_load_chunk(g_ref, start, valid, j))  # [C]
    causal = lane[:, None] >= lane[None, :]
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
    attn = (dot(q, k, _DOT_T) * (decay * scale)).astype(dt)  # [C, C]
    q_dec = (q.astype(jnp.float32) * (jnp.exp(cum) * scale)[:, None]).astype(dt)
    o = dot(q_dec, h_ref[...].astype(dt), _DOT) + dot(attn, v_new_ref[...].astype(dt), _DOT)  # [C, BV]
    plt.store(o_ref.at[pl.ds(start, chunk_size), j, pl.ds(i * block_v, block_v)], o.astype(o_ref.dtype),
              mask=valid[:, None])


def _single_token_kernel(
    cu_seqlens_ref,  # [B + 1]
    slot_ids_ref,  # [B]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    beta_ref,  # [T, HV] (whole)
    o_in_ref,  # [T, HV, V] (whole, aliased with o_ref): the chunk stages' output
    state_in_ref,  # [S, HV, K, V] (whole, aliased with state_ref)
    o_ref,  # [T, HV, V] (whole)
    state_ref,  # [S, HV, K, V] (whole)
    *,
    group: int,
    block_v: int,
    scale: float,
    num_tokens: int,
    tail_tokens: int,
    l2norm: bool,
):
    """Rows of exactly one token (the decode rows of a mixed step): the recurrent update, as the decode kernel
    does it, in place of a `[C, ...]` chunk that would hold one token. Other rows are left alone. Programs past
    the last row write the padding tokens' zeros (`zero_padding`)."""
    del o_in_ref
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    zero_padding(cu_seqlens_ref, o_ref, b - slot_ids_ref.shape[0], j, pl.ds(i * block_v, block_v),
                 num_tokens=num_tokens, tokens=tail_tokens)
    b = jnp.minimum(b, slot_ids_ref.shape[0] - 1)
    t = cu_seqlens_ref[b]

    @pl.when((pl.program_id(0) == b) & (cu_seqlens_ref[b + 1] - t == 1))
    def _():
        slot = slot_ids_ref[b]
        v_slice = pl.ds(i * block_v, block_v)
        q = _l2norm(q_ref[t, j // group, :], l2norm, q_ref.dtype)
        k = _l2norm(k_ref[t, j // group, :], l2norm, k_ref.dtype)
        h = load_state(state_in_ref.at[slot, j, :, v_slice], slot)
        o, h = recurrent_step(h, q, k, v_ref[t, j, v_slice], g_ref[t, j], beta_ref[t, j], scale)
        o_ref[t, j, v_slice] = o.astype(o_ref.dtype)

        @pl.when(slot != 0)
        def _():
            state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def zero_padding(cu_seqlens_ref, o_ref, p, j, v_slice, *, num_tokens: int, tokens: int) -> None:
    """Program `p` (when 0 <= p) of `padding_programs(num_tokens, tokens)`: zeros into `o_ref[t, j, v_slice]` for
    the tokens t of `[p * tokens, (p + 1) * tokens)` at or after the last row's end (padding). The chunk stages'
    output is not zero-initialised (a fill would write the whole `[T, HV, V]` output once more: 67 MB a layer in
    an 8k bf16 prefill of qwen3_next), so these are the only writes padding tokens get."""
    @pl.when(p >= 0)
    def _():
        start = p * tokens
        t = start + jnp.arange(tokens)
        pad = (t >= cu_seqlens_ref[cu_seqlens_ref.shape[0] - 1]) & (t < num_tokens)
        width = v_slice.size
        plt.store(o_ref.at[pl.ds(start, tokens), j, v_slice], jnp.zeros((tokens, width), o_ref.dtype),
                  mask=pad[:, None])


def padding_programs(num_tokens: int, tokens: int) -> int:
    """Programs `zero_padding` needs to cover `num_tokens` packed tokens, `tokens` each."""
    return -(-num_tokens // tokens)


def single_token_stage(q, k, v, g, beta, cu, o, state, slot_ids, *, block_v: int, num_warps: int, interpret: bool,
                       scale: float, num_tokens: int, tail_tokens: int, l2norm: bool = False):
    """`_single_token_kernel` over every row (o and state updated in place), then `zero_padding` over the first
    `num_tokens` tokens, `tail_tokens` a program: (o, new state)."""
    num_value_heads, value_dim = v.shape[1:]
    kernel = functools.partial(_single_token_kernel, group=num_value_heads // k.shape[1], block_v=block_v,
                               scale=scale, num_tokens=num_tokens, tail_tokens=tail_tokens, l2norm=l2norm)
    return pl.pallas_call(
        kernel,
        grid=(slot_ids.shape[0] + padding_programs(num_tokens, tail_tokens), num_value_heads, value_dim // block_v),
        in_specs=[_WHOLE] * 9,
        out_specs=[_WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={7: 0, 8: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"gdn_chunk_single_bv{block_v}_w{num_warps}",
    )(cu, slot_ids.astype(jnp.int32), q, k, v, g, beta, o, state)


def _l2norm(x, on: bool, dtype):
    """x L2-normalised over its last axis in fp32 and rounded to `dtype` (what the caller would have passed had
    it normalised first: `fused_decode._l2_normalize`) when `on`, else x in `dtype`."""
    return _l2_normalize(x, dtype) if on else x.astype(dtype)


def _load_qk(ref, start, valid, head, dtype, l2norm: bool):
    """A chunk's q or k `[C, K]` in `dtype`, L2-normalised first with `l2norm` (masked tokens stay zeros). Without
    it the tile is loaded straight into `dtype`: a bf16 tile taken through fp32 and back stays an fp32 tile in
    Triton's registers (the fused pass's 118 -> 158 registers a thread on the H200 compile)."""
    if not l2norm:
        return _load_chunk(ref, start, valid, head, slice(None), dtype=dtype)
    return _l2_normalize(_load_chunk(ref, start, valid, head, slice(None)), dtype)


class _Layout(NamedTuple):
    row_chunks: Array  # [B + 1] first chunk slot of each row (cumulative; rows of one token have none)
    chunk_start: Array  # [N] first packed token of each chunk
    chunk_len: Array  # [N] tokens in each chunk, 0 for unused slots
    multi_rows: Array  # [B] the rows of more than one token first (in order), then the others
    num_multi: Array  # [1] how many rows have more than one token
    num_chunks: int


def _layout(cu_seqlens, num_tokens: int, batch: int, c: int) -> _Layout:
    cu = cu_seqlens.astype(jnp.int32)
    num_chunks = -(-num_tokens // c) + batch
    row_len = cu[1:] - cu[:-1]
    # one-token rows (the decode rows of a mixed step) are `_single_token_kernel`'s: they get no chunk slot
    chunks_per_row = jnp.where(row_len > 1, (row_len + c - 1) // c, 0)  # [B]
    row_chunks = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_per_row)])
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    # compare_all: one fusion (the default `scan` is a while loop the GPU drives from the host)
    chunk_row = jnp.clip(jnp.searchsorted(row_chunks[1:], ids, side="right", method="compare_all"), 0, batch - 1)
    chunk_start = cu[chunk_row] + (ids - row_chunks[chunk_row]) * c
    chunk_len = jnp.where(ids < row_chunks[-1], jnp.minimum(c, cu[chunk_row + 1] - chunk_start), 0)
    chunk_start = jnp.where(chunk_len > 0, chunk_start, 0)
    multi = row_len > 1
    multi_rows = jnp.argsort(~multi, stable=True).astype(jnp.int32)
    num_multi = jnp.sum(multi, dtype=jnp.int32)[None]
    return _Layout(row_chunks, chunk_start, chunk_len, multi_rows, num_multi, num_chunks)


def _row_groups(batch: int, num_value_heads: int, value_blocks: int) -> int:
    """Programs per (value head, value block) of a sequential pass: each walks every G-th row of more than
    one token. About 512 programs in all (a few per SM: a pass holds one or two per SM), so that a step of
    many one-token or padding rows launches no program per row that would only exit, while a pure prefill
    step of many rows still fills the GPU."""
    return max(1, min(batch, 512 // (num_value_heads * value_blocks)))


def _for_each_multi_row(num_multi_ref, multi_rows_ref, groups: int, body) -> None:
    """Calls `body(b)` for the rows of more than one token that belong to this program's group: the
    `pl.program_id(0)`-th, then every `groups`-th after it."""
    first = pl.program_id(0)
    count = (num_multi_ref[0] - first + groups - 1) // groups

    def step(r, carry):
        body(multi_rows_ref[first + r * groups])
        return carry

    jax.lax.fori_loop(0, jnp.maximum(count, 0), step, 0)


# the WY stage's dots on the GPU: "tf32x3" / "tf32": every dot in fp32 (3xTF32 or one TF32 pass); "input":
# the inverse in TF32, k k^T and the products with the inverse in the input dtype (bf16 inputs: bf16 tensor
# cores); "bf16": the inverse's squarings in the input dtype too (fp32 accumulation)
_PRECISIONS = {"tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "tf32": None, "input": None, "bf16": None}


def wy_stage(k, v, g, beta, layout: _Layout, *, chunk_size: int, wy_precision: str, num_warps: int,
             interpret: bool, gcum: bool = False, q=None, scale: float = 1.0, l2norm: bool = False,
             write_qk: bool = False):
    """w, u `[N, C, HV, K|V]` (v's dtype) for every chunk, all in parallel; then the in-chunk cumulative g
    `[N, C, HV]` (fp32) with `gcum`, given `q` the masked decayed scores `[N, C, HV, C]` (v's dtype), and with
    `write_qk` (and `q`) q and k as the stage used them (L2-normalised with `l2norm`), `[T, H, K]` each: written
    for the tokens of the chunks only (rows of one token and padding are left unwritten)."""
    num_value_heads, value_dim = v.shape[1:]
    key_dim = k.shape[-1]
    group = num_value_heads // k.shape[1]
    c, n = chunk_size, layout.num_chunks
    scores = q is not None
    if write_qk and not scores:
        raise ValueError("write_qk needs q (the scores' stage loads it)")
    # fp32 dots: exact (IEEE) in the interpreter; on the GPU 3xTF32 or one TF32 pass
    precision = jax.lax.Precision.HIGHEST if interpret else _PRECISIONS[wy_precision]
    kernel = functools.partial(_wy_kernel, chunk_size=c, group=group, precision=precision,
                               input_dots=wy_precision in ("input", "bf16"), bf16_inverse=wy_precision == "bf16",
                               gcum=gcum, scores=scores, scale=scale, l2norm=l2norm, write_qk=write_qk)
    spec = lambda d: pl.BlockSpec((None, c, None, d), lambda n, j: (n, 0, j, 0))  # noqa: E731
    shape = lambda d: jax.ShapeDtypeStruct((n, c, num_value_heads, d), v.dtype)  # noqa: E731
    out_specs, out_shape = [spec(key_dim), spec(value_dim)], [shape(key_dim), shape(value_dim)]
    if gcum:
        out_specs.append(pl.BlockSpec((None, c, None), lambda n, j: (n, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((n, c, num_value_heads), jnp.float32))
    if scores:
        out_specs.append(spec(c))
        out_shape.append(shape(c))
    if write_qk:
        out_specs += [_WHOLE, _WHOLE]
        out_shape += [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)]
    return pl.pallas_call(
        kernel,
        grid=(n, num_value_heads),
        in_specs=[_WHOLE] * 7,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=(f"gdn_chunk_wy_c{c}_{wy_precision}_w{num_warps}{'_gc' if gcum else ''}{'_sc' if scores else ''}"
              f"{'_qk' if write_qk else ''}"),
    )(layout.chunk_start, layout.chunk_len, k if q is None else q, k, v, g, beta)


def fused_state_stage(q, k, v, g, w, u, cu, state, slot_ids, layout: _Layout, *, chunk_size: int,
                      block_v: int, scale: float, num_warps: int, num_stages: int, interpret: bool,
                      gcum: bool = False, scores=None, row_groups: int | None = None, l2norm: bool = False):
    """The sequential pass with the output computed inside it: (o [T', HV, V], new state). With `gcum`, `g`
    is the WY stage's in-chunk cumulative g; `scores` optionally its masked decayed scores."""
    num_value_heads, value_dim = v.shape[1:]
    group = num_value_heads // k.shape[1]
    groups = row_groups or _row_groups(slot_ids.shape[0], num_value_heads, value_dim // block_v)
    kernel = functools.partial(_state_kernel, chunk_size=chunk_size, group=group, block_v=block_v, scale=scale,
                               precision=jax.lax.Precision.HIGHEST if interpret else None, gcum=gcum,
                               scores=scores is not None, row_groups=groups, l2norm=l2norm)
    return pl.pallas_call(
        kernel,
        grid=(groups, num_value_heads, value_dim // block_v),
        in_specs=[_WHOLE] * 12,
        out_specs=[_WHOLE, _WHOLE],
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={11: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunk_fused_c{chunk_size}_bv{block_v}_w{num_warps}_s{num_stages}{'_gc' if gcum else ''}"
             f"{'_sc' if scores is not None else ''}",
    )(layout.num_multi, layout.multi_rows, layout.row_chunks, slot_ids.astype(jnp.int32), cu, q, k, g, w, u,
      w if scores is None else scores, state)


def state_stage(k, g, w, u, cu, state, slot_ids, layout: _Layout, *, chunk_size: int, block_v: int,
                num_warps: int, num_stages: int, interpret: bool, gcum: bool = False, row_groups: int | None = None,
                l2norm: bool = False):
    """The sequential pass alone: (h [N, HV, K, V] entering each chunk, v_new [N, C, HV, V], new state).
    With `gcum`, `g` is the WY stage's in-chunk cumulative g."""
    num_value_heads, key_dim, value_dim = state.shape[1:]
    group = num_value_heads // k.shape[1]
    groups = row_groups or _row_groups(slot_ids.shape[0], num_value_heads, value_dim // block_v)
    kernel = functools.partial(_state_only_kernel, chunk_size=chunk_size, group=group, block_v=block_v,
                               precision=jax.lax.Precision.HIGHEST if interpret else None, gcum=gcum,
                               row_groups=groups, l2norm=l2norm)
    n, c = layout.num_chunks, chunk_size
    return pl.pallas_call(
        kernel,
        grid=(groups, num_value_heads, value_dim // block_v),
        in_specs=[_WHOLE] * 10,
        out_specs=[_WHOLE, _WHOLE, _WHOLE],
        out_shape=[
            jax.ShapeDtypeStruct((n, num_value_heads, key_dim, value_dim), u.dtype),
            jax.ShapeDtypeStruct((n, c, num_value_heads, value_dim), u.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={9: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunk_state_c{c}_bv{block_v}_w{num_warps}_s{num_stages}{'_gc' if gcum else ''}",
    )(layout.num_multi, layout.multi_rows, layout.row_chunks, slot_ids.astype(jnp.int32), cu, k, g, w, u, state)


def output_stage(q, k, g, h, v_new, layout: _Layout, *, chunk_size: int, scale: float, block_v: int,
                 num_warps: int, interpret: bool, gcum: bool = False, l2norm: bool = False):
    """All chunks in parallel: o [T', HV, V] from the per-chunk states and corrected values."""
    num_value_heads, key_dim, value_dim = h.shape[1:]
    group = num_value_heads // k.shape[1]
    c, out_bv = chunk_size, min(block_v, value_dim)
    kernel = functools.partial(_output_kernel, chunk_size=c, group=group, block_v=out_bv, scale=scale,
                               precision=jax.lax.Precision.HIGHEST if interpret else None, gcum=gcum, l2norm=l2norm)
    g_spec = pl.BlockSpec((None, c, None), lambda n, j, i: (n, 0, j)) if gcum else _WHOLE
    return pl.pallas_call(
        kernel,
        grid=(layout.num_chunks, num_value_heads, value_dim // out_bv),
        in_specs=[_WHOLE] * 4 + [
            g_spec,
            pl.BlockSpec((None, None, key_dim, out_bv), lambda n, j, i: (n, j, 0, i)),  # h
            pl.BlockSpec((None, c, None, out_bv), lambda n, j, i: (n, 0, j, i)),  # v_new
        ],
        out_specs=_WHOLE,
        out_shape=jax.ShapeDtypeStruct((q.shape[0], num_value_heads, value_dim), v_new.dtype),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        name=f"gdn_chunk_output_c{c}_bv{out_bv}_w{num_warps}{'_gc' if gcum else ''}",
    )(layout.chunk_start, layout.chunk_len, q, k, g, h, v_new)


# `normed_qk`'s default: the WY stage writes the normalised q and k that the sequential pass then reads, instead of
# the pass normalising them per chunk (on the H200 compile its kernel takes 222 registers a thread normalising, 118
# reading them as they are). Off until timed (JHYBRID_GDN_WY_NORMED_QK=1).
WY_NORMED_QK = os.environ.get("JHYBRID_GDN_WY_NORMED_QK", "0") == "1"
# the WY stage's warps when the caller names none (JHYBRID_GDN_WY_WARPS): 4, the H200's fastest in session 2's sweep;
# with `normed_qk` its H200 compile spills 160 B a thread at 4 warps and none at 8 (234 registers)
WY_NUM_WARPS = int(os.environ.get("JHYBRID_GDN_WY_WARPS", "4"))


def _prepare(q, k, v, g, beta, cu_seqlens, slot_ids, chunk_size, interpret):
    """Dot operands in one dtype, the chunk layout, and interpreter padding."""
    q, k = q.astype(v.dtype), k.astype(v.dtype)  # the model passes fp32 q/k with bf16 v
    layout = _layout(cu_seqlens, q.shape[0], slot_ids.shape[0], chunk_size)
    if interpret:  # the interpreter clamps windows that run past the end: pad instead (GPU loads are masked)
        pad = lambda x: jnp.pad(x, ((0, chunk_size),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
        q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    return q, k, v, g, beta, cu_seqlens.astype(jnp.int32), layout


def default_num_stages(key_dim: int, itemsize: int) -> int:
    """The sequential pass's pipeline depth: 3 for 2-byte inputs, 2 for 4-byte ones, and 1 from K = 256, where
    a stage holds [C, K] tiles twice as wide (on the H200, K = 256 asked for 332 KB of shared memory with three
    stages in bf16 and 234 KB with two in fp32, against 227 KB: benchmarks/head_dims, RESULTS.md session 26)."""
    if key_dim >= 256:
        return 1
    return 3 if itemsize <= 2 else 2


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "chunk_size", "block_v", "num_warps", "num_stages", "wy_num_warps", "wy_precision",
        "fused_output", "gcum", "scores", "out_block_v", "single_block_v", "row_groups", "qk_l2norm",
        "normed_qk", "interpret",
    ),
)
def chunk_gated_delta_rule_pallas(
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
    block_v: int = 16,
    num_warps: int = 4,
    num_stages: int | None = None,
    wy_num_warps: int | None = None,
    wy_precision: str = "bf16",
    fused_output: bool = True,
    gcum: bool = True,
    scores: bool = True,
    out_block_v: int = 128,
    single_block_v: int = 128,
    row_groups: int | None = None,
    qk_l2norm: bool = False,
    normed_qk: bool | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """Same arguments and results as `chunk_gated_delta_rule_reference`; with `qk_l2norm` those of q and k
    L2-normalised over K first (in fp32, `fused_decode.L2_EPS`, rounded to v's dtype), which every kernel does as it loads
    them, so the caller writes no normalised copy.

    K, V and `chunk_size` must be powers of two (>= 16); `block_v` is clipped to V. q and k are cast to
    v's dtype (the dot operand dtype; accumulation and the state are fp32). `wy_precision` picks the WY
    stage's dots on the GPU: "bf16" (all in the input dtype), "input" (the inverse in TF32, the other dots
    in the input dtype), "tf32" or "tf32x3" (all fp32 dots in one or three TF32 passes). `gcum`: the WY
    stage stores the in-chunk cumulative g, so the sequential pass does no scan or reduction per chunk
    (otherwise it scans g). `scores` (with `gcum` and `fused_output`): the WY stage also stores the masked
    decayed scores, so the fused pass computes neither `q k^T` nor a `[C, C]` exp. `fused_output` computes
    the output inside the sequential pass; otherwise the pass stores the state entering each chunk and the
    corrected values, and a parallel kernel over all chunks (`out_block_v` values per program) computes the
    output. Rows of one token (the decode rows of a mixed step) take none of this: `_single_token_kernel`
    (`single_block_v` values per program) updates them as the decode kernel would. `row_groups` (G) overrides
    the sequential pass's programs per value tile (`_row_groups`). The defaults are the fastest
    checked configuration on the H200 (benchmarks/RESULTS.md).
    `num_stages` of the sequential pass defaults to `default_num_stages`: its loop pipelines the q and k tiles
    and the scores (80 KiB a stage in fp32 at K = 128; three stages exceed the H200's 227 KiB of shared memory).
    `normed_qk` (with `qk_l2norm` and `scores`; default `WY_NORMED_QK`): the WY stage, which normalises every
    chunk's q and k anyway, writes them, and the sequential pass reads them as they are instead of normalising
    each chunk's tiles again in its chain of chunks (the same values: one rounding of one normalisation).
    """
    if wy_precision not in _PRECISIONS:
        raise ValueError(f"unknown {wy_precision=}; choose one of {tuple(_PRECISIONS)}")
    num_tokens, _, key_dim = q.shape
    value_dim = v.shape[-1]
    c = chunk_size
    block_v = min(block_v, value_dim)
    num_stages = num_stages or default_num_stages(key_dim, jnp.dtype(v.dtype).itemsize)
    scale = key_dim**-0.5 if scale is None else scale
    scores = scores and gcum and fused_output
    q, k, v, g, beta, cu, layout = _prepare(q, k, v, g, beta, cu_seqlens, slot_ids, c, interpret)
    normed_qk = qk_l2norm and scores and (WY_NORMED_QK if normed_qk is None else normed_qk)
    wy_num_warps = wy_num_warps or WY_NUM_WARPS
    tuning = dict(chunk_size=c, block_v=block_v, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                  row_groups=row_groups, l2norm=qk_l2norm and not normed_qk)
    w, u, *extra = wy_stage(k, v, g, beta, layout, chunk_size=c, wy_precision=wy_precision, num_warps=wy_num_warps,
                            interpret=interpret, gcum=gcum, q=q if scores else None, scale=scale, l2norm=qk_l2norm,
                            write_qk=normed_qk)
    g_pass = extra[0] if gcum else g
    if fused_output:
        q_pass, k_pass = extra[2:4] if normed_qk else (q, k)  # (normed_qk implies gcum and scores)
        o, new_state = fused_state_stage(q_pass, k_pass, v, g_pass, w, u, cu, state, slot_ids, layout, scale=scale,
                                         gcum=gcum, scores=extra[1] if scores else None, **tuning)
    else:
        h, v_new, new_state = state_stage(k, g_pass, w, u, cu, state, slot_ids, layout, gcum=gcum, **tuning)
        o = output_stage(q, k, g_pass, h, v_new, layout, chunk_size=c, scale=scale, block_v=out_block_v,
                         num_warps=wy_num_warps, interpret=interpret, gcum=gcum, l2norm=qk_l2norm)
    o, new_state = single_token_stage(q, k, v, g, beta, cu, o, new_state, slot_ids, scale=scale,
                                      block_v=min(single_block_v, value_dim), num_warps=4, interpret=interpret,
                                      num_tokens=num_tokens, tail_tokens=c, l2norm=qk_l2norm)
    return o[:num_tokens], new_state
