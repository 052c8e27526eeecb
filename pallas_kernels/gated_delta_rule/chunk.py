"""Pallas (Triton lowering) kernels for the chunked (WY) gated delta rule over ragged packed sequences.

Chunks are laid out as in `chunk_gated_delta_rule_reference`: each sequence is cut into chunks of C
tokens starting at its first token, `N = ceil(T / C) + B` chunk slots bound the count statically. The
kernels read the packed tokens directly (a chunk is a masked `[C, ...]` window starting at its first
token), so nothing is gathered into chunk buffers.

1. `_wy_kernel`, grid `(N, HV)`, all chunks in parallel: the in-chunk cumulative decay G, the strictly
   lower `A = beta_i k_i.k_j exp(G_i - G_j)`, `W = (I + A)^-1` by the product form
   `(I - A)(I + A^2)(I + A^4)...` (A is nilpotent, so log2(C) squarings are exact), and the
   pseudo-values `u = W (beta v)` and read-outs `w = W (beta exp(G) k)`, stored per chunk.
2. The state pass, grid `(B, HV, V // BV)`, sequential over each sequence's chunks from
   `state[slot_ids[b]]` (zeros on the null slot 0), final state written back into the slot (aliased, in
   place under jit with a donated state). Per chunk: `v_new = u - w S`,
   `S' = exp(G_last) S + (k exp(G_last - G))^T v_new`, and the output
   `o = (q exp(G)) S + lower(q.k exp(G_i - G_j)) v_new`, either inside the pass (`fused_output=True`,
   `_state_kernel`, the default) or, as in fla, by a parallel `_output_kernel` over all chunks from the
   per-chunk states and `v_new` that `_state_only_kernel` stores (`fused_output=False`).
Dot operands are in v's dtype (bf16 tensor cores for bf16 inputs; q and k are cast), accumulation, the
decays and the state are fp32; w and u are stored in v's dtype.
Tokens past a chunk's end are masked to zero on load, so their g = 0 keeps `G_last = G[C - 1]` right.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

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
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    beta_ref,  # [T, HV] (whole)
    w_ref,  # [C, K] of chunk n, value head j
    u_ref,  # [C, V]
    *,
    chunk_size: int,
    group: int,
    precision,
):
    n, j = pl.program_id(0), pl.program_id(1)
    start, length = chunk_start_ref[n], chunk_len_ref[n]
    lane = jnp.arange(chunk_size)
    valid = lane < length
    k = _load_chunk(k_ref, start, valid, j // group, slice(None))  # [C, K]
    v = _load_chunk(v_ref, start, valid, j, slice(None))  # [C, V]
    g = _load_chunk(g_ref, start, valid, j)  # [C]
    beta = _load_chunk(beta_ref, start, valid, j)  # [C]
    cum = jnp.cumsum(g)  # [C]
    strict = lane[:, None] > lane[None, :]
    decay = jnp.exp(jnp.where(strict, cum[:, None] - cum[None, :], -jnp.inf))  # [C, C], 0 on/above diag
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    a = dot(k * beta[:, None], k, _DOT_T) * decay  # [C, C] strictly lower
    eye = (lane[:, None] == lane[None, :]).astype(jnp.float32)
    x = -a
    inv = eye + x  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...
    steps = chunk_size.bit_length() - 2  # log2(C) - 1 more factors
    for _ in range(steps):
        x = dot(x, x, _DOT)
        inv = inv + dot(inv, x, _DOT)
    u_ref[...] = dot(inv, v * beta[:, None], _DOT).astype(u_ref.dtype)
    w_ref[...] = dot(inv, k * (beta * jnp.exp(cum))[:, None], _DOT).astype(w_ref.dtype)


def _state_kernel(
    row_chunks_ref,  # [B + 1] first chunk slot of each row (cumulative)
    slot_ids_ref,  # [B]
    cu_seqlens_ref,  # [B + 1]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    g_ref,  # [T, HV] (whole)
    w_ref,  # [N, C, HV, K] (whole)
    u_ref,  # [N, C, HV, V] (whole)
    state_in_ref,  # [S, HV, K, V] (whole, aliased with state_ref)
    o_in_ref,  # [T, HV, V] zeros (whole, aliased with o_ref)
    o_ref,  # [T, HV, V] (whole)
    state_ref,  # [S, HV, K, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
):
    del o_in_ref
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[b]
    v_slice = pl.ds(i * block_v, block_v)
    h = state_in_ref[slot, j, :, v_slice].astype(jnp.float32)  # [K, BV]
    h = jnp.where(slot == 0, 0.0, h)
    seq_start, seq_end = cu_seqlens_ref[b], cu_seqlens_ref[b + 1]
    first_chunk = row_chunks_ref[b]
    lane = jnp.arange(chunk_size)
    causal = lane[:, None] >= lane[None, :]
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)

    def body(c, h):
        start = seq_start + c * chunk_size
        valid = lane < seq_end - start
        dt = q_ref.dtype  # dot operands in the input dtype (bf16 tensor cores), fp32 accumulation
        q = _load_chunk(q_ref, start, valid, j // group, slice(None), dtype=dt)  # [C, K]
        k = _load_chunk(k_ref, start, valid, j // group, slice(None), dtype=dt)  # [C, K]
        g = _load_chunk(g_ref, start, valid, j)  # [C]
        cum = jnp.cumsum(g)
        cum_last = jnp.sum(g)
        w = w_ref[first_chunk + c, :, j, :]  # [C, K]
        u = u_ref[first_chunk + c, :, j, v_slice].astype(jnp.float32)  # [C, BV]
        v_new = u - dot(w, h.astype(w.dtype), _DOT)  # [C, BV]
        decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
        attn = (dot(q, k, _DOT_T) * (decay * scale)).astype(dt)  # [C, C]
        q_dec = (q.astype(jnp.float32) * (jnp.exp(cum) * scale)[:, None]).astype(dt)
        o = dot(q_dec, h.astype(dt), _DOT) + dot(attn, v_new.astype(dt), _DOT)  # [C, BV]
        plt.store(o_ref.at[pl.ds(start, chunk_size), j, v_slice], o.astype(o_ref.dtype), mask=valid[:, None])
        k_dec = (k.astype(jnp.float32) * jnp.exp(cum_last - cum)[:, None]).astype(dt)
        return jnp.exp(cum_last) * h + dot(k_dec, v_new.astype(dt), _T_DOT)

    num_chunks = (seq_end - seq_start + chunk_size - 1) // chunk_size
    h = jax.lax.fori_loop(0, num_chunks, body, h)
    state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def _state_only_kernel(
    row_chunks_ref,  # [B + 1]
    slot_ids_ref,  # [B]
    cu_seqlens_ref,  # [B + 1]
    k_ref,  # [T, H, K] (whole)
    g_ref,  # [T, HV] (whole)
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
):
    """The sequential part only: per chunk, snapshot S, v_new = u - w S, S' = decay S + k_dec^T v_new."""
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[b]
    v_slice = pl.ds(i * block_v, block_v)
    h = state_in_ref[slot, j, :, v_slice].astype(jnp.float32)  # [K, BV]
    h = jnp.where(slot == 0, 0.0, h)
    seq_start, seq_end = cu_seqlens_ref[b], cu_seqlens_ref[b + 1]
    first_chunk = row_chunks_ref[b]
    lane = jnp.arange(chunk_size)
    dt = k_ref.dtype
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)

    def body(c, h):
        start = seq_start + c * chunk_size
        valid = lane < seq_end - start
        n = first_chunk + c
        k = _load_chunk(k_ref, start, valid, j // group, slice(None))  # [C, K] fp32
        g = _load_chunk(g_ref, start, valid, j)  # [C]
        cum = jnp.cumsum(g)
        cum_last = jnp.sum(g)
        h_ref[n, j, :, v_slice] = h.astype(h_ref.dtype)
        v_new = u_ref[n, :, j, v_slice].astype(jnp.float32) - dot(w_ref[n, :, j, :], h.astype(dt), _DOT)
        v_new_ref[n, :, j, v_slice] = v_new.astype(v_new_ref.dtype)
        k_dec = (k * jnp.exp(cum_last - cum)[:, None]).astype(dt)
        return jnp.exp(cum_last) * h + dot(k_dec, v_new.astype(dt), _T_DOT)

    num_chunks = (seq_end - seq_start + chunk_size - 1) // chunk_size
    h = jax.lax.fori_loop(0, num_chunks, body, h)
    state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def _output_kernel(
    chunk_start_ref,  # [N]
    chunk_len_ref,  # [N]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    g_ref,  # [T, HV] (whole)
    h_ref,  # [K, BV] state entering chunk n
    v_new_ref,  # [C, BV]
    o_in_ref,  # [T, HV, V] zeros (whole, aliased with o_ref)
    o_ref,  # [T, HV, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
):
    """All chunks in parallel: o = (q exp(G)) S_n + lower(q.k exp(G_i - G_j)) v_new."""
    del o_in_ref
    n, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length = chunk_start_ref[n], chunk_len_ref[n]
    lane = jnp.arange(chunk_size)
    valid = lane < length
    dt = q_ref.dtype
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    q = _load_chunk(q_ref, start, valid, j // group, slice(None), dtype=dt)  # [C, K]
    k = _load_chunk(k_ref, start, valid, j // group, slice(None), dtype=dt)
    cum = jnp.cumsum(_load_chunk(g_ref, start, valid, j))  # [C]
    causal = lane[:, None] >= lane[None, :]
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
    attn = (dot(q, k, _DOT_T) * (decay * scale)).astype(dt)  # [C, C]
    q_dec = (q.astype(jnp.float32) * (jnp.exp(cum) * scale)[:, None]).astype(dt)
    # an unused chunk slot (length 0) has no h written, but all its rows are masked on store
    o = dot(q_dec, h_ref[...].astype(dt), _DOT) + dot(attn, v_new_ref[...].astype(dt), _DOT)  # [C, BV]
    plt.store(o_ref.at[pl.ds(start, chunk_size), j, pl.ds(i * block_v, block_v)], o.astype(o_ref.dtype),
              mask=valid[:, None])


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "chunk_size", "block_v", "num_warps", "num_stages", "wy_num_warps", "fused_output", "interpret",
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
    block_v: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    wy_num_warps: int = 4,
    fused_output: bool = True,
    interpret: bool = False,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """Same arguments and results as `chunk_gated_delta_rule_reference`.

    K, V and `chunk_size` must be powers of two (>= 16); `block_v` is clipped to V. q and k are cast to
    v's dtype (the dot operand dtype; accumulation and the state are fp32). `fused_output`
    computes the output inside the sequential state pass; otherwise the pass stores the state entering
    each chunk and the corrected values, and a parallel kernel over all chunks computes the output.
    """
    num_tokens, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1:]
    batch = slot_ids.shape[0]
    group = num_value_heads // num_heads
    c = chunk_size
    block_v = min(block_v, value_dim)
    num_chunks = -(-num_tokens // c) + batch
    scale = key_dim**-0.5 if scale is None else scale
    # fp32 dots: exact (IEEE) in the interpreter; 3xTF32 on the GPU for the inverse, TF32 for the rest.
    wy_precision = jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    state_precision = jax.lax.Precision.HIGHEST if interpret else None

    # one dtype for every dot operand: q and k take v's (the model passes fp32 q/k with bf16 v)
    q, k = q.astype(v.dtype), k.astype(v.dtype)
    cu = cu_seqlens.astype(jnp.int32)
    chunks_per_row = (cu[1:] - cu[:-1] + c - 1) // c  # [B]
    row_chunks = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_per_row)])  # [B + 1]
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    chunk_row = jnp.clip(jnp.searchsorted(row_chunks[1:], ids, side="right"), 0, batch - 1)
    chunk_start = cu[chunk_row] + (ids - row_chunks[chunk_row]) * c
    chunk_len = jnp.where(ids < row_chunks[-1], jnp.minimum(c, cu[chunk_row + 1] - chunk_start), 0)
    chunk_start = jnp.where(chunk_len > 0, chunk_start, 0)

    if interpret:  # the interpreter clamps windows that run past the end: pad instead (GPU loads are masked)
        pad = lambda x: jnp.pad(x, ((0, c),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
        q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    padded_tokens = q.shape[0]

    wy = functools.partial(_wy_kernel, chunk_size=c, group=group, precision=wy_precision)
    w, u = pl.pallas_call(
        wy,
        grid=(num_chunks, num_value_heads),
        in_specs=[_WHOLE] * 6,
        out_specs=[
            pl.BlockSpec((None, c, None, key_dim), lambda n, j: (n, 0, j, 0)),
            pl.BlockSpec((None, c, None, value_dim), lambda n, j: (n, 0, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_chunks, c, num_value_heads, key_dim), v.dtype),
            jax.ShapeDtypeStruct((num_chunks, c, num_value_heads, value_dim), v.dtype),
        ],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=wy_num_warps, num_stages=1),
        name=f"gdn_chunk_wy_c{c}_w{wy_num_warps}",
    )(chunk_start, chunk_len, k, v, g, beta)

    zeros_o = jnp.zeros((padded_tokens, num_value_heads, value_dim), v.dtype)
    if fused_output:
        kernel = functools.partial(
            _state_kernel, chunk_size=c, group=group, block_v=block_v, scale=scale, precision=state_precision
        )
        o, new_state = pl.pallas_call(
            kernel,
            grid=(batch, num_value_heads, value_dim // block_v),
            in_specs=[_WHOLE] * 10,
            out_specs=[_WHOLE, _WHOLE],
            out_shape=[
                jax.ShapeDtypeStruct((padded_tokens, num_value_heads, value_dim), v.dtype),
                jax.ShapeDtypeStruct(state.shape, state.dtype),
            ],
            input_output_aliases={9: 0, 8: 1},
            interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name=f"gdn_chunk_fused_c{c}_bv{block_v}_w{num_warps}_s{num_stages}",
        )(row_chunks, slot_ids.astype(jnp.int32), cu, q, k, g, w, u, state, zeros_o)
        return o[:num_tokens], new_state

    kernel = functools.partial(_state_only_kernel, chunk_size=c, group=group, block_v=block_v,
                               precision=state_precision)
    h, v_new, new_state = pl.pallas_call(
        kernel,
        grid=(batch, num_value_heads, value_dim // block_v),
        in_specs=[_WHOLE] * 8,
        out_specs=[_WHOLE, _WHOLE, _WHOLE],
        out_shape=[
            jax.ShapeDtypeStruct((num_chunks, num_value_heads, key_dim, value_dim), v.dtype),
            jax.ShapeDtypeStruct((num_chunks, c, num_value_heads, value_dim), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={7: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunk_state_c{c}_bv{block_v}_w{num_warps}_s{num_stages}",
    )(row_chunks, slot_ids.astype(jnp.int32), cu, k, g, w, u, state)

    out_bv = min(64, value_dim)
    kernel = functools.partial(_output_kernel, chunk_size=c, group=group, block_v=out_bv, scale=scale,
                               precision=state_precision)
    o = pl.pallas_call(
        kernel,
        grid=(num_chunks, num_value_heads, value_dim // out_bv),
        in_specs=[_WHOLE] * 5 + [
            pl.BlockSpec((None, None, key_dim, out_bv), lambda n, j, i: (n, j, 0, i)),  # h
            pl.BlockSpec((None, c, None, out_bv), lambda n, j, i: (n, 0, j, i)),  # v_new
            _WHOLE,
        ],
        out_specs=_WHOLE,
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_value_heads, value_dim), v.dtype),
        input_output_aliases={7: 0},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=wy_num_warps, num_stages=2),
        name=f"gdn_chunk_output_c{c}_bv{out_bv}_w{wy_num_warps}",
    )(chunk_start, chunk_len, q, k, g, h, v_new, zeros_o)
    return o[:num_tokens], new_state
