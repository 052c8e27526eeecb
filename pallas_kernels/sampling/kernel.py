"""Pallas (Triton lowering) kernel for the top-k / top-p thresholds of `reference.py`: both in one launch.

Grid `(B,)`: program b owns row b of the logits `[B, V]` (V: the vocabulary here, as in `jhybrid.engine.sampling`)
and walks it in tiles of `block` tokens (the last one masked: keys past V are the lowest key, with weight 0), once
per radix pass, so the row is re-read from L2 rather than HBM. Keys are int32 whose *signed* order is the float
order (the uint32 order key xor 2**31).

  1. top-k: `32 / R` passes, each deciding R more bits of kth from the top. A pass counts, over the tokens whose
     key starts with the bits decided so far (the *bucket*), `digit >= c` for every candidate digit c of the next
     R bits: a `[block, 2**R]` compare added elementwise into per-lane sums carried across the tiles (one
     reduction at the end of the pass, none per tile). With the count above the bucket carried from the previous
     pass, the digit is the number of candidates c >= 1 whose count reaches k. The first pass also takes the row's
     max logit, its min key (k = V: kth is the min key, the other passes are skipped) and each group's max key.
  2. the softmax of the top-k set: weights `exp(x - max)` of the tokens with key >= kth (0 elsewhere); their sum
     Z comes from the first top-p pass (the mass at candidate 0, the whole row).
  3. top-p: the same passes over those weights, with target `top_p * Z` (skipped where top_p >= 1: pth = 0).

A loop iteration reads a *group* of `unroll` tiles, all loads issued before the first use (one program per row
has only its own loads to hide the memory latency with). `skip`: a pass reads a group only if the group's max key
(from pass 1) reaches the smallest key that can change a candidate sum; after a few passes the bucket holds a
handful of tokens, so most groups are not read at all.

Exactness: counts are int32 (exact); the masses are float32 sums in another order than XLA's softmax + row
sums, and compared as `mass >= top_p * Z` rather than `mass / Z >= top_p`, so pth can differ from the
reference's only where a cumulative mass lies within float32 rounding of `top_p`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.sampling.reference import clamp_top_k

INT_MIN = -(2**31)
INT_MAX = 2**31 - 1
_WHOLE = pl.no_block_spec  # the whole array, indexed inside the kernel
RADIX_BITS = (1, 2, 4, 8)  # bits a pass (R) the kernel takes: divisors of 32


def _srl(x, n: int):
    return jax.lax.shift_right_logical(x, jnp.int32(n))


def signed_keys(x: Float[Array, "..."]) -> Array:
    """int32 keys whose signed order is the float32 order of `x` (the order keys xor 2**31)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ (jax.lax.shift_right_arithmetic(bits, jnp.int32(31)) & INT_MAX)


