"""Pallas (Triton lowering) kernel: the cached-prefix part of a split ragged prefill, merged in place.

A split prefill step (`self_attention.py`) attends its tokens among themselves first (cuDNN, or the jnp form on
the CPU), which gives each query a normalised output and the log-sum-exp of its scores. This kernel continues
that online softmax over the keys its row had before the step (a prompt's earlier chunks, a prefix-cache hit, a
decode row's context) and writes the merged output and log-sum-exp over the self part's, in place (aliased). A
tile whose row has no prefix (a fresh prompt) exits at once, so a step of fresh prompts costs the self part alone.
The unmerged form (`prefill.py` into a tile layout, an fp32 partial output, then `merge.merge_attention`) costs a
layout pass, a gather and a merge pass over the whole step whether or not any row has a prefix; the split keeps
it for steps of so few query tiles that the Pallas kernel's KV splits are wanted (a short suffix after a long
cached prefix), which this kernel does not do.

Program (n, h): query tile n (up to BQ tokens of one row; `N = ceil(T / BQ) + B` tiles bound the count, and
every row, one-token rows too, starts a tile) for the G query heads of kv head h, read straight from the packed
`[T, H, D]` queries as a `[BQ * GP, D]` block (each token's G heads padded to GP rows, masked). Every query of a
tile attends to the same keys, positions 0 to the row's first new position - 1, so no causal mask is needed
inside the prefix; the split runs without a sliding window or soft cap. Programs n >= N write zeros and a -inf
log-sum-exp for padding tokens (at or after `cu_seqlens[B]`), which the self part may leave unwritten.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.prefill import _LOG2E, _MASK_VALUE, _WHOLE, _next_pow2, tiling


def query_tiles(cu_seqlens: Int[Array, "B+1"], num_tokens: int, block_q: int) -> tuple[Array, Array, Array]:
    """Each row's packed tokens cut into tiles of `block_q` starting at its first token (`N = ceil(T / BQ) + B`
    tiles bound the count): (row `[N]`, first token `[N]`, tokens `[N]`, 0 for unused tiles)."""
    cu = cu_seqlens.astype(jnp.int32)
    batch = cu.shape[0] - 1
    num_tiles = -(-num_tokens // block_q) + batch
    per_row = (cu[1:] - cu[:-1] + block_q - 1) // block_q  # [B]; an empty row has none
    ends = jnp.cumsum(per_row)
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fusion (searchsorted's default `scan` is a while loop the GPU runtime drives from the host)
    row = jnp.clip(jnp.searchsorted(ends, ids, side="right", method="compare_all"), 0, batch - 1).astype(jnp.int32)
    start = cu[row] + (ids - (ends[row] - per_row[row])) * block_q
    length = jnp.where(ids < ends[-1], jnp.minimum(block_q, cu[row + 1] - start), 0)
    return row, jnp.where(length > 0, start, 0), length


def _prefix_kernel(
    tile_row_ref,  # [N]
    tile_start_ref,  # [N]
    tile_len_ref,  # [N]
    cu_seqlens_ref,  # [B + 1]
    block_tables_ref,  # [B, M'] (padded by NP pages)
    positions_ref,  # [T]
    q_ref,  # [T', H', D] (whole)
    k_pages_ref,  # [P, BS, D] (kv head fixed by the BlockSpec)
    v_pages_ref,  # [P, BS, D]
    o_in_ref,  # [T', H', D] the self part's output (aliased with o_ref)
    lse_in_ref,  # [T', H'] its log-sum-exp (aliased with lse_ref)
    o_ref,  # [T', H', D]
    lse_ref,  # [T', H']
    *,
    scale: float,
    group: int,
    block_q: int,
    pages_per_block: int,
    num_tiles: int,
    num_tokens: int,
):
    n, h = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = k_pages_ref.shape[1], k_pages_ref.shape[2]
    gp = _next_pow2(group)
    rows = block_q * gp
    heads = pl.ds(h * group, gp)
    head_ok = jnp.arange(gp) < group  # [GP]: padded head rows are neither read nor written

    @pl.when(n >= num_tiles)  # padding tokens: zeros and -inf
    def _():
        start = (n - num_tiles) * block_q
        t = start + jnp.arange(block_q)
        pad = (t >= cu_seqlens_ref[cu_seqlens_ref.shape[0] - 1]) & (t < num_tokens)
        mask = pad[:, None] & head_ok[None, :]  # [BQ, GP]
        plt.store(o_ref.at[pl.ds(start, block_q), heads, :], jnp.zeros((block_q, gp, head_dim), o_ref.dtype),
                  mask=mask[:, :, None])
        plt.store(lse_ref.at[pl.ds(start, block_q), heads], jnp.full((block_q, gp), -jnp.inf, lse_ref.dtype),
                  mask=mask)

    tile = jnp.minimum(n, num_tiles - 1)
    length = tile_len_ref[tile]
    row = tile_row_ref[tile]
    # the row's last cached position (-1: a fresh row); an unused tile's row may start at T
    last = positions_ref[jnp.minimum(cu_seqlens_ref[row], num_tokens - 1)] - 1

    @pl.when((n < num_tiles) & (length > 0) & (last >= 0))
    def _():
        start = tile_start_ref[tile]
        mask = (jnp.arange(block_q) < length)[:, None] & head_ok[None, :]  # [BQ, GP]
        window = (pl.ds(start, block_q), heads)
        q = plt.load(q_ref.at[(*window, slice(None))], mask=mask[:, :, None], other=0)
        q = q.astype(k_pages_ref.dtype).reshape(rows, head_dim)
        o = plt.load(o_in_ref.at[(*window, slice(None))], mask=mask[:, :, None], other=0)
        o = o.astype(jnp.float32).reshape(rows, head_dim)
        m = plt.load(lse_in_ref.at[window], mask=mask, other=0).astype(jnp.float32).reshape(rows)
        keys = pages_per_block * block_size

        def body(it, carry):  # the self part's softmax (max m = its lse, sum l = 1) continued over NP pages
            o_prev, m_prev, l_prev = carry
            first_page = it * pages_per_block
            pages = block_tables_ref[row, pl.ds(first_page, pages_per_block)]  # [NP]
            k = k_pages_ref[pages].reshape(keys, head_dim)  # one gathered [NP*BS, D] tile
            v = v_pages_ref[pages].reshape(keys, head_dim)
            key_ok = first_page * block_size + jnp.arange(keys) <= last  # [NP*BS]
            v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # keys past the prefix may be NaN
            scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
            scores = jnp.where(key_ok[None, :], scores, _MASK_VALUE)
            m_next = jnp.maximum(m_prev, scores.max(axis=-1))
            corr = jnp.exp2((m_prev - m_next) * _LOG2E)
            p = jnp.where(key_ok[None, :], jnp.exp2((scores - m_next[:, None]) * _LOG2E), 0.0)
            o_next = o_prev * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return o_next, m_next, l_prev * corr + p.sum(axis=-1)

        steps = (last // block_size + pages_per_block) // pages_per_block  # ceil(pages / NP)
        o, m, l = jax.lax.fori_loop(0, steps, body, (o, m, jnp.ones((rows,), jnp.float32)))
        o = (o / l[:, None]).reshape(block_q, gp, head_dim)
        plt.store(o_ref.at[(*window, slice(None))], o.astype(o_ref.dtype), mask=mask[:, :, None])
        plt.store(lse_ref.at[window], (m + jnp.log(l)).reshape(block_q, gp), mask=mask)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_q", "pages_per_block", "num_warps", "num_stages", "interpret"),
)
def paged_prefix_merge_pallas(
    q: Float[Array, "T H D"],
    k_pages: Float[Array, "P BS KVH D"],
    v_pages: Float[Array, "P BS KVH D"],
    block_tables: Int[Array, "B M"],
    cu_seqlens: Int[Array, "B+1"],
    positions: Int[Array, "T"],
    o_self: Float[Array, "T H D"],
    lse_self: Float[Array, "T H"],
    *,
    scale: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Float[Array, "T H D"], Float[Array, "T H"]]:
    """The attention of each packed query over its row's keys: its row's cached prefix (the keys at positions
    before the row's first new token, read from the pages) merged with `(o_self, lse_self)`, the same queries'
    attention over the step's own keys. Returns (o in o_self's dtype, lse fp32); padding tokens (at or after
    `cu_seqlens[B]`) get zeros and -inf whatever o_self / lse_self hold there.

    q is cast to the pages' dtype for the dots (fp32 accumulation). D and BS must be powers of two. `block_q`
    query tokens per tile and `pages_per_block` pages a loop step (one gathered `[NP*BS, D]` tile) default as the
    prefill kernel's (`prefill.tiling`: 128 query rows and 4 pages for 2-byte pages, 64 and 2 for 4-byte ones),
    with at least 16 keys a tile."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    if o_self.shape != q.shape or lse_self.shape != q.shape[:2]:
        raise ValueError(f"o_self must be [T, H, D] = {q.shape} and lse_self [T, H], got {o_self.shape=} "
                         f"{lse_self.shape=}")
    group = num_heads // num_kv_heads
    gp = _next_pow2(group)
    block_q, pages_per_block, _ = tiling(q.shape, k_pages, block_tables.shape, block_q=block_q,
                                         pages_per_block=pages_per_block)
    pages_per_block = max(pages_per_block, -(-16 // block_size))  # at least 16 keys (a Triton dot's minimum)
    scale = head_dim**-0.5 if scale is None else scale
    tile_row, tile_start, tile_len = query_tiles(cu_seqlens, num_tokens, block_q)
    num_tiles = tile_row.shape[0]
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_block)))
    lse = lse_self.astype(jnp.float32)
    if interpret:  # the interpreter clamps windows that run past an end: pad the tokens and heads instead
        pad = ((0, block_q), (0, gp - group))
        q, o, lse = (jnp.pad(x, pad + ((0, 0),) * (x.ndim - 2)) for x in (q, o_self, lse))
    else:
        o = o_self
    kernel = functools.partial(_prefix_kernel, scale=scale, group=group, block_q=block_q,
                               pages_per_block=pages_per_block, num_tiles=num_tiles, num_tokens=num_tokens)
    pages_spec = pl.BlockSpec((k_pages.shape[0], block_size, None, head_dim), lambda n, h: (0, 0, h, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_tiles + -(-num_tokens // block_q), num_kv_heads),
        in_specs=[_WHOLE] * 7 + [pages_spec, pages_spec, _WHOLE, _WHOLE],
        out_specs=[_WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
        input_output_aliases={9: 0, 10: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_prefix_merge_bq{block_q}_gp{gp}_np{pages_per_block}_w{num_warps}_s{num_stages}",
    )(tile_row, tile_start, tile_len, cu_seqlens.astype(jnp.int32), block_tables, positions.astype(jnp.int32), q,
      k_pages, v_pages, o, lse)
    return o[:num_tokens, :num_heads], lse[:num_tokens, :num_heads]
