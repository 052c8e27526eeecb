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
2. the sequential pass, grid `(B, HV, V // BV)`, over each sequence's chunks from `state[slot_ids[b]]`
   (zeros on the null slot 0), final state written back into the slot (aliased, in place under jit with a
   donated state), does no scan, reduction or `[C, C]` exp per chunk: `v_new = u - w S`,
   `o = exp(G) scale (q S) + scores v_new` and `S' = exp(G_last) S + k^T (exp(G_last - G) v_new)`, with
   G_last one scalar load (`_state_kernel`). With `fused_output=False` (`_state_only_kernel`) the pass
   stores the state entering each chunk and `v_new`, and
3. `_output_kernel`, grid `(N, HV, V // BV')`, computes the output over all chunks in parallel, as in fla.
The older forms stay selectable and tested: `gcum=False` (the pass scans g per chunk), `scores=False`,
`wy_precision="input"` or TF32 for the inverse.
Dot operands are in v's dtype (q and k are cast), accumulation, the decays and the state are fp32; w, u,
the scores, the per-chunk states and v_new are stored in v's dtype. Tokens past a chunk's end are masked
to zero on load, so their g = 0 keeps `G_last = G[C - 1]` right.
On the H200 (B1 T32768 H16 K=V=128 bf16, benchmarks/RESULTS.md): WY 0.38 ms, fused pass 0.74 ms, whole
kernel 1.15 ms against fla's 1.25 ms in the same run. The scan and the sum of g inside the sequential loop
had cost 0.35 ms (state-only pass 0.90 -> 0.55 ms without them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
    q_ref,  # [T, H, K] (whole; read only with `scores`)
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    beta_ref,  # [T, HV] (whole)
    w_ref,  # [C, K] of chunk n, value head j
    u_ref,  # [C, V]
    *extra_refs,  # [C] in-chunk cumulative g (gcum); [C, C] masked decayed scores (scores)
    chunk_size: int,
    group: int,
    precision,
    input_dots: bool,
    bf16_inverse: bool,
    gcum: bool,
    scores: bool,
    scale: float,
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
    causal = lane[:, None] >= lane[None, :]
    decay_incl = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))  # [C, C], 0 above the diagonal
    decay = jnp.where(lane[:, None] > lane[None, :], decay_incl, 0.0)  # strictly lower
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    # input_dots: k k^T and the products with the inverse take the input dtype (bf16 tensor cores, as fla's
    # kkt and w/u kernels); the inverse itself stays in fp32 dots unless bf16_inverse
    dt = v_ref.dtype if input_dots else jnp.float32
    io_dot = dot if dt == jnp.float32 else functools.partial(
        jax.lax.dot_general, preferred_element_type=jnp.float32)
    a = io_dot((k * beta[:, None]).astype(dt), k.astype(dt), _DOT_T) * decay  # [C, C] strictly lower
    eye = (lane[:, None] == lane[None, :]).astype(jnp.float32)
    inv_dot = dot
    if bf16_inverse:  # the squarings in bf16 operands (fp32 accumulation): half the tensor-core time of TF32
        inv_dot = lambda x, y, dims: jax.lax.dot_general(  # noqa: E731
            x.astype(dt), y.astype(dt), dims, precision=precision, preferred_element_type=jnp.float32)
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
        q = _load_chunk(q_ref, start, valid, j // group, slice(None))  # [C, K]
        s_ref[...] = (io_dot(q.astype(dt), k.astype(dt), _DOT_T) * (decay_incl * scale)).astype(s_ref.dtype)


def _chunk_decays(g_ref, n, start, valid, j, chunk_size: int, gcum: bool):
    """(G [C], G_last) of a chunk: loaded from the WY stage's `[N, C, HV]` G (`gcum`: no scan or reduction
    in the sequential loop), or a scan and a sum of the packed g."""
    if gcum:
        return g_ref[n, :, j], g_ref[n, chunk_size - 1, j]
    g = _load_chunk(g_ref, start, valid, j)  # [C]
    return jnp.cumsum(g), jnp.sum(g)


def _state_kernel(
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
    o_in_ref,  # [T, HV, V] zeros (whole, aliased with o_ref)
    o_ref,  # [T, HV, V] (whole)
    state_ref,  # [S, HV, K, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
    gcum: bool,
    scores: bool,
):
    """The fused pass. Per chunk: `v_new = u - w S`, `o = exp(G) scale (q S) + scores v_new` and
    `S' = exp(G_last) S + k^T (exp(G_last - G) v_new)`; the decays scale `[C, BV]` tiles, not `[C, K]` ones."""
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
    dt = w_ref.dtype  # dot operands in the input dtype (bf16 tensor cores), fp32 accumulation

    def body(c, h):
        start = seq_start + c * chunk_size
        valid = lane < seq_end - start
        n = first_chunk + c
        q = _load_chunk(q_ref, start, valid, j // group, slice(None), dtype=dt)  # [C, K]
        k = _load_chunk(k_ref, start, valid, j // group, slice(None), dtype=dt)  # [C, K]
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
):
    """The sequential part only: per chunk, snapshot S, `v_new = u - w S`,
    `S' = exp(G_last) S + k^T (exp(G_last - G) v_new)`."""
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[b]
    v_slice = pl.ds(i * block_v, block_v)
    h = state_in_ref[slot, j, :, v_slice].astype(jnp.float32)  # [K, BV]
    h = jnp.where(slot == 0, 0.0, h)
    seq_start, seq_end = cu_seqlens_ref[b], cu_seqlens_ref[b + 1]
    first_chunk = row_chunks_ref[b]
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
        k = _load_chunk(k_ref, start, valid, j // group, slice(None), dtype=dt)  # [C, K]
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
    o_in_ref,  # [T, HV, V] zeros (whole, aliased with o_ref)
    o_ref,  # [T, HV, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
    gcum: bool,
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
    cum = g_ref[...] if gcum else jnp.cumsum(_load_chunk(g_ref, start, valid, j))  # [C]
    causal = lane[:, None] >= lane[None, :]
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
    attn = (dot(q, k, _DOT_T) * (decay * scale)).astype(dt)  # [C, C]
    q_dec = (q.astype(jnp.float32) * (jnp.exp(cum) * scale)[:, None]).astype(dt)
    # an unused chunk slot (length 0) has no h written, but all its rows are masked on store
    o = dot(q_dec, h_ref[...].astype(dt), _DOT) + dot(attn, v_new_ref[...].astype(dt), _DOT)  # [C, BV]
    plt.store(o_ref.at[pl.ds(start, chunk_size), j, pl.ds(i * block_v, block_v)], o.astype(o_ref.dtype),
              mask=valid[:, None])


class _Layout(NamedTuple):
    row_chunks: Array  # [B + 1] first chunk slot of each row (cumulative)
    chunk_start: Array  # [N] first packed token of each chunk
    chunk_len: Array  # [N] tokens in each chunk, 0 for unused slots
    num_chunks: int


def _layout(cu_seqlens, num_tokens: int, batch: int, c: int) -> _Layout:
    cu = cu_seqlens.astype(jnp.int32)
    num_chunks = -(-num_tokens // c) + batch
    chunks_per_row = (cu[1:] - cu[:-1] + c - 1) // c  # [B]
    row_chunks = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_per_row)])
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    chunk_row = jnp.clip(jnp.searchsorted(row_chunks[1:], ids, side="right"), 0, batch - 1)
    chunk_start = cu[chunk_row] + (ids - row_chunks[chunk_row]) * c
    chunk_len = jnp.where(ids < row_chunks[-1], jnp.minimum(c, cu[chunk_row + 1] - chunk_start), 0)
    chunk_start = jnp.where(chunk_len > 0, chunk_start, 0)
    return _Layout(row_chunks, chunk_start, chunk_len, num_chunks)


# the WY stage's dots on the GPU: "tf32x3" / "tf32": every dot in fp32 (3xTF32 or one TF32 pass); "input":
# the inverse in TF32, k k^T and the products with the inverse in the input dtype (bf16 inputs: bf16 tensor
# cores); "bf16": the inverse's squarings in the input dtype too (fp32 accumulation)
_PRECISIONS = {"tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "tf32": None, "input": None, "bf16": None}


def wy_stage(k, v, g, beta, layout: _Layout, *, chunk_size: int, wy_precision: str, num_warps: int,
             interpret: bool, gcum: bool = False, q=None, scale: float = 1.0):
    """w, u `[N, C, HV, K|V]` (v's dtype) for every chunk, all in parallel; then the in-chunk cumulative g
    `[N, C, HV]` (fp32) with `gcum`, and given `q` the masked decayed scores `[N, C, HV, C]` (v's dtype)."""
    num_value_heads, value_dim = v.shape[1:]
    key_dim = k.shape[-1]
    group = num_value_heads // k.shape[1]
    c, n = chunk_size, layout.num_chunks
    scores = q is not None
    # fp32 dots: exact (IEEE) in the interpreter; on the GPU 3xTF32 or one TF32 pass
    precision = jax.lax.Precision.HIGHEST if interpret else _PRECISIONS[wy_precision]
    kernel = functools.partial(_wy_kernel, chunk_size=c, group=group, precision=precision,
                               input_dots=wy_precision in ("input", "bf16"), bf16_inverse=wy_precision == "bf16",
                               gcum=gcum, scores=scores, scale=scale)
    spec = lambda d: pl.BlockSpec((None, c, None, d), lambda n, j: (n, 0, j, 0))  # noqa: E731
    shape = lambda d: jax.ShapeDtypeStruct((n, c, num_value_heads, d), v.dtype)  # noqa: E731
    out_specs, out_shape = [spec(key_dim), spec(value_dim)], [shape(key_dim), shape(value_dim)]
    if gcum:
        out_specs.append(pl.BlockSpec((None, c, None), lambda n, j: (n, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((n, c, num_value_heads), jnp.float32))
    if scores:
        out_specs.append(spec(c))
        out_shape.append(shape(c))
    return pl.pallas_call(
        kernel,
        grid=(n, num_value_heads),
        in_specs=[_WHOLE] * 7,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"gdn_chunk_wy_c{c}_{wy_precision}_w{num_warps}{'_gc' if gcum else ''}{'_sc' if scores else ''}",
    )(layout.chunk_start, layout.chunk_len, k if q is None else q, k, v, g, beta)


def fused_state_stage(q, k, v, g, w, u, cu, state, slot_ids, layout: _Layout, *, chunk_size: int,
                      block_v: int, scale: float, num_warps: int, num_stages: int, interpret: bool,
                      gcum: bool = False, scores=None):
    """The sequential pass with the output computed inside it: (o [T', HV, V], new state). With `gcum`, `g`
    is the WY stage's in-chunk cumulative g; `scores` optionally its masked decayed scores."""
    num_value_heads, value_dim = v.shape[1:]
    group = num_value_heads // k.shape[1]
    kernel = functools.partial(_state_kernel, chunk_size=chunk_size, group=group, block_v=block_v, scale=scale,
                               precision=jax.lax.Precision.HIGHEST if interpret else None, gcum=gcum,
                               scores=scores is not None)
    zeros_o = jnp.zeros(v.shape, v.dtype)
    return pl.pallas_call(
        kernel,
        grid=(slot_ids.shape[0], num_value_heads, value_dim // block_v),
        in_specs=[_WHOLE] * 11,
        out_specs=[_WHOLE, _WHOLE],
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={10: 0, 9: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunk_fused_c{chunk_size}_bv{block_v}_w{num_warps}_s{num_stages}{'_gc' if gcum else ''}"
             f"{'_sc' if scores is not None else ''}",
    )(layout.row_chunks, slot_ids.astype(jnp.int32), cu, q, k, g, w, u, w if scores is None else scores, state,
      zeros_o)


def state_stage(k, g, w, u, cu, state, slot_ids, layout: _Layout, *, chunk_size: int, block_v: int,
                num_warps: int, num_stages: int, interpret: bool, gcum: bool = False):
    """The sequential pass alone: (h [N, HV, K, V] entering each chunk, v_new [N, C, HV, V], new state).
    With `gcum`, `g` is the WY stage's in-chunk cumulative g."""
    num_value_heads, key_dim, value_dim = state.shape[1:]
    group = num_value_heads // k.shape[1]
    kernel = functools.partial(_state_only_kernel, chunk_size=chunk_size, group=group, block_v=block_v,
                               precision=jax.lax.Precision.HIGHEST if interpret else None, gcum=gcum)
    n, c = layout.num_chunks, chunk_size
    return pl.pallas_call(
        kernel,
        grid=(slot_ids.shape[0], num_value_heads, value_dim // block_v),
        in_specs=[_WHOLE] * 8,
        out_specs=[_WHOLE, _WHOLE, _WHOLE],
        out_shape=[
            jax.ShapeDtypeStruct((n, num_value_heads, key_dim, value_dim), u.dtype),
            jax.ShapeDtypeStruct((n, c, num_value_heads, value_dim), u.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={7: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunk_state_c{c}_bv{block_v}_w{num_warps}_s{num_stages}{'_gc' if gcum else ''}",
    )(layout.row_chunks, slot_ids.astype(jnp.int32), cu, k, g, w, u, state)


def output_stage(q, k, g, h, v_new, layout: _Layout, *, chunk_size: int, scale: float, block_v: int,
                 num_warps: int, interpret: bool, gcum: bool = False):
    """All chunks in parallel: o [T', HV, V] from the per-chunk states and corrected values."""
    num_value_heads, key_dim, value_dim = h.shape[1:]
    group = num_value_heads // k.shape[1]
    c, out_bv = chunk_size, min(block_v, value_dim)
    kernel = functools.partial(_output_kernel, chunk_size=c, group=group, block_v=out_bv, scale=scale,
                               precision=jax.lax.Precision.HIGHEST if interpret else None, gcum=gcum)
    zeros_o = jnp.zeros((q.shape[0], num_value_heads, value_dim), v_new.dtype)
    g_spec = pl.BlockSpec((None, c, None), lambda n, j, i: (n, 0, j)) if gcum else _WHOLE
    return pl.pallas_call(
        kernel,
        grid=(layout.num_chunks, num_value_heads, value_dim // out_bv),
        in_specs=[_WHOLE] * 4 + [
            g_spec,
            pl.BlockSpec((None, None, key_dim, out_bv), lambda n, j, i: (n, j, 0, i)),  # h
            pl.BlockSpec((None, c, None, out_bv), lambda n, j, i: (n, 0, j, i)),  # v_new
            _WHOLE,
        ],
        out_specs=_WHOLE,
        out_shape=jax.ShapeDtypeStruct(zeros_o.shape, zeros_o.dtype),
        input_output_aliases={7: 0},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        name=f"gdn_chunk_output_c{c}_bv{out_bv}_w{num_warps}{'_gc' if gcum else ''}",
    )(layout.chunk_start, layout.chunk_len, q, k, g, h, v_new, zeros_o)


def _prepare(q, k, v, g, beta, cu_seqlens, slot_ids, chunk_size, interpret):
    """Dot operands in one dtype, the chunk layout, and interpreter padding."""
    q, k = q.astype(v.dtype), k.astype(v.dtype)  # the model passes fp32 q/k with bf16 v
    layout = _layout(cu_seqlens, q.shape[0], slot_ids.shape[0], chunk_size)
    if interpret:  # the interpreter clamps windows that run past the end: pad instead (GPU loads are masked)
        pad = lambda x: jnp.pad(x, ((0, chunk_size),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
        q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    return q, k, v, g, beta, cu_seqlens.astype(jnp.int32), layout


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "chunk_size", "block_v", "num_warps", "num_stages", "wy_num_warps", "wy_precision",
        "fused_output", "gcum", "scores", "out_block_v", "interpret",
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
    wy_num_warps: int = 4,
    wy_precision: str = "bf16",
    fused_output: bool = True,
    gcum: bool = True,
    scores: bool = True,
    out_block_v: int = 128,
    interpret: bool = False,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """Same arguments and results as `chunk_gated_delta_rule_reference`.

    K, V and `chunk_size` must be powers of two (>= 16); `block_v` is clipped to V. q and k are cast to
    v's dtype (the dot operand dtype; accumulation and the state are fp32). `wy_precision` picks the WY
    stage's dots on the GPU: "bf16" (all in the input dtype), "input" (the inverse in TF32, the other dots
    in the input dtype), "tf32" or "tf32x3" (all fp32 dots in one or three TF32 passes). `gcum`: the WY
    stage stores the in-chunk cumulative g, so the sequential pass does no scan or reduction per chunk
    (otherwise it scans g). `scores` (with `gcum` and `fused_output`): the WY stage also stores the masked
    decayed scores, so the fused pass computes neither `q k^T` nor a `[C, C]` exp. `fused_output` computes
    the output inside the sequential pass; otherwise the pass stores the state entering each chunk and the
    corrected values, and a parallel kernel over all chunks (`out_block_v` values per program) computes the
    output. The defaults are the fastest checked configuration on the H200 (benchmarks/RESULTS.md).
    `num_stages` of the sequential pass defaults to 3, or 2 for 4-byte inputs: its loop pipelines the q and
    k tiles and the scores (80 KiB a stage in fp32; three stages exceed the H200's 227 KiB of shared memory).
    """
    if wy_precision not in _PRECISIONS:
        raise ValueError(f"unknown {wy_precision=}; choose one of {tuple(_PRECISIONS)}")
    num_tokens, _, key_dim = q.shape
    value_dim = v.shape[-1]
    c = chunk_size
    block_v = min(block_v, value_dim)
    num_stages = num_stages or (3 if jnp.dtype(v.dtype).itemsize <= 2 else 2)
    scale = key_dim**-0.5 if scale is None else scale
    scores = scores and gcum and fused_output
    q, k, v, g, beta, cu, layout = _prepare(q, k, v, g, beta, cu_seqlens, slot_ids, c, interpret)
    tuning = dict(chunk_size=c, block_v=block_v, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    w, u, *extra = wy_stage(k, v, g, beta, layout, chunk_size=c, wy_precision=wy_precision, num_warps=wy_num_warps,
                            interpret=interpret, gcum=gcum, q=q if scores else None, scale=scale)
    g_pass = extra[0] if gcum else g
    if fused_output:
        o, new_state = fused_state_stage(q, k, v, g_pass, w, u, cu, state, slot_ids, layout, scale=scale, gcum=gcum,
                                         scores=extra[1] if scores else None, **tuning)
        return o[:num_tokens], new_state
    h, v_new, new_state = state_stage(k, g_pass, w, u, cu, state, slot_ids, layout, gcum=gcum, **tuning)
    o = output_stage(q, k, g_pass, h, v_new, layout, chunk_size=c, scale=scale, block_v=out_block_v,
                     num_warps=wy_num_warps, interpret=interpret, gcum=gcum)
    return o[:num_tokens], new_state