def _thresholds_kernel(x_ref, k_ref, p_ref, kth_ref, pth_ref, gmax_ref, *, vocab: int, block: int, unroll: int,
                       bits: int, skip: bool, table: bool, eviction: str | None):
    # x_ref [B, V] float32 (whole); k_ref [B] int32 counts in [1, V]; p_ref [B] float32; kth_ref / pth_ref [B]
    # int32: the thresholds as uint32 order keys (bit patterns)
    row = pl.program_id(0)
    num_tiles = pl.cdiv(vocab, block)
    width = 1 << bits
    num_passes = 32 // bits
    group = block * unroll  # tokens read per loop iteration: `unroll` tiles, all loads issued before any use
    num_groups = pl.cdiv(vocab, group)
    digits = jnp.arange(width, dtype=jnp.int32)  # [W] candidate digits
    lanes = jnp.arange(block, dtype=jnp.int32)  # [block]
    group_ids = jnp.arange(pl.next_power_of_2(num_groups), dtype=jnp.int32)  # [NG]
    k = k_ref[row]
    p = p_ref[row]

    def load(i):
        start = pl.multiple_of(i * block, block)
        valid = start + lanes < vocab
        x = plt.load(x_ref.at[row, pl.ds(start, block)], mask=valid, other=-jnp.inf, eviction_policy=eviction)
        return x, jnp.where(valid, signed_keys(x), INT_MIN), valid  # [block] logits, keys (padding: lowest), mask

    def load_group(g):
        return [load(g * unroll + t) for t in range(unroll)]

    def digit_ge(s, shift, ans):
        """[block, W]: the token is in the bucket of `ans` (prefix above bit shift + R) and its digit is >= c."""
        u = s ^ INT_MIN  # unsigned-order bit pattern
        d = _srl(u, shift) & (width - 1)
        if shift + bits < 32:
            d = jnp.where(_srl(u ^ ans, shift + bits) == 0, d, -1)
        return d[:, None] >= digits[None, :]

    def bucket_sums(shift, ans, lo, group_max, weigh, dtype):
        """[W]: per candidate digit, the summed weight (count if `weigh` is None) of the bucket's tokens at or
        above it. Sums stay per lane ([block, W], elementwise adds) until the pass ends; with `skip`, groups whose
        max key is below `lo` (signed) are not read."""

        def group_sums(g, acc):
            for x, s, _ in load_group(g):
                ge = digit_ge(s, shift, ans)
                acc = acc + (ge.astype(jnp.int32) if weigh is None else jnp.where(ge, weigh(x, s)[:, None], 0.0))
            return acc

        def body(g, acc):
            if not skip:
                return group_sums(g, acc)
            if table:  # written by this program in pass 1 (every thread stores the value and reads it back)
                needed = gmax_ref[row, g] >= lo
            else:  # a reduction over the group max vector, each iteration
                needed = jnp.max(jnp.where(group_ids == g, group_max, INT_MIN)) >= lo
            return jax.lax.cond(needed, functools.partial(group_sums, g), lambda a: a, acc)

        acc = jax.lax.fori_loop(0, num_groups, body, jnp.zeros((block, width), dtype))
        return jnp.sum(acc, axis=0)

    def choose(sums, above, target, shift, ans):
        """The next digit: how many candidates c >= 1 reach `target`; and the sum above the new bucket."""
        total = above + sums  # [W]
        digit = jnp.sum(((total >= target) & (digits >= 1)).astype(jnp.int32))
        nxt = digit + 1
        above = jnp.sum(jnp.where(digits == nxt, total, 0)) + jnp.where(nxt == width, above, 0)
        return ans | jax.lax.shift_left(digit, jnp.int32(shift)), above.astype(total.dtype)

    # ---- top-k, pass 1 (+ the row's max logit, min key and each group's max key)
    top = 32 - bits

    def first_body(g, carry):
        acc, group_max, x_max, s_min = carry
        g_max = jnp.full((block,), INT_MIN, jnp.int32)
        for x, s, valid in load_group(g):
            acc = acc + (_srl(s ^ INT_MIN, top)[:, None] >= digits[None, :]).astype(jnp.int32)
            g_max = jnp.maximum(g_max, s)
            s_min = jnp.minimum(s_min, jnp.where(valid, s, INT_MAX))
            x_max = jnp.maximum(x_max, x)
        g_max = jnp.max(g_max)
        if table:
            gmax_ref[row, g] = g_max
        else:
            group_max = jnp.where(group_ids == g, g_max, group_max)
        return acc, group_max, x_max, s_min

    init = (jnp.zeros((block, width), jnp.int32), jnp.full(group_ids.shape, INT_MIN, jnp.int32),
            jnp.full((block,), -jnp.inf, jnp.float32), jnp.full((block,), INT_MAX, jnp.int32))
    acc, group_max, x_max, s_min = jax.lax.fori_loop(0, num_groups, first_body, init)
    x_max, s_min = jnp.max(x_max), jnp.min(s_min)
    kth, above = choose(jnp.sum(acc, axis=0), jnp.int32(0), k, top, jnp.int32(0))

    def rest_of_top_k(kth, above):
        for j in range(1, num_passes):
            shift = top - bits * j
            lo = (kth | (1 << shift)) ^ INT_MIN
            sums = bucket_sums(shift, kth, lo, group_max, None, jnp.int32)
            kth, above = choose(sums, above, k, shift, kth)
        return kth

    kth = jax.lax.cond(k >= vocab, lambda *_: s_min ^ INT_MIN, rest_of_top_k, kth, above)
    kth_s = kth ^ INT_MIN
    m = jnp.where(x_max == -jnp.inf, 0.0, x_max)

    def weigh(x, s):
        return jnp.where(s >= kth_s, jnp.exp(x - m), 0.0)

    # ---- top-p over the softmax of the top-k set
    def top_p_passes(_):
        sums = bucket_sums(top, jnp.int32(0), kth_s, group_max, weigh, jnp.float32)
        target = p * jnp.sum(jnp.where(digits == 0, sums, 0.0))  # top_p * Z (no slicing in Triton)
        pth, above = choose(sums, jnp.float32(0.0), target, top, jnp.int32(0))
        for j in range(1, num_passes):
            shift = top - bits * j
            lo = jnp.maximum((pth | (1 << shift)) ^ INT_MIN, kth_s)
            sums = bucket_sums(shift, pth, lo, group_max, weigh, jnp.float32)
            pth, above = choose(sums, above, target, shift, pth)
        return pth

    # (a branch of a Triton `cond` must return values computed in it, not constants)
    pth = jax.lax.cond(p < 1.0, top_p_passes, lambda kth: kth & 0, kth)
    kth_ref[row] = kth
    pth_ref[row] = pth


