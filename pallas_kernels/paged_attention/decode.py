"""Pallas (Triton lowering) kernel: paged attention with one program per (query token, kv head, KV split).

Each query token t (of row `token_seq[t]`, at `positions[t]`) attends causally to its row's cached keys
through the block table. This is the decode form (one query per row), but it is correct for any packing:
every query token reads its own row's KV, so a prefill batch would re-read the KV once per query.

Grid `(T, KVH, NS)`: program (t, h, s) takes the G query heads of kv head h (padded to GP >= 16 rows for
the tensor-core dots), walks split s's share of the row's pages NP pages at a time with an online softmax,
and writes its normalised partial output and log-sum-exp. A jnp epilogue merges the NS partials by LSE
(an empty split has LSE = -inf and weight 0). Pages outside `[window start, position]` are never
iterated; keys masked inside an iterated block have their V zeroed, so unread or poisoned (NaN) pages
never reach the output.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int
from pallas_kernels.paged_attention.merge import merge_splits

_WHOLE = pl.no_block_spec  # the whole array, indexed inside the kernel
# each query's own pages cut into the splits (`split_pages`), not the block table's columns; read at trace time.
# On by default (JHYBRID_PAGED_DECODE_DYNAMIC_SPLITS=0: the table's columns): session 48 (H100), a 1,000-token
# batch-1 row in a 4,096-token table 0.174 -> 0.059 ms of attention a step, 256 rows of 512 tokens in a 776-token
# table 0.833 -> 0.686 ms (one split, `dynamic_splits`), in a 4,096-token table 0.819 both ways
DYNAMIC_SPLITS = os.environ.get("JHYBRID_PAGED_DECODE_DYNAMIC_SPLITS", "1") == "1"
# with DYNAMIC_SPLITS, the programs (queries x kv heads x splits) a call may have before a split must get more than one
# block: `dynamic_splits` (JHYBRID_PAGED_DECODE_SPLIT_PROGRAMS). A few queries spread their pages over every
# split; 256 queries (512 programs a split) leave a 512-token row whole in one, as the static form did, without
# eight partial outputs to write and merge, and still split a row eight times longer
SPLIT_PROGRAMS = int(os.environ.get("JHYBRID_PAGED_DECODE_SPLIT_PROGRAMS", "512"))
# `block_softmax`'s default (one online-softmax step per block of pages, not per page): on (session 48, H100: the
# B64 8k kernel 0.438 -> 0.420 ms, the engine's 256-row step's attention 0.686 -> 0.662 ms, a 1,000-token batch-1
# row's 0.059 -> 0.051 ms; every head dimension fits the H200's compile). JHYBRID_PAGED_DECODE_BLOCK_SOFTMAX=0: a
# step a page
BLOCK_SOFTMAX = os.environ.get("JHYBRID_PAGED_DECODE_BLOCK_SOFTMAX", "1") == "1"
# a split with no blocks of its query writes only its lse (-inf), not its fp32 partial output, which the merge then
# masks (`merge_splits`): a 256-row step of 1,000-token rows in a 32k table otherwise writes six empty [16, D] fp32
# partials a row and kv head. On by default (session 49, H100: 256 rows of 1,000 tokens in an 8,192-token table,
# the step's six paged decode calls 1.265 -> 1.206 ms). JHYBRID_PAGED_DECODE_SKIP_EMPTY=0: every split writes
SKIP_EMPTY = os.environ.get("JHYBRID_PAGED_DECODE_SKIP_EMPTY", "1") == "1"
# mask only the blocks that can hold a key outside `[window start, position]` (a split's last block, and with a
# sliding window its first): the blocks between them skip the masks, above all the select that zeroes V's masked
# keys, a [NP * BS, D] elementwise pass a block that also keeps V's tile from going straight from shared memory into
# the P @ V dot. Off until timed (JHYBRID_PAGED_DECODE_TAIL_MASK=1)
TAIL_MASK = os.environ.get("JHYBRID_PAGED_DECODE_TAIL_MASK", "0") == "1"
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def group_rows(group: int) -> int:
    """The kernel's query rows a kv head (GP): the group padded to a power of two, at least 16 (the dots' tile)."""
    return max(16, _next_pow2(group))


def dynamic_splits(num_tokens: int, num_kv_heads: int, num_splits: int, table_blocks: int) -> tuple[int, int]:
    """`DYNAMIC_SPLITS`' `(num_splits, min_blocks)` for a call (static: shapes only): the fewest blocks a split takes
    from a query, 1 while the call has at most `SPLIT_PROGRAMS` programs, else as many times more as it has programs
    beyond them; and the splits cut to those that a query of the table's `table_blocks` blocks could use at that."""
    min_blocks = max(1, num_tokens * num_kv_heads * num_splits // SPLIT_PROGRAMS)
    return max(1, min(num_splits, table_blocks // min_blocks)), min_blocks


def split_pages(lo_page, hi_page, s, *, num_splits: int, pages_per_block: int, pages_per_split: int | None,
                min_blocks: int = 1):
    """Split `s`'s share of a query's pages `[lo_page, hi_page)` (its window's first page to the page of its
    position): `(base, first, last)`, the split walking pages `base + i * pages_per_block` for `i` in
    `[first, last)`. `pages_per_split` None (`DYNAMIC_SPLITS`): the query's own pages cut into runs of whole blocks
    from `lo_page`, as even as whole blocks go, over as many of the first splits as give each at least `min_blocks`
    blocks (all `num_splits` at most; the rest walk nothing), so a short context in a wide block table still spreads
    over every split; else
    split `s` owns the table's columns `[s * pages_per_split, (s + 1) * pages_per_split)`, of which a context much
    shorter than the table fills only the first splits (a row of 600 tokens in a 4,096-token table: 2 of 8 splits,
    the first walking 8 blocks). Either way a block may run past `hi_page` (its keys are masked) by fewer than
    `pages_per_block` pages. Works on jnp or Python integers."""
    if pages_per_split is None:
        blocks = (jnp.maximum(hi_page - lo_page, 0) + pages_per_block - 1) // pages_per_block
        # the splits with work, as even as whole blocks go; s >= used: first == last == blocks
        used = jnp.clip(blocks // min_blocks, 1, num_splits)
        return lo_page, jnp.minimum(s, used) * blocks // used, jnp.minimum(s + 1, used) * blocks // used
    base = s * pages_per_split
    lo = jnp.maximum(lo_page, base)
    hi = jnp.minimum(hi_page, base + pages_per_split)
    return base, (lo - base) // pages_per_block, (hi - base + pages_per_block - 1) // pages_per_block


def _decode_kernel(
    token_seq_ref,  # [T] (whole)
    positions_ref,  # [T] (whole)
    block_tables_ref,  # [B, M'] (whole, padded to NS * pages_per_split)
    q_ref,  # [GP, D]
    k_pages_ref,  # [P, BS, D] (kv head fixed by the BlockSpec)
    v_pages_ref,  # [P, BS, D]
    o_ref,  # [GP, D] fp32, normalised partial output
    lse_ref,  # [GP] fp32
    *,
    scale: float,
    pages_per_block: int,
    pages_per_split: int | None,
    num_splits: int,
    min_blocks: int,
    sliding_window: int | None,
    soft_cap: float | None,
    per_page: bool,
    block_softmax: bool,
    skip_empty: bool,
    tail_mask: bool,
):
    t, s = pl.program_id(0), pl.program_id(2)
    block_size, head_dim = k_pages_ref.shape[1], k_pages_ref.shape[2]
    block_k = pages_per_block * block_size
    row = token_seq_ref[t]
    pos = positions_ref[t]
    lo_tok = 0 if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    split_start, first_it, last_it = split_pages(lo_tok // block_size, pos // block_size + 1, s,
                                                 num_splits=num_splits, pages_per_block=pages_per_block,
                                                 pages_per_split=pages_per_split, min_blocks=min_blocks)

    q = q_ref[...]  # [GP, D]
    gp = q.shape[0]

    def masked_scores(k, key_pos, masked):  # [GP, BK] scaled (capped) scores, masked keys at _MASK_VALUE; the mask
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        scores = scores * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        if not masked:  # every key of the block inside [window start, position]: no mask (None)
            return scores, None
        mask = key_pos <= pos
        if sliding_window is not None:
            mask &= key_pos >= lo_tok
        return jnp.where(mask[None, :], scores, _MASK_VALUE), mask

    def update(carry, tiles, masked):  # one online-softmax step over the keys of `tiles`, [(k [BK, D], v, key_pos)]
        o_prev, m_prev, l_prev = carry
        scored = [(*masked_scores(k, key_pos, masked), v) for k, v, key_pos in tiles]
        m_next = m_prev
        for scores, _, _ in scored:
            m_next = jnp.maximum(m_next, scores.max(axis=-1))
        corr = jnp.exp2((m_prev - m_next) * _LOG2E)
        pv = [(jnp.exp2((scores - m_next[:, None]) * _LOG2E),
               v if mask is None else jnp.where(mask[:, None], v, jnp.zeros_like(v)))
              for scores, mask, v in scored]  # (unread keys may hold NaN)
        o_next = o_prev * corr[:, None]
        for p, v in pv:
            o_next = o_next + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        l_next = l_prev * corr
        for p, _ in pv:
            l_next = l_next + p.sum(axis=-1)
        return o_next, m_next, l_next

    def body(it, carry, masked=True):
        first_page = split_start + it * pages_per_block
        if per_page:  # NP scalar-indexed page loads: contiguous [BS, D] tiles
            def tile(i):
                page = block_tables_ref[row, first_page + i]
                return k_pages_ref[page], v_pages_ref[page], (first_page + i) * block_size + jnp.arange(block_size)

            if block_softmax:  # one softmax step (max, rescale of o) for the block's NP pages together
                return update(carry, [tile(i) for i in range(pages_per_block)], masked)
            for i in range(pages_per_block):  # a step per page, each page loaded before its own step
                carry = update(carry, [tile(i)], masked)
            return carry
        pages = block_tables_ref[row, pl.ds(first_page, pages_per_block)]  # [NP]
        k = k_pages_ref[pages].reshape(block_k, head_dim)  # [NP*BS, D] (a gather)
        v = v_pages_ref[pages].reshape(block_k, head_dim)
        return update(carry, [(k, v, first_page * block_size + jnp.arange(block_k))], masked)

    o = jnp.zeros((gp, head_dim), jnp.float32)
    m = jnp.full((gp,), -jnp.inf, jnp.float32)
    l = jnp.zeros((gp,), jnp.float32)
    if tail_mask:  # [first, a) and [b, last) masked (a split's first block under a window, its last), [a, b) not
        a, carry = first_it, (o, m, l)
        if sliding_window is not None:
            a = jnp.minimum(first_it + 1, last_it)
            carry = jax.lax.fori_loop(first_it, a, body, carry)
        b = jnp.maximum(a, last_it - 1)
        carry = jax.lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
        o, m, l = jax.lax.fori_loop(b, last_it, body, carry)
    else:
        o, m, l = jax.lax.fori_loop(first_it, last_it, body, (o, m, l))
    empty = l == 0.0
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))

    def store():
        o_ref[...] = o / jnp.where(empty, 1.0, l)[:, None]

    if skip_empty:  # no block walked: the lse (-inf) alone; the merge ignores the unwritten output
        pl.when(last_it > first_it)(store)
    else:
        store()


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "sliding_window", "soft_cap", "return_lse", "pages_per_block", "num_splits",
        "num_warps", "num_stages", "per_page", "block_softmax", "tail_mask", "group", "interpret",
    ),
)
def paged_attention_decode_pallas(
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
    pages_per_block: int = 4,
    num_splits: int = 8,
    num_warps: int = 4,
    num_stages: int = 4,
    per_page: bool = True,
    block_softmax: bool | None = None,
    tail_mask: bool | None = None,
    group: int | None = None,
    interpret: bool = False,
):
    """Same arguments and results as `paged_attention_reference` (query tokens of any rows).

    q is cast to the pages' dtype for the dots (fp32 accumulation); the output has q's dtype.
    D and BS must be powers of two. `num_splits` KV splits per query are merged by LSE. Each loop step
    reads `pages_per_block` pages: as one gathered tile, or with `per_page` page by page, each page an online-softmax
    step of its own or, with `block_softmax`, the block's pages one step together (one running-max update and one
    rescale of the output a block instead of one a page; the scores of the block's pages are held at once).
    `tail_mask` (None: `TAIL_MASK`) masks only a split's edge blocks. q may also come as the kernel takes it,
    `[T, KVH, GP, D]` in the pages' dtype with each kv head's `group` queries first and zero rows after them
    (`decode_prologue.py`'s output); `group` is then required.
    """
    _, block_size, num_kv_heads, _ = k_pages.shape
    if q.ndim == 4:
        if group is None or q.shape[2] != group_rows(group) or q.dtype != k_pages.dtype:
            raise ValueError(f"padded queries {q.shape} {q.dtype} are not [T, KVH, GP, D] of the pages' dtype for "
                             f"{group=}")
        num_tokens, _, gp, head_dim = q.shape
        num_heads = num_kv_heads * group
    else:
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // num_kv_heads
        gp = group_rows(group)
    scale = head_dim**-0.5 if scale is None else scale
    block_softmax = per_page and (BLOCK_SOFTMAX if block_softmax is None else block_softmax)
    max_pages = block_tables.shape[1]
    pages_per_block = min(pages_per_block, _next_pow2(max_pages))
    table_blocks = -(-max_pages // pages_per_block)
    num_splits = max(1, min(num_splits, table_blocks))
    # pad entries (page 0) for the blocks that run past a row's last page: by a block, or to the static splits' end
    min_blocks = 1
    if DYNAMIC_SPLITS:
        pages_per_split, pad = None, pages_per_block
        num_splits, min_blocks = dynamic_splits(num_tokens, num_kv_heads, num_splits, table_blocks)
    else:
        pages_per_split = -(-max_pages // (num_splits * pages_per_block)) * pages_per_block
        pad = num_splits * pages_per_split - max_pages
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))
    if q.ndim == 4:
        q4 = q
    else:
        q4 = q.astype(k_pages.dtype).reshape(num_tokens, num_kv_heads, group, head_dim)  # dot operands: one dtype
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, gp - group), (0, 0)))  # [T, KVH, GP, D]
    kernel = functools.partial(
        _decode_kernel, scale=scale, pages_per_block=pages_per_block, pages_per_split=pages_per_split,
        num_splits=num_splits, min_blocks=min_blocks,
        sliding_window=sliding_window, soft_cap=soft_cap, per_page=per_page, block_softmax=block_softmax,
        skip_empty=SKIP_EMPTY, tail_mask=TAIL_MASK if tail_mask is None else tail_mask,
    )
    pages_spec = pl.BlockSpec((k_pages.shape[0], block_size, None, head_dim), lambda t, h, s: (0, 0, h, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads, num_splits),
        in_specs=[
            _WHOLE, _WHOLE, _WHOLE,
            pl.BlockSpec((None, None, gp, head_dim), lambda t, h, s: (t, h, 0, 0)),
            pages_spec, pages_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, head_dim), lambda t, h, s: (t, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda t, h, s: (t, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_kv_heads, num_splits, gp, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_tokens, num_kv_heads, num_splits, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=(f"paged_decode_{('pb' if block_softmax else 'pp') if per_page else 'np'}{pages_per_block}"
              f"_ns{num_splits}_gp{gp}_w{num_warps}_s{num_stages}"),
    )(token_seq.astype(jnp.int32), positions.astype(jnp.int32), block_tables, q4, k_pages, v_pages)
    o, lse = o[:, :, :, :group], lse[:, :, :, :group]  # [T, KVH, NS, G, D], [T, KVH, NS, G]
    out, lse_out = merge_splits(o, lse)  # [T, KVH, G, D], [T, KVH, G]
    out = out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
    if not return_lse:
        return out
    return out, lse_out.reshape(num_tokens, num_heads)
