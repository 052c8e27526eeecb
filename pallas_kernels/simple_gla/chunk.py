"""Pallas (Triton lowering) kernels for the chunked scalar-decay recurrence (simple GLA) over ragged packed
sequences.

Chunks are laid out as in `chunk_gated_delta_rule_pallas` (the same `_layout`): each row of more than one
token is cut into chunks of C tokens starting at its first token, `N = ceil(T / C) + B` chunk slots bound the
count statically, and the kernels read the packed tokens directly (a chunk is a masked `[C, ...]` window
starting at its first token). Per chunk, with G the in-chunk cumulative sum of g and S the state entering it:

    o  = scale exp(G) (q S) + lower(scale q_i.k_j exp(G_i - G_j)) v
    S' = exp(G_last) S + k^T (exp(G_last - G) v)

Unlike the gated delta rule there is no WY stage: the state update needs no output and no inverse. Two forms:
  * `fused_output=True`: one sequential pass, grid `(G, HV, V // BV)` (program g walks the g-th, (g+G)-th, ...
    row of more than one token, `_row_groups`), computing each chunk's output from the state it carries
    (`_fused_kernel`);
  * `fused_output=False`: the sequential pass only updates the state and stores the state entering each chunk
    (`_state_kernel`, one `[K, C] x [C, BV]` dot per chunk); `_output_kernel`, grid `(N, HV, V // BV')`, then
    computes every chunk's output in parallel.
Rows start from `state[slot_ids[b]]` (zeros on the null slot 0) and their final state is written back into the
slot (aliased, in place under jit with a donated state). Rows of exactly one token (a serving step's decode
rows) take neither form: `_single_token_kernel`, grid `(B, HV, V // BV'')`, applies the decode kernel's
recurrent update (`fused_recurrent.recurrent_step`), so a mixed step costs a decode step per such row, not a
`[C, ...]` chunk; its programs past the last row write the padding tokens' zeros (the output is not
zero-filled first). Programs with nothing to do exit at once.

Dot operands are in v's dtype (q and k are cast; bf16 tensor cores for bf16 v), accumulation, the decays and
the carried state are fp32; per-chunk states are stored in v's dtype. fp32 operands (Mamba2 passes fp32
q/k/v) use TF32 on the GPU unless `precision="tf32x3"`. Every exponent is <= 0, so large decays underflow.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.gated_delta_rule.chunk import (_for_each_multi_row, _layout, _Layout, _row_groups, padding_programs,
                                                   zero_padding)
from pallas_kernels.null_slot import load_state
from pallas_kernels.simple_gla.fused_recurrent import recurrent_step

_WHOLE = pl.no_block_spec  # the whole array, indexed inside the kernel
_DOT = (((1,), (0,)), ((), ()))  # a @ b
_DOT_T = (((1,), (1,)), ((), ()))  # a @ b.T
_T_DOT = (((0,), (0,)), ((), ()))  # a.T @ b

# fp32 dot operands on the GPU: one TF32 pass (Triton's default) or three (about fp32 accuracy)
_PRECISIONS = {"tf32": None, "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def _load(ref, start, valid, *idx, dtype=jnp.float32):
    """Masked `[C, ...]` window of packed tokens `ref[start:start + C, *idx]`; zeros past the chunk. An index
    in `idx` is a scalar (dropped dim) or a `pl.ds` (kept dim)."""
    kept = sum(not isinstance(i, (int, jax.Array)) for i in idx)
    mask = valid.reshape(valid.shape + (1,) * kept)
    return plt.load(ref.at[(pl.ds(start, valid.shape[0]), *idx)], mask=mask, other=0).astype(dtype)


class Mamba2Inputs(NamedTuple):
    """Where a Mamba2 mixer's q (C), k (B) and x sit in its conv output `xbc [T, Cm]` (before the SiLU; columns
    `x | B | C`): the kernels read them there, apply the SiLU, scale x by the step size (`v = x dt`) and add the
    D skip (`o + D x`) themselves, so no fp32 copy of B, C, v or the output is written (`chunk_mamba2_pallas`)."""

    head_dim: int  # P: head j's x at columns [j P, (j + 1) P)
    state_dim: int  # N: group i's B at [b_offset + i N, ...), its C at [b_offset + G N + i N, ...)
    b_offset: int  # H P
    num_groups: int  # G
    gated: bool = False  # the output is the gated norm's input `y z_gate` (`chunk_mamba2_pallas`'s z)
    dot_dtype: str = "float32"  # B, C and v rounded to this for the dots, the per-chunk states and o (the parts' scan)


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _mamba2_out(o, x, d, z, m2: Mamba2Inputs, out_dtype):
    """`y = o + D x` (x the SiLU'd values; o rounded to `m2.dot_dtype` first, as the parts' scan returns it) in
    `out_dtype`; with `m2.gated`, `y` so rounded times SiLU(z) in fp32 (z `[..., BV]` the gate's columns)."""
    y = (o.astype(m2.dot_dtype).astype(jnp.float32) + d * x).astype(out_dtype)
    return y.astype(jnp.float32) * _silu(z.astype(jnp.float32)) if m2.gated else y


def _mamba2_columns(m2: Mamba2Inputs, j, group: int, v_slice):
    """Where value head j reads its key group's B and C (`[N]` column windows of the conv output) and its values
    `v_slice` (a `[BV]` window: of x in the conv output, of the gate z in the in_proj output)."""
    b_cols = m2.b_offset + (j // group) * m2.state_dim
    return (pl.ds(b_cols, m2.state_dim), pl.ds(b_cols + m2.num_groups * m2.state_dim, m2.state_dim),
            pl.ds(j * m2.head_dim + v_slice.start, v_slice.size))


def _chunk_keys_values(k_ref, v_ref, g_ref, start, valid, j, v_slice, group: int, dt, m2=None, dt_ref=None,
                       k_slice=None):
    """k `[C, K]` (`[C, BK]`: the key columns `k_slice`, where given) and v `[C, BV]` (dot dtype `dt`), the
    in-chunk cumulative g `[C]` and its last value; with `m2` (`Mamba2Inputs`: k_ref = v_ref the conv output,
    `dt_ref [T, HV]` the step sizes) also SiLU(x) `[C, BV]` fp32, the D skip's input (else None)."""
    g = _load(g_ref, start, valid, j)  # [C], zeros past the end keep G flat there
    if m2 is None:
        k = _load(k_ref, start, valid, j // group, k_slice or pl.ds(0, k_ref.shape[-1]), dtype=dt)
        v = _load(v_ref, start, valid, j, v_slice, dtype=dt)
        return k, v, jnp.cumsum(g), jnp.sum(g), None
    b_cols, _, x_cols = _mamba2_columns(m2, j, group, v_slice)
    if k_slice is not None:
        b_cols = pl.ds(b_cols.start + k_slice.start, k_slice.size)
    k = _silu(_load(k_ref, start, valid, b_cols)).astype(dt)
    x = _silu(_load(v_ref, start, valid, x_cols))
    v = (x * _load(dt_ref, start, valid, j)[:, None]).astype(dt)
    return k, v, jnp.cumsum(g), jnp.sum(g), x


def _chunk_inputs(q_ref, k_ref, v_ref, g_ref, start, valid, j, v_slice, group: int, dt, m2=None, dt_ref=None):
    """q `[C, K]` (dot dtype `dt`; with `m2`, C read from the conv output and SiLU'd), then
    `_chunk_keys_values`'s k, v, cumulative g, its last value and SiLU(x)."""
    if m2 is None:
        q = _load(q_ref, start, valid, j // group, pl.ds(0, q_ref.shape[-1]), dtype=dt)
    else:
        q = _silu(_load(q_ref, start, valid, _mamba2_columns(m2, j, group, v_slice)[1])).astype(dt)
    return (q, *_chunk_keys_values(k_ref, v_ref, g_ref, start, valid, j, v_slice, group, dt, m2, dt_ref))


def _intra_output(q, k, v, h, cum, *, scale: float, dot):
    """`scale exp(G) (q S) + lower(scale q_i.k_j exp(G_i - G_j)) v`: `[C, BV]` in fp32; h is `[K, BV]` in the
    dot dtype. The decays scale `[C, C]` and `[C, BV]` tiles, never `[C, K]` ones."""
    lane = jnp.arange(q.shape[0])
    causal = lane[:, None] >= lane[None, :]
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))  # [C, C], 0 above the diagonal
    scores = (dot(q, k, _DOT_T) * (decay * scale)).astype(v.dtype)  # [C, C]
    return dot(q, h, _DOT) * (jnp.exp(cum) * scale)[:, None] + dot(scores, v, _DOT)


def _advance(h, k, v, cum, cum_last, *, dot):
    """`exp(G_last) S + k^T (exp(G_last - G) v)`: the state leaving the chunk, fp32 `[K, BV]`."""
    v_dec = (v.astype(jnp.float32) * jnp.exp(cum_last - cum)[:, None]).astype(v.dtype)
    return jnp.exp(cum_last) * h + dot(k, v_dec, _T_DOT)


def _fused_kernel(
    num_multi_ref,  # [1] rows of more than one token
    multi_rows_ref,  # [B] those rows first
    slot_ids_ref,  # [B]
    cu_seqlens_ref,  # [B + 1]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    dt_ref,  # [T, HV] (whole) Mamba2's step sizes (`mamba2`), else unused
    d_ref,  # [HV] Mamba2's D (`mamba2`), else unused
    z_ref,  # [T, >= HV V] (whole) Mamba2's gate (`mamba2.gated`), else unused
    state_in_ref,  # [S, HV, K, V] (whole, aliased with state_ref)
    o_ref,  # [T, HV, V] (whole; tokens of no multi-token row are `_single_token_kernel`'s)
    state_ref,  # [S, HV, K, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
    row_groups: int,
    mamba2: Mamba2Inputs | None,
    out_dtype,
):
    """The sequential pass with the output: per chunk, o from the carried state, then the state advanced. With
    `mamba2`, q_ref = k_ref = v_ref is the conv output (`Mamba2Inputs`) and the output is `_mamba2_out`'s."""
    j, i = pl.program_id(1), pl.program_id(2)
    v_slice = pl.ds(i * block_v, block_v)
    lane = jnp.arange(chunk_size)
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    dt = jnp.dtype(mamba2.dot_dtype) if mamba2 else v_ref.dtype

    def row(b):  # empty rows and one-token rows (`_single_token_kernel`) never come here
        slot = slot_ids_ref[b]
        seq_start, seq_end = cu_seqlens_ref[b], cu_seqlens_ref[b + 1]

        def body(c, h):
            start = seq_start + c * chunk_size
            valid = lane < seq_end - start
            q, k, v, cum, cum_last, x = _chunk_inputs(q_ref, k_ref, v_ref, g_ref, start, valid, j, v_slice, group,
                                                      dt, mamba2, dt_ref)
            o = _intra_output(q, k, v, h.astype(dt), cum, scale=scale, dot=dot)
            if mamba2:  # the D skip (and the gate)
                z = _load(z_ref, start, valid, _mamba2_columns(mamba2, j, group, v_slice)[2]) if mamba2.gated else None
                o = _mamba2_out(o, x, d_ref[j], z, mamba2, out_dtype)
            plt.store(o_ref.at[pl.ds(start, chunk_size), j, v_slice], o.astype(o_ref.dtype), mask=valid[:, None])
            return _advance(h, k, v, cum, cum_last, dot=dot)

        h = jnp.where(slot == 0, 0.0, state_in_ref[slot, j, :, v_slice].astype(jnp.float32))  # [K, BV]
        h = jax.lax.fori_loop(0, (seq_end - seq_start + chunk_size - 1) // chunk_size, body, h)

        @pl.when(slot != 0)
        def _():
            state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)

    _for_each_multi_row(num_multi_ref, multi_rows_ref, row_groups, row)


def _state_kernel(
    num_multi_ref,  # [1]
    multi_rows_ref,  # [B]
    row_chunks_ref,  # [B + 1] first chunk slot of each row (cumulative)
    slot_ids_ref,  # [B]
    cu_seqlens_ref,  # [B + 1]
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    dt_ref,  # [T, HV] (whole) Mamba2's step sizes (`mamba2`), else unused
    state_in_ref,  # [S, HV, K, V] (whole, aliased with state_ref)
    h_ref,  # [N, HV, K, V] (whole) the state entering each chunk
    state_ref,  # [S, HV, K, V] (whole)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    block_k: int,
    precision,
    row_groups: int,
    mamba2: Mamba2Inputs | None,
):
    """The sequential pass alone: per chunk, store the state entering it, then advance it. Program (g, j, i) holds
    the `[BK, BV]` block `divmod(i, K / BK)` of head j's state: with no output to compute, the update
    `exp(G_last) S + k^T (exp(G_last - G) v)` never mixes key columns, so blocks of K run apart. With `mamba2`,
    k_ref = v_ref is the conv output (`Mamba2Inputs`)."""
    j, i = pl.program_id(1), pl.program_id(2)
    num_k = state_in_ref.shape[2] // block_k
    v_slice = pl.ds((i // num_k) * block_v, block_v)
    k_slice = pl.ds((i % num_k) * block_k, block_k)
    lane = jnp.arange(chunk_size)
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    dt = jnp.dtype(mamba2.dot_dtype) if mamba2 else v_ref.dtype

    def row(b):
        slot = slot_ids_ref[b]
        seq_start, seq_end, first_chunk = cu_seqlens_ref[b], cu_seqlens_ref[b + 1], row_chunks_ref[b]

        def body(c, h):
            start = seq_start + c * chunk_size
            valid = lane < seq_end - start
            h_ref[first_chunk + c, j, k_slice, v_slice] = h.astype(h_ref.dtype)
            k, v, cum, cum_last, _ = _chunk_keys_values(k_ref, v_ref, g_ref, start, valid, j, v_slice, group, dt,
                                                        mamba2, dt_ref, k_slice)
            return _advance(h, k, v, cum, cum_last, dot=dot)

        h = jnp.where(slot == 0, 0.0, state_in_ref[slot, j, k_slice, v_slice].astype(jnp.float32))  # [BK, BV]
        h = jax.lax.fori_loop(0, (seq_end - seq_start + chunk_size - 1) // chunk_size, body, h)

        @pl.when(slot != 0)
        def _():
            state_ref[slot, j, k_slice, v_slice] = h.astype(state_ref.dtype)

    _for_each_multi_row(num_multi_ref, multi_rows_ref, row_groups, row)


def _output_kernel(
    chunk_start_ref,  # [N] first packed token of each chunk
    chunk_len_ref,  # [N] tokens in each chunk (0 for unused chunk slots)
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    dt_ref,  # [T, HV] (whole) Mamba2's step sizes (`mamba2`), else unused
    d_ref,  # [HV] Mamba2's D (`mamba2`), else unused
    z_ref,  # [T, >= HV V] (whole) Mamba2's gate (`mamba2.gated`), else unused
    h_ref,  # [K, BV] the state entering chunk n
    o_ref,  # [T, HV, V] (whole; tokens of no multi-token row are `_single_token_kernel`'s)
    *,
    chunk_size: int,
    group: int,
    block_v: int,
    scale: float,
    precision,
    mamba2: Mamba2Inputs | None,
    out_dtype,
):
    """All chunks in parallel: each chunk's output from the state entering it. `mamba2` as `_fused_kernel`'s."""
    n, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = chunk_len_ref[n]

    @pl.when(length > 0)  # unused chunk slots (and one-token rows, which have none) do nothing
    def _():
        start = chunk_start_ref[n]
        valid = jnp.arange(chunk_size) < length
        v_slice = pl.ds(i * block_v, block_v)
        dt = jnp.dtype(mamba2.dot_dtype) if mamba2 else v_ref.dtype
        dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
        q, k, v, cum, _, x = _chunk_inputs(q_ref, k_ref, v_ref, g_ref, start, valid, j, v_slice, group, dt, mamba2,
                                           dt_ref)
        o = _intra_output(q, k, v, h_ref[...].astype(dt), cum, scale=scale, dot=dot)
        if mamba2:  # the D skip (and the gate)
            z = _load(z_ref, start, valid, _mamba2_columns(mamba2, j, group, v_slice)[2]) if mamba2.gated else None
            o = _mamba2_out(o, x, d_ref[j], z, mamba2, out_dtype)
        plt.store(o_ref.at[pl.ds(start, chunk_size), j, v_slice], o.astype(o_ref.dtype), mask=valid[:, None])


def _single_token_kernel(
    cu_seqlens_ref,  # [B + 1]
    slot_ids_ref,  # [B]
    q_ref,  # [T, H, K] (whole)
    k_ref,  # [T, H, K] (whole)
    v_ref,  # [T, HV, V] (whole)
    g_ref,  # [T, HV] (whole)
    dt_ref,  # [T, HV] (whole) Mamba2's step sizes (`mamba2`), else unused
    d_ref,  # [HV] Mamba2's D (`mamba2`), else unused
    z_ref,  # [T, >= HV V] (whole) Mamba2's gate (`mamba2.gated`), else unused
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
    mamba2: Mamba2Inputs | None,
    out_dtype,
):
    """Rows of exactly one token: the decode kernel's recurrent update. Other rows are left alone. Programs past
    the last row write the padding tokens' zeros (`zero_padding`). `mamba2` as `_fused_kernel`'s."""
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
        if mamba2:  # token t's row of what `_chunk_inputs` reads
            b_cols, c_cols, x_cols = _mamba2_columns(mamba2, j, group, v_slice)
            k, q, x = (_silu(ref[t, cols].astype(jnp.float32))
                       for ref, cols in ((k_ref, b_cols), (q_ref, c_cols), (v_ref, x_cols)))
            v = x * dt_ref[t, j]
            k, q, v = (a.astype(mamba2.dot_dtype).astype(jnp.float32) for a in (k, q, v))  # the parts' operands
        else:
            q, k, v = q_ref[t, j // group, :], k_ref[t, j // group, :], v_ref[t, j, v_slice]
        o, h = recurrent_step(load_state(state_in_ref.at[slot, j, :, v_slice], slot), q, k, v, g_ref[t, j], scale)
        if mamba2:
            o = _mamba2_out(o, x, d_ref[j], z_ref[t, x_cols] if mamba2.gated else None, mamba2, out_dtype)
        o_ref[t, j, v_slice] = o.astype(o_ref.dtype)

        @pl.when(slot != 0)
        def _():
            state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def _call(kernel, grid, num_inputs, out_shape, aliases, *, num_warps, num_stages, interpret, name, in_specs=None):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs or [_WHOLE] * num_inputs,
        out_specs=[_WHOLE] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )


_TUNING = ("scale", "chunk_size", "fused_output", "block_v", "num_warps", "num_stages", "out_block_v", "out_num_warps",
           "single_block_v", "row_groups", "precision", "state_block_k", "interpret")


@functools.partial(jax.jit, static_argnames=_TUNING)
def chunk_simple_gla_pallas(
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
    fused_output: bool = True,
    block_v: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    out_block_v: int = 64,
    out_num_warps: int = 4,
    single_block_v: int = 32,
    row_groups: int | None = None,
    precision: str = "tf32",
    state_block_k: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T HV V"], Float[Array, "S HV K V"]]:
    """Same arguments and results as `chunk_simple_gla_reference`.

    K, V and `chunk_size` must be powers of two (>= 16); the value blocks are clipped to V. `fused_output`
    picks the one-pass form (output inside the sequential pass, `block_v` values per program) or the split
    (the sequential pass with `block_v` values per program stores per-chunk states; the parallel output
    kernel takes `out_block_v` values and `out_num_warps` warps per program). `single_block_v`: values per
    program of the one-token rows' update. `row_groups` (G) overrides the sequential pass's programs per value
    tile (`_row_groups`). `precision` ("tf32" or "tf32x3") sets fp32 dots on the GPU; the interpreter's dots
    are exact. `state_block_k` (a power of two >= 16 dividing K; default K): the split form's sequential pass
    runs a program per `[state_block_k, block_v]` block of each head's state, K / state_block_k times the programs.
    """
    num_value_heads, value_dim = v.shape[1:]
    dims = (q.shape[1], q.shape[2], num_value_heads, value_dim)
    q, k = q.astype(v.dtype), k.astype(v.dtype)  # one dot operand dtype (the model passes fp32 q/k with bf16 v)
    unused = jnp.zeros((1, 1), jnp.float32)
    return _chunk(q, k, v, g, unused, unused[0], unused, cu_seqlens, state, slot_ids, dims=dims, mamba2=None,
                  out_dtype=v.dtype, scale=scale, chunk_size=chunk_size, fused_output=fused_output, block_v=block_v,
                  num_warps=num_warps, num_stages=num_stages, out_block_v=out_block_v, out_num_warps=out_num_warps,
                  single_block_v=single_block_v, row_groups=row_groups, precision=precision,
                  state_block_k=state_block_k, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_TUNING + ("dims", "out_dtype", "scan_dtype"))
def chunk_mamba2_pallas(
    xbc: Float[Array, "T Cm"],
    dt: Float[Array, "T Hm"],
    g: Float[Array, "T Hm"],
    d_skip: Float[Array, "Hm"],
    cu_seqlens: Int[Array, "B+1"],
    state: Float[Array, "S Hm N P"],
    slot_ids: Int[Array, "B"],
    z: Float[Array, "T Z"] | None = None,
    *,
    dims: tuple[int, int, int, int],
    out_dtype=jnp.float32,
    scale: float = 1.0,
    chunk_size: int = 64,
    block_v: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    single_block_v: int = 32,
    row_groups: int | None = None,
    precision: str = "tf32",
    interpret: bool = False,
    fused_output: bool = True,
    out_block_v: int = 64,
    out_num_warps: int = 4,
    scan_dtype: str = "float32",
    state_block_k: int | None = None,
) -> tuple[Float[Array, "T Hm P"], Float[Array, "S Hm N P"]]:
    """A Mamba2 mixer's chunked scan from its conv output, `simple_gla.chunk_mamba2_in_parts`'s result: `xbc
    [T, Cm]` the conv output (with its bias, before the SiLU; columns x `[Hm P]` | B `[G N]` | C `[G N]`), `dt` the step
    sizes, `g = dt A` the log decays, `d_skip` D, `dims = (Hm, P, G, N)`. The kernels read x, B and C where
    they sit in `xbc` (`Mamba2Inputs`), so no fp32 copy of B, C, `v = SiLU(x) dt` or the output is written;
    the output `y = o + D SiLU(x)` comes in `out_dtype`. Given `z` (`[T, >= Hm P]`, the gate at columns
    `[0, Hm P)`, e.g. the in_proj output itself), the output is instead the gated norm's input `y SiLU(z)` in fp32
    (y rounded to `out_dtype` first), as `mamba2_decode(gated=True)`'s. `scan_dtype` ("float32" or "bfloat16"): the
    dtype B, C and v are rounded to for the dots (bf16 tensor cores), the per-chunk states and the scan's output o
    are kept in, as the parts' scan takes them (`simple_gla.MAMBA2_SCAN_DTYPE`). Both forms (`fused_output`); the
    other arguments as `chunk_simple_gla_pallas`'s."""
    heads, head_dim, groups, state_dim = dims
    if xbc.shape[1] != heads * head_dim + 2 * groups * state_dim:
        raise ValueError(f"xbc [T, Cm] must hold x | B | C = {heads} x {head_dim} + 2 x {groups} x {state_dim} "
                         f"columns, got {xbc.shape}")
    if scan_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"chunk_mamba2_pallas: scan_dtype must be 'float32' or 'bfloat16', got {scan_dtype!r}")
    m2 = Mamba2Inputs(head_dim, state_dim, heads * head_dim, groups, gated=z is not None, dot_dtype=scan_dtype)
    z = jnp.zeros((1, 1), jnp.float32) if z is None else z
    return _chunk(xbc, xbc, xbc, g, dt.astype(jnp.float32), d_skip.astype(jnp.float32), z, cu_seqlens, state,
                  slot_ids, dims=(groups, state_dim, heads, head_dim), mamba2=m2, out_dtype=out_dtype, scale=scale,
                  chunk_size=chunk_size, fused_output=fused_output, block_v=block_v, num_warps=num_warps,
                  num_stages=num_stages, out_block_v=out_block_v, out_num_warps=out_num_warps,
                  single_block_v=single_block_v, row_groups=row_groups, precision=precision,
                  state_block_k=state_block_k, interpret=interpret)


def _chunk(q, k, v, g, dt, d_skip, z, cu_seqlens, state, slot_ids, *, dims, mamba2, out_dtype, scale, chunk_size,
           fused_output, block_v, num_warps, num_stages, out_block_v, out_num_warps, single_block_v, row_groups,
           precision, state_block_k, interpret):
    """The kernels' calls. `dims = (H, K, HV, V)`: key heads and dim, value heads and dim (q, k, v's shapes
    unless `mamba2`, where all three are the conv output)."""
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown {precision=}; choose one of {tuple(_PRECISIONS)}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"{chunk_size=} must be a power of two >= 16 (Triton dot tiles)")
    num_tokens = q.shape[0]
    batch = slot_ids.shape[0]
    num_key_heads, key_dim, num_value_heads, value_dim = dims
    group = num_value_heads // num_key_heads
    c = chunk_size
    block_v, out_block_v, single_block_v = (min(x, value_dim) for x in (block_v, out_block_v, single_block_v))
    block_k = min(state_block_k or key_dim, key_dim)
    if block_k < 16 or block_k & (block_k - 1) or key_dim % block_k:
        raise ValueError(f"{state_block_k=} must be a power of two >= 16 dividing K={key_dim}")
    dot_precision = jax.lax.Precision.HIGHEST if interpret else _PRECISIONS[precision]
    layout: _Layout = _layout(cu_seqlens, num_tokens, batch, c)
    if interpret:  # the interpreter clamps windows that run past the end: pad instead (GPU loads are masked)
        pad = lambda x: jnp.pad(x, ((0, c),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
        q, k, v, g = map(pad, (q, k, v, g))
        dt = pad(dt) if mamba2 else dt
        z = pad(z) if mamba2 and mamba2.gated else z
    cu, slots = cu_seqlens.astype(jnp.int32), slot_ids.astype(jnp.int32)
    groups = row_groups or _row_groups(batch, num_value_heads, value_dim // block_v)
    seq_grid = (groups, num_value_heads, value_dim // block_v)
    o_dtype = jnp.float32 if mamba2 and mamba2.gated else out_dtype
    o_shape = jax.ShapeDtypeStruct((q.shape[0], num_value_heads, value_dim), o_dtype)
    state_shape = jax.ShapeDtypeStruct(state.shape, state.dtype)
    tag = f"c{c}_bv{block_v}_w{num_warps}_s{num_stages}{'_x3' if precision == 'tf32x3' else ''}"
    if fused_output:
        kernel = functools.partial(_fused_kernel, chunk_size=c, group=group, block_v=block_v, scale=scale,
                                   precision=dot_precision, row_groups=groups, mamba2=mamba2, out_dtype=out_dtype)
        o, state = _call(kernel, seq_grid, 12, [o_shape, state_shape], {11: 1}, num_warps=num_warps,
                         num_stages=num_stages, interpret=interpret,
                         name=f"{'mamba2' if mamba2 else 'sgla'}_chunk_fused_{tag}")(
            layout.num_multi, layout.multi_rows, slots, cu, q, k, v, g, dt, d_skip, z, state)
    else:
        prefix = "mamba2" if mamba2 else "sgla"
        kernel = functools.partial(_state_kernel, chunk_size=c, group=group, block_v=block_v, block_k=block_k,
                                   precision=dot_precision, row_groups=groups, mamba2=mamba2)
        state_grid = (groups, num_value_heads, value_dim // block_v * (key_dim // block_k))
        state_tag = tag + (f"_bk{block_k}" if block_k < key_dim else "")
        # per-chunk states in the dot dtype (Mamba2's in-place form: its `dot_dtype`, as the parts' v)
        h_dtype = jnp.dtype(mamba2.dot_dtype) if mamba2 else v.dtype
        h_shape = jax.ShapeDtypeStruct((layout.num_chunks, num_value_heads, key_dim, value_dim), h_dtype)
        h, state = _call(kernel, state_grid, 10, [h_shape, state_shape], {9: 1}, num_warps=num_warps,
                         num_stages=num_stages, interpret=interpret, name=f"{prefix}_chunk_state_{state_tag}")(
            layout.num_multi, layout.multi_rows, layout.row_chunks, slots, cu, k, v, g, dt, state)
        kernel = functools.partial(_output_kernel, chunk_size=c, group=group, block_v=out_block_v, scale=scale,
                                   precision=dot_precision, mamba2=mamba2, out_dtype=out_dtype)
        h_spec = pl.BlockSpec((None, None, key_dim, out_block_v), lambda n, j, i: (n, j, 0, i))
        (o,) = _call(kernel, (layout.num_chunks, num_value_heads, value_dim // out_block_v), 10, [o_shape], {},
                     num_warps=out_num_warps, num_stages=2, interpret=interpret,
                     in_specs=[_WHOLE] * 9 + [h_spec],
                     name=f"{prefix}_chunk_output_c{c}_bv{out_block_v}_w{out_num_warps}")(
            layout.chunk_start, layout.chunk_len, q, k, v, g, dt, d_skip, z, h)
    kernel = functools.partial(_single_token_kernel, group=group, block_v=single_block_v, scale=scale,
                               num_tokens=num_tokens, tail_tokens=c, mamba2=mamba2, out_dtype=out_dtype)
    single_grid = (batch + padding_programs(num_tokens, c), num_value_heads, value_dim // single_block_v)
    o, state = _call(kernel, single_grid, 11, [o_shape, state_shape], {9: 0, 10: 1}, num_warps=4, num_stages=1,
                     interpret=interpret, name=f"{'mamba2' if mamba2 else 'sgla'}_chunk_single_bv{single_block_v}_w4")(
        cu, slots, q, k, v, g, dt, d_skip, z, o, state)
    return o[:num_tokens], state
