"""Pallas (Triton lowering) kernel for the block-wise FP8 matmul of `reference.py`: W8A8 on FP8 tensor cores.

Grid `(M / BM, Npad / BN, S)`: program (i, j, s) owns the output tile `y[i*BM:(i+1)*BM, j*BN:(j+1)*BN]` over the
s-th of S ranges of K blocks (split-K: S > 1 when the output has too few tiles to keep the SMs streaming
weights, as at decode; the S fp32 partial tiles are summed by XLA). It walks its K blocks of 128: takes the
`[BM, 128]` activation tile as FP8 with a scale per row (quantized here from bf16 / fp32, or read as
quantized beforehand by XLA: `prequantized`, which saves each of the Npad / BN programs redoing it),
multiplies it by the `[BN, 128]` FP8 weight tile on the tensor cores with an fp32 result, and adds the product
times `s_x[row] * s_w[block]`. `BN` divides 128, so a tile lies in one scale block of the weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from pallas_kernels.fp8_matmul.reference import _TINY, BLOCK, FP8, FP8_MAX, quantize_rows

NUM_SMS = 132  # the H200's; split-K aims for two programs per SM


def _fp8_matmul_kernel(*refs, num_k_blocks: int, per_split: int, prequantized: bool):
    # x_ref [BM, K] (FP8 with sx_ref [BM, KB] when prequantized, else bf16 / fp32); w_ref [BN, K] float8_e4m3fn;
    # scale_ref [KB]: the scales of the weight's block row; o_ref [BM, BN] (S == 1) or this split's fp32 partial
    if prequantized:
        x_ref, sx_ref, w_ref, scale_ref, o_ref = refs
    else:
        x_ref, w_ref, scale_ref, o_ref = refs
    lo = pl.program_id(2) * per_split

    def body(b, acc):
        cols = pl.ds(pl.multiple_of(b * BLOCK, BLOCK), BLOCK)
        if prequantized:
            x_q, s_x = x_ref[:, cols], sx_ref[:, b]  # [BM, BK], [BM]
        else:
            x = x_ref[:, cols].astype(jnp.float32)  # [BM, BK]
            s_x = jnp.maximum(jnp.max(jnp.abs(x), axis=1), _TINY) / FP8_MAX  # [BM]
            x_q = jnp.clip(x / s_x[:, None], -FP8_MAX, FP8_MAX).astype(FP8)
        prod = jax.lax.dot_general(x_q, w_ref[:, cols], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [BM, BN]
        return acc + prod * (s_x[:, None] * scale_ref[b])

    acc = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, num_k_blocks), body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def default_split(num_tiles: int, num_k_blocks: int) -> int:
    """Splits of K that give at least two programs per SM (at most one K block per split)."""
    return max(1, min(num_k_blocks, -(-2 * NUM_SMS // num_tiles)))


@functools.partial(jax.jit, static_argnames=("n", "block_m", "block_n", "split_k", "prequantized", "num_warps",
                                             "num_stages", "interpret"))
def fp8_matmul_pallas(
    x: Float[Array, "M K"],
    w: Array,  # [Npad, K] float8_e4m3fn
    scale: Float[Array, "NB KB"],
    *,
    n: int,
    block_m: int | None = None,
    block_n: int = 64,
    split_k: int | None = 1,
    prequantized: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> Float[Array, "M N"]:
    """Same arguments and result as `fp8_matmul_reference`. `block_m` (default: the smallest power of two
    >= M, between 16 and 64) and `block_n` (a power of two dividing 128) are the output tile; `split_k` the K
    splits (None: `default_split`); `prequantized`: quantize the activations in XLA first."""
    m, k = x.shape
    n_pad = w.shape[0]
    num_k_blocks = k // BLOCK
    if 128 % block_n or k % BLOCK or n_pad % BLOCK:
        raise ValueError(f"fp8_matmul_pallas needs K and Npad multiples of {BLOCK} and block_n dividing it, "
                         f"got K={k} Npad={n_pad} {block_n=}")
    if block_m is None:
        block_m = min(64, max(16, pl.next_power_of_2(m)))
    m_pad = -m % block_m
    tiles = ((m + m_pad) // block_m, n_pad // block_n)
    splits = default_split(tiles[0] * tiles[1], num_k_blocks) if split_k is None else min(split_k, num_k_blocks)
    per_split = -(-num_k_blocks // splits)
    splits = -(-num_k_blocks // per_split)  # no empty split
    xp = jnp.pad(x, ((0, m_pad), (0, 0))) if m_pad else x
    operands = [xp]
    in_specs = [pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0))]
    if prequantized:
        x_q, s_x = quantize_rows(xp, barrier=False)
        operands = [x_q, s_x]
        in_specs.append(pl.BlockSpec((block_m, num_k_blocks), lambda i, j, s: (i, 0)))
    in_specs += [pl.BlockSpec((block_n, k), lambda i, j, s: (j, 0)),
                 pl.BlockSpec((None, num_k_blocks), lambda i, j, s: (j * block_n // BLOCK, 0))]
    if splits == 1:
        out_spec = pl.BlockSpec((block_m, block_n), lambda i, j, s: (i, j))
        out_shape = jax.ShapeDtypeStruct((m + m_pad, n_pad), x.dtype)
    else:
        out_spec = pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j))
        out_shape = jax.ShapeDtypeStruct((splits, m + m_pad, n_pad), jnp.float32)
    kernel = functools.partial(_fp8_matmul_kernel, num_k_blocks=num_k_blocks, per_split=per_split,
                               prequantized=prequantized)
    out = pl.pallas_call(
        kernel,
        grid=(*tiles, splits),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"fp8_matmul_bm{block_m}_bn{block_n}_s{splits}{'_q' if prequantized else ''}_w{num_warps}_st{num_stages}",
    )(*operands, w, scale)
    if splits > 1:
        out = jnp.sum(out, axis=0).astype(x.dtype)
    return out[:m, :n]
