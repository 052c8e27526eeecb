"""Pallas (Triton lowering) kernels for a decode step's MLP block in two launches, where XLA runs five (the
RMSNorm, the up GEMM, the activation, the down GEMM with its split-K reduction, and the residual add).

`up`: grid `(I / BN,)`. Program j first sums the squares of the few rows of x over D (they are small: M <= 64 rows
of D values, read from L2), then walks D in blocks of BK: each block of x normalised in registers as
`reference.rms_norm` rounds it, times the `[BK, BN]` tiles of the gate's and the up projection's columns j (fp32
accumulation); the activation is applied to the two tiles (rounded to the activations' dtype, then in fp32) and
`[M, BN]` of h written. `down`: grid `(D / BN,)`,
h's rows times the down projection's `[BK, BN]` tiles, the product cast and added to x's columns. Rows are padded
to 16 (a tensor-core tile) by masked loads and stores, never in memory. Each weight tile is read once: the bytes are
the weights', as a GEMV's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from pallas_kernels.decode_mlp.reference import activate

_WHOLE = pl.no_block_spec


def _rows(num_rows: int) -> int:
    """Rows of a tile: a power of two from 16 holding `num_rows`."""
    return max(16, 1 << (num_rows - 1).bit_length())


def _load_rows(ref, rows: int, cols, num_rows: int):
    """`ref[:rows, cols]` with the rows past `num_rows` read as zeros (masked)."""
    mask = (jnp.arange(rows) < num_rows)[:, None]
    return plt.load(ref.at[pl.ds(0, rows), cols], mask=mask, other=0)


def _store_rows(ref, rows: int, cols, value, num_rows: int):
    plt.store(ref.at[pl.ds(0, rows), cols], value, mask=(jnp.arange(rows) < num_rows)[:, None])


def _up_kernel(x_ref, norm_ref, w_ref, h_ref, *, num_rows: int, dim: int, inner: int, act: str, eps: float,
               zero_centred: bool, block_n: int, block_k: int):
    rows = _rows(num_rows)
    col = pl.multiple_of(pl.program_id(0) * block_n, block_n)
    dtype = x_ref.dtype

    def squares(kb, ss):
        xk = _load_rows(x_ref, rows, pl.ds(pl.multiple_of(kb * block_k, block_k), block_k), num_rows)
        xk = xk.astype(jnp.float32)
        return ss + jnp.sum(xk * xk, axis=1)

    ss = jax.lax.fori_loop(0, dim // block_k, squares, jnp.zeros((rows,), jnp.float32))
    rstd = jax.lax.rsqrt(ss / dim + eps)

    def body(kb, accs):
        k0 = pl.multiple_of(kb * block_k, block_k)
        ks = pl.ds(k0, block_k)
        xn = _load_rows(x_ref, rows, ks, num_rows).astype(jnp.float32) * rstd[:, None]
        w = norm_ref[ks].astype(jnp.float32)
        if zero_centred:
            xn = (xn * (1.0 + w)[None, :]).astype(dtype)
        else:
            xn = (w[None, :] * xn.astype(dtype).astype(jnp.float32)).astype(dtype)
        up = w_ref[ks, pl.ds(col + (inner if act == "silu" else 0), block_n)]
        out = (accs[0] + jnp.dot(xn, up, preferred_element_type=jnp.float32),)
        if act == "silu":
            out += (accs[1] + jnp.dot(xn, w_ref[ks, pl.ds(col, block_n)], preferred_element_type=jnp.float32),)
        return out

    zero = jnp.zeros((rows, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, dim // block_k, body, (zero,) * (2 if act == "silu" else 1))
    rounded = [a.astype(dtype).astype(jnp.float32) for a in accs]  # the projections' outputs as XLA rounds them
    h = activate(rounded[0], act, rounded[1] if act == "silu" else None)  # in fp32 (Triton divides no bf16)
    _store_rows(h_ref, rows, pl.ds(col, block_n), h.astype(h_ref.dtype), num_rows)


def _down_kernel(h_ref, w_ref, x_ref, o_ref, *, num_rows: int, inner: int, block_n: int, block_k: int):
    rows = _rows(num_rows)
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        return acc + jnp.dot(_load_rows(h_ref, rows, ks, num_rows), w_ref[ks, cols], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, inner // block_k, body, jnp.zeros((rows, block_n), jnp.float32))
    out = _load_rows(x_ref, rows, cols, num_rows) + acc.astype(o_ref.dtype)
    _store_rows(o_ref, rows, cols, out.astype(o_ref.dtype), num_rows)


@functools.partial(jax.jit, static_argnames=("eps", "zero_centred", "act", "up_block_n", "down_block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def decode_mlp_pallas(x: Float[Array, "M D"], norm_w: Float[Array, "D"], w_in: Float[Array, "D N"],
                      w_down: Float[Array, "I D"], *, eps: float, zero_centred: bool, act: str, up_block_n: int = 32,
                      down_block_n: int = 16, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                      interpret: bool = False) -> Float[Array, "M D"]:
    """`decode_mlp_reference` in two kernels (`up`, `down`). M <= 64 rows; D and I multiples of `block_k`, I of
    `up_block_n` and D of `down_block_n` (powers of two)."""
    num_rows, dim = x.shape
    inner = w_down.shape[0]
    if num_rows > 64 or dim % block_k or inner % block_k or inner % up_block_n or dim % down_block_n:
        raise ValueError(f"decode_mlp_pallas: {num_rows} rows, D={dim}, I={inner} do not tile with {block_k=}, "
                         f"{up_block_n=}, {down_block_n=} (at most 64 rows)")
    if w_in.shape != (dim, inner * (2 if act == "silu" else 1)):
        raise ValueError(f"the up projection {w_in.shape} does not match D={dim}, I={inner} for {act=}")
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    up = functools.partial(_up_kernel, num_rows=num_rows, dim=dim, inner=inner, act=act, eps=eps,
                           zero_centred=zero_centred, block_n=up_block_n, block_k=block_k)
    h = pl.pallas_call(up, grid=(inner // up_block_n,), in_specs=[_WHOLE] * 3, out_specs=_WHOLE,
                       out_shape=jax.ShapeDtypeStruct((num_rows, inner), x.dtype), compiler_params=params,
                       interpret=interpret, name=f"decode_mlp_up_{act}_bn{up_block_n}_bk{block_k}")(x, norm_w, w_in)
    down = functools.partial(_down_kernel, num_rows=num_rows, inner=inner, block_n=down_block_n, block_k=block_k)
    return pl.pallas_call(down, grid=(dim // down_block_n,), in_specs=[_WHOLE] * 3, out_specs=_WHOLE,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=params,
                          interpret=interpret, name=f"decode_mlp_down_bn{down_block_n}_bk{block_k}")(h, w_down, x)
