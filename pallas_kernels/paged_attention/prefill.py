"""Pallas (Triton lowering) kernel: ragged prefill paged attention, one program per (query tile, kv head, KV
split).

The packed query tokens of B rows are cut into tiles of BQ tokens that never cross a row (a row of n
tokens takes ceil(n / BQ) tiles; `N = ceil(T / BQ) + B` tiles bound the count statically, unused tiles are
empty). Program (n, h) holds tile n's queries for the G query heads of kv head h as one `[BQ*GP, D]`
block (each token's G heads padded to GP rows), walks the row's cached pages from the tile's first key
(or its sliding-window start) to its last query's position, NP pages per loop step with an online
softmax, and writes the normalised output and the log-sum-exp per query row. A jnp epilogue moves tile
rows back to packed tokens. Each tile reads its row's prefix once, as FlashAttention reads it per query
block; the decode kernel (decode.py) remains the one for single-token rows. When the tiles are few (a short
chunk after a long cached prefix), S programs share a tile's key blocks (split-KV, as FlashDecoding does) and
their partial outputs are merged by log-sum-exp in jnp.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.gated_delta_rule.reference import chunk_layout
from pallas_kernels.paged_attention.merge import merge_splits

_WHOLE = pl.no_block_spec
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


TARGET_PROGRAMS = 256  # about two programs per SM of an H100 / H200 (132 SMs)
MAX_SPLITS = 8


def _prefill_kernel(
    tile_row_ref,  # [N] (whole)
    block_tables_ref,  # [B, M'] (whole, padded by NP pages)
    q_ref,  # [R, D] with R = BQ*GP
    qpos_ref,  # [R] int32 position of each query row; -1 for padding rows
    k_pages_ref,  # [P, BS, D] (kv head fixed by the BlockSpec)
    v_pages_ref,  # [P, BS, D]
    o_ref,  # [R, D] fp32
    lse_ref,  # [R] fp32
    *,
    scale: float,
    pages_per_block: int,
    sliding_window: int | None,
    soft_cap: float | None,
    per_page: bool,
    num_splits: int,
):
    n = pl.program_id(0)
    block_size, head_dim = k_pages_ref.shape[1], k_pages_ref.shape[2]
    row = tile_row_ref[n]
    qpos = qpos_ref[...]  # [R]
    valid = qpos >= 0
    last = qpos.max()  # the tile's last query position (-1: empty tile)
    first = jnp.where(valid, qpos, jnp.iinfo(jnp.int32).max).min()
    hi_page = jnp.where(last >= 0, last // block_size + 1, 0)  # an empty tile iterates nothing
    if sliding_window is None:
        first_it = 0  # (a traced select of two constants here would not lower for Triton)
    else:
        first_it = jnp.maximum(first - sliding_window + 1, 0) // block_size // pages_per_block
    last_it = (hi_page + pages_per_block - 1) // pages_per_block
    q = q_ref[...]

    def update(carry, k, v, key_pos):
        o_prev, m_prev, l_prev = carry
        mask = key_pos[None, :] <= qpos[:, None]  # [R, BS]
        if sliding_window is not None:
            mask &= key_pos[None, :] > qpos[:, None] - sliding_window
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask, scores, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        corr = jnp.exp2((m_prev - m_next) * _LOG2E)
        p = jnp.exp2((scores - m_next[:, None]) * _LOG2E)
        p = jnp.where(mask, p, 0.0)  # rows with no key yet keep p = 0
        key_ok = key_pos <= last
        v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # keys past the tile's last query may be NaN
        o_next = o_prev * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o_next, m_next, l_prev * corr + p.sum(axis=-1)

    def body(it, carry):
        first_page = it * pages_per_block
        if per_page:  # NP scalar-indexed page loads: contiguous [BS, D] tiles, one online-softmax step each
            for i in range(pages_per_block):
                page = block_tables_ref[row, first_page + i]
                key_pos = (first_page + i) * block_size + jnp.arange(block_size)
                carry = update(carry, k_pages_ref[page], v_pages_ref[page], key_pos)
            return carry
        pages = block_tables_ref[row, pl.ds(first_page, pages_per_block)]  # [NP]
        k = k_pages_ref[pages].reshape(pages_per_block * block_size, head_dim)  # one gathered [NP*BS, D] tile
        v = v_pages_ref[pages].reshape(pages_per_block * block_size, head_dim)
        return update(carry, k, v, first_page * block_size + jnp.arange(pages_per_block * block_size))

    rows = q.shape[0]
    o = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    if num_splits > 1:  # this program's share of the tile's key blocks (split s of num_splits, even shares)
        per = (last_it - first_it + num_splits - 1) // num_splits
        first_it = first_it + pl.program_id(2) * per
        last_it = jnp.minimum(first_it + per, last_it)
    o, m, l = jax.lax.fori_loop(first_it, last_it, body, (o, m, l))
    empty = l == 0.0
    o_ref[...] = o / jnp.where(empty, 1.0, l)[:, None]
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def tiling(q_shape, k_pages, tables_shape, *, block_q: int | None = None, pages_per_block: int | None = None,
           num_splits: int | None = None) -> tuple[int, int, int]:
    """The kernel's (block_q, pages_per_block, num_splits) for queries `[T, H, D]` over `k_pages` and block tables
    `[B, M]`, defaults filled in (`paged_attention_prefill_pallas`): static, so a caller can tell a step's KV splits
    before tracing it."""
    num_tokens, num_heads, _ = q_shape
    num_kv_heads = k_pages.shape[2]
    gp = _next_pow2(num_heads // num_kv_heads)
    wide = jnp.dtype(k_pages.dtype).itemsize > 2
    block_q = block_q or max(1, (64 if wide else 128) // gp)
    if block_q * gp < 16:
        block_q = 16 // gp
    pages_per_block = min(pages_per_block or (2 if wide else 4), _next_pow2(tables_shape[1]))
    num_tiles = -(-num_tokens // block_q) + tables_shape[0]
    if num_splits is None:
        num_splits = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // (num_tiles * num_kv_heads)))
    return block_q, pages_per_block, max(1, min(num_splits, -(-(tables_shape[1] + pages_per_block) // pages_per_block)))


@functools.partial(
    jax.jit,
    static_argnames=("scale", "sliding_window", "soft_cap", "return_lse", "block_q", "pages_per_block",
                     "num_warps", "num_stages", "per_page", "num_splits", "interpret"),
)
def paged_attention_prefill_pallas(
    q: Float[Array, "T H D"],
    k_pages: Float[Array, "P BS KVH D"],
    v_pages: Float[Array, "P BS KVH D"],
    block_tables: Int[Array, "B M"],
    cu_seqlens: Int[Array, "B+1"],
    positions: Int[Array, "T"],
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    per_page: bool = False,
    num_splits: int | None = None,
    interpret: bool = False,
):
    """Ragged prefill: the same result as `paged_attention_reference` for packed rows given by
    `cu_seqlens` (tokens at or after `cu_seqlens[B]` are padding and get zeros).

    q is cast to the pages' dtype for the dots (fp32 accumulation). D and BS must be powers of two.
    `block_q` query tokens per tile (default: 128 query rows per program, at least one token). Each loop
    step reads `pages_per_block` pages (default 4): page by page (`per_page`) or as one gathered `[NP*BS, D]`
    tile. With 4-byte pages both defaults halve, so the tiles take the bytes of the bf16 ones: at head_dim
    256 the bf16 sizes in fp32 ask for 320 KiB of shared memory, over the H200's 227 KiB.

    `num_splits` programs share each tile's keys (even shares of its key blocks, merged by log-sum-exp), so
    that a step of few query tiles over a long context (a prefix-cache hit: a short suffix after thousands of
    cached tokens) still fills the GPU. Default: enough splits for about `TARGET_PROGRAMS` programs, at most
    `MAX_SPLITS`; 1 when the tiles alone are that many.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    gp = _next_pow2(group)
    block_q, pages_per_block, num_splits = tiling(q.shape, k_pages, block_tables.shape, block_q=block_q,
                                                  pages_per_block=pages_per_block, num_splits=num_splits)
    rows = block_q * gp
    scale = head_dim**-0.5 if scale is None else scale
    tiles = chunk_layout(cu_seqlens, num_tokens, block_q)  # query tiles laid out as the recurrence's chunks
    num_tiles, token_tile, token_lane = tiles.num_chunks, tiles.token_chunk, tiles.token_lane
    tile_row = tiles.chunk_row.astype(jnp.int32)
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_block)))

    # queries and positions in tile layout [N, KVH, BQ*GP, D] / [N, BQ*GP]
    q4 = q.astype(k_pages.dtype).reshape(num_tokens, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, gp - group), (0, 0)))  # [T, KVH, GP, D]
    qt = jnp.zeros((num_tiles, block_q, num_kv_heads, gp, head_dim), q4.dtype)
    qt = qt.at[token_tile, token_lane].set(q4, mode="drop")
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
    pos = jnp.full((num_tiles, block_q), -1, jnp.int32).at[token_tile, token_lane].set(positions.astype(jnp.int32), mode="drop")
    pos = jnp.repeat(pos, gp, axis=1)  # [N, BQ*GP]: lane-major, GP rows per token

    kernel = functools.partial(
        _prefill_kernel, scale=scale, pages_per_block=pages_per_block, sliding_window=sliding_window, soft_cap=soft_cap,
        per_page=per_page, num_splits=num_splits,
    )
    pages_spec = pl.BlockSpec((k_pages.shape[0], block_size, None, head_dim), lambda n, h, s: (0, 0, h, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=[
            _WHOLE, _WHOLE,
            pl.BlockSpec((None, None, rows, head_dim), lambda n, h, s: (n, h, 0, 0)),
            pl.BlockSpec((None, rows), lambda n, h, s: (n, 0)),
            pages_spec, pages_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda n, h, s: (n, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda n, h, s: (n, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, num_splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, num_splits, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=(f"paged_prefill_bq{block_q}_gp{gp}_{'pp' if per_page else 'np'}{pages_per_block}_w{num_warps}"
              f"_s{num_stages}" + (f"_ns{num_splits}" if num_splits > 1 else "")),
    )(tile_row, block_tables, qt, pos, k_pages, v_pages)
    o, lse = (o[:, :, 0], lse[:, :, 0]) if num_splits == 1 else merge_splits(o, lse)
    # back to packed tokens: [N, KVH, BQ, GP, D] -> token t's (tile, lane) -> [KVH, G, D]
    o = o.reshape(num_tiles, num_kv_heads, block_q, gp, head_dim)[:, :, :, :group]
    lse = lse.reshape(num_tiles, num_kv_heads, block_q, gp)[:, :, :, :group]
    tile = jnp.minimum(token_tile, num_tiles - 1)
    out = o[tile, :, token_lane].reshape(num_tokens, num_heads, head_dim)
    lse = lse[tile, :, token_lane].reshape(num_tokens, num_heads)
    real = (token_tile < num_tiles)[:, None]
    out = jnp.where(real[..., None], out, 0.0).astype(q.dtype)
    lse = jnp.where(real, lse, -jnp.inf)
    return (out, lse) if return_lse else out
