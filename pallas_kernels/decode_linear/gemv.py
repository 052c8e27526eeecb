"""Pallas (Triton lowering) kernel for a decode step's plain projection `x @ w`, shaped as a memory-bound GEMV:
few rows (at most `MAX_ROWS`), the weight streamed once from HBM by programs that split both its columns and K.

Grid `(N / BN, S)`. Program `(j, s)` walks its share of K (`K / S` rows of the weight) in blocks of BK, each
`[BK, BN]` tile of the weight (BN contiguous columns: 2 x BN bytes a row in bf16) times the rows' `[16, BK]` block
of x (rows padded to a tensor-core tile by masked loads, never in memory), accumulated in fp32. With S = 1 it
writes `[M, BN]` of the output in x's dtype; with S > 1 it writes fp32 partial sums `[S * M, N]` that
`gemv_pallas` adds (an XLA reduction, which fuses the sum, the cast and whatever follows, e.g. a residual add).

Why a kernel of our own (issue 20): at one decode row XLA's GEMMs stream a qwen3_next-shaped step's weights at
2.8-3.3 TB/s on the H200 (benchmarks/RESULTS.md, session 28) against a copy's 4.3 TB/s, and the projections are most
of a batch-1 token. `benchmarks/gemv.py` sweeps this kernel's tiles against XLA's dot, cuBLAS (torch) and a copy of
the same bytes, per weight shape of the benchmark models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

_WHOLE = pl.no_block_spec
MAX_ROWS = 16  # one tensor-core tile of rows: the decode buckets where a step is a GEMV


def _kernel(x_ref, w_ref, o_ref, *, num_rows: int, block_n: int, block_k: int, k_split: int):
    col = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    split = pl.program_id(1)
    row_mask = (jnp.arange(MAX_ROWS) < num_rows)[:, None]

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(split * k_split + i * block_k, block_k), block_k)
        xk = plt.load(x_ref.at[pl.ds(0, MAX_ROWS), ks], mask=row_mask, other=0)
        return acc + jnp.dot(xk, w_ref[ks, col], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_split // block_k, body, jnp.zeros((MAX_ROWS, block_n), jnp.float32))
    rows = pl.ds(split * num_rows, MAX_ROWS)  # split s's rows of the `[S * M, N]` output
    plt.store(o_ref.at[rows, col], acc.astype(o_ref.dtype), mask=row_mask)


# Where the kernel beat XLA's GEMM by more than 10% on the H200 at 4 rows (the batch-1 decode bucket), the tiles that
# did, by weight shape (K, N): benchmarks/RESULTS.md, "Session 32" (`benchmarks/gemv.py`, JSON
# benchmarks/results/gemv-2026-12-05-s32.json). XLA was as fast or faster at every other shape of the benchmark models
# (the widest by 0-10%, the LM heads, the down projections of K 4096 and 8192), so `tiles_for` gives None there.
MEASURED_TILES = {
    (2048, 8192): dict(block_n=64, block_k=128, splits=2),  # 12.7 us against XLA's 23.1
    (5632, 2048): dict(block_n=256, block_k=64, splits=88),  # 11.6 against 13.6
    (2048, 4096): dict(block_n=256, block_k=64, splits=16),  # 9.3 against 13.7
    (2048, 2560): dict(block_n=64, block_k=128, splits=16),  # 7.6 against 12.8
    (2048, 2048): dict(block_n=256, block_k=128, splits=16),  # 7.4 against 10.4
}


def tiles_for(k_dim: int, n_out: int) -> dict | None:
    """The measured tiles for a `[K, N]` weight where the kernel beat XLA (`MEASURED_TILES`), else None."""
    return MEASURED_TILES.get((k_dim, n_out))


def supported(num_rows: int, k_dim: int, n_out: int, block_n: int, block_k: int, splits: int) -> bool:
    """At most `MAX_ROWS` rows; the columns a multiple of `block_n`; K a multiple of `splits * block_k`."""
    return 1 <= num_rows <= MAX_ROWS and n_out % block_n == 0 and k_dim % (splits * block_k) == 0


def default_tiles(k_dim: int, n_out: int, num_programs: int = 528) -> dict:
    """Tiles for a `[K, N]` weight: 128 columns a program (256 bytes a row in bf16), 128 rows of K a block, and K
    split into the most parts (a divisor of its blocks) that keeps the programs at most `num_programs` (4 per SM of
    the H200's 132)."""
    block_n = 128 if n_out % 128 == 0 else 64 if n_out % 64 == 0 else 32
    block_k = 128 if k_dim % 128 == 0 else 64
    blocks, columns = k_dim // block_k, n_out // block_n
    splits = max(s for s in range(1, blocks + 1) if blocks % s == 0 and (s == 1 or columns * s <= num_programs))
    return dict(block_n=block_n, block_k=block_k, splits=splits)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "splits", "num_warps", "num_stages", "interpret"))
def gemv_pallas(x: Float[Array, "M K"], w: Float[Array, "K N"], *, block_n: int | None = None,
                block_k: int | None = None, splits: int | None = None, num_warps: int = 4, num_stages: int = 3,
                interpret: bool = False) -> Float[Array, "M N"]:
    """`x @ w` (fp32 accumulation, rounded to x's dtype) for `supported` shapes; tiles default to `default_tiles`."""
    num_rows, k_dim = x.shape
    n_out = w.shape[1]
    tiles = default_tiles(k_dim, n_out)
    block_n, block_k, splits = block_n or tiles["block_n"], block_k or tiles["block_k"], splits or tiles["splits"]
    if w.shape[0] != k_dim or not supported(num_rows, k_dim, n_out, block_n, block_k, splits):
        raise ValueError(f"gemv_pallas: x {x.shape}, w {w.shape} do not tile with {block_n=}, {block_k=}, {splits=} "
                         f"(at most {MAX_ROWS} rows)")
    out_shape = (splits * num_rows, n_out)
    kernel = functools.partial(_kernel, num_rows=num_rows, block_n=block_n, block_k=block_k,
                               k_split=k_dim // splits)
    y = pl.pallas_call(kernel, grid=(n_out // block_n, splits), in_specs=[_WHOLE, _WHOLE], out_specs=_WHOLE,
                       out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype if splits == 1 else jnp.float32),
                       compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                       interpret=interpret, name=f"gemv_bn{block_n}_bk{block_k}_s{splits}")(x, w)
    return y if splits == 1 else jnp.sum(y.reshape(splits, num_rows, n_out), axis=0).astype(x.dtype)