@functools.partial(jax.jit, static_argnames=("block", "unroll", "bits", "num_warps", "num_stages", "skip", "table",
                                             "eviction", "interpret"))
def top_k_top_p_thresholds_pallas(
    logits: Float[Array, "B V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    *,
    block: int = 256,
    unroll: int = 4,
    bits: int = 4,
    num_warps: int = 4,
    num_stages: int = 1,
    skip: bool = True,
    table: bool = True,
    eviction: str | None = None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Same arguments and result as `top_k_top_p_thresholds_reference`: (kth, pth) `[B]` uint32 order keys.
    `block` (a power of two) is the tile of the vocabulary, `unroll` the tiles read per loop iteration (their
    loads in flight together), `bits` (R, one of `RADIX_BITS`) the key bits a pass decides, `skip` the group
    skipping of the module docstring (`table`: the group maxima kept in a scratch output `[B, NG]` and read back
    as scalars, rather than picked out of a register vector by a reduction each iteration), `eviction` the
    loads' L2 eviction policy (e.g. "evict_last")."""
    if block <= 0 or block & (block - 1) or bits not in RADIX_BITS:
        raise ValueError(f"top_k_top_p_thresholds_pallas needs a power-of-two block and bits in {RADIX_BITS}, "
                         f"got {block=} {bits=}")
    num_rows, vocab = logits.shape
    kernel = functools.partial(_thresholds_kernel, vocab=vocab, block=block, unroll=unroll, bits=bits, skip=skip,
                               table=table,
                               eviction=eviction)
    num_groups = pl.cdiv(vocab, block * unroll)
    kth, pth, _ = pl.pallas_call(
        kernel,
        grid=(num_rows,),
        in_specs=[_WHOLE, _WHOLE, _WHOLE],
        out_specs=[_WHOLE, _WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((num_rows,), jnp.int32)] * 2  # kth, pth
        + [jax.ShapeDtypeStruct((num_rows, num_groups), jnp.int32)],  # each group's max key (`table`; scratch)
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"top_k_top_p_blk{block}x{unroll}_r{bits}_w{num_warps}_st{num_stages}{('_skipt' if table else '_skip') if skip else ''}",
    )(logits.astype(jnp.float32), clamp_top_k(top_k, vocab), top_p.astype(jnp.float32))
    return (jax.lax.bitcast_convert_type(kth, jnp.uint32), jax.lax.bitcast_convert_type(pth, jnp.uint32))
