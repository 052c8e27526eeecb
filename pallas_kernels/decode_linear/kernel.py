"""Pallas (Triton lowering) kernel for a decode step's projection with what XLA leaves around it fused in: the
input's RMSNorm before it, the activation and the residual add after it (`reference.decode_linear_reference`).

Grid `(N_out / BN,)`. With a norm, program j first sums the squares of the few rows of x over K (M <= 64 rows of K
values, read from L2), then walks K in blocks of BK: each block of x (normalised in registers as
`reference.rms_norm` rounds it) times the weight's `[BK, BN]` tile of columns j (with SwiGLU also the up
projection's tile, `N / 2` columns on), accumulated in fp32. The product is rounded to the activations' dtype, the
activation applied in fp32, the residual's columns added, and `[M, BN]` of the output written. Rows are padded to
16 (a tensor-core tile) by masked loads and stores, never in memory. Each weight tile is read once: the bytes are the
weight's, as a GEMV's. XLA runs the same as up to five kernels (a norm, the GEMM, its split-K reduction, the
activation, the residual add); a dense MLP block is two of these (`decode_mlp_pallas`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from pallas_kernels.decode_linear.reference import activate

_WHOLE = pl.no_block_spec
MAX_ROWS = 64  # every row of a tile stays in registers: decode buckets up to this many rows


def _rows(num_rows: int) -> int:
    """Rows of a tile: a power of two from 16 holding `num_rows`."""
    return max(16, 1 << (num_rows - 1).bit_length())


def _load_rows(ref, rows: int, cols, num_rows: int):
    """`ref[:rows, cols]` with the rows past `num_rows` read as zeros (masked)."""
    return plt.load(ref.at[pl.ds(0, rows), cols], mask=(jnp.arange(rows) < num_rows)[:, None], other=0)


def _kernel(x_ref, w_ref, *refs, num_rows: int, k_dim: int, n_out: int, has_norm: bool, has_residual: bool,
            act: str | None, eps: float, zero_centred: bool, block_n: int, block_k: int):
    norm_ref = refs[0] if has_norm else None
    res_ref = refs[int(has_norm)] if has_residual else None
    o_ref = refs[-1]
    rows = _rows(num_rows)
    col = pl.multiple_of(pl.program_id(0) * block_n, block_n)
    dtype = x_ref.dtype
    num_k = k_dim // block_k
    at = lambda kb: pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)  # noqa: E731

    if has_norm:
        def squares(kb, ss):
            xk = _load_rows(x_ref, rows, at(kb), num_rows).astype(jnp.float32)
            return ss + jnp.sum(xk * xk, axis=1)

        rstd = jax.lax.rsqrt(jax.lax.fori_loop(0, num_k, squares, jnp.zeros((rows,), jnp.float32)) / k_dim + eps)

    def body(kb, accs):
        ks = at(kb)
        xk = _load_rows(x_ref, rows, ks, num_rows)
        if has_norm:
            xn = xk.astype(jnp.float32) * rstd[:, None]
            w = norm_ref[ks].astype(jnp.float32)
            if zero_centred:
                xk = (xn * (1.0 + w)[None, :]).astype(dtype)
            else:
                xk = (w[None, :] * xn.astype(dtype).astype(jnp.float32)).astype(dtype)
        out = (accs[0] + jnp.dot(xk, w_ref[ks, pl.ds(col + (n_out if act == "silu" else 0), block_n)],
                                 preferred_element_type=jnp.float32),)
        if act == "silu":  # the gate's columns
            out += (accs[1] + jnp.dot(xk, w_ref[ks, pl.ds(col, block_n)], preferred_element_type=jnp.float32),)
        return out

    zero = jnp.zeros((rows, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, num_k, body, (zero,) * (2 if act == "silu" else 1))
    y = accs[0].astype(dtype)  # the projection's output as XLA rounds it
    if act is not None:  # in fp32 (Triton divides no bf16), rounded back
        rounded = [a.astype(dtype).astype(jnp.float32) for a in accs]
        y = activate(rounded[0], act, rounded[1] if act == "silu" else None).astype(dtype)
    cols = pl.ds(col, block_n)
    if has_residual:
        y = (_load_rows(res_ref, rows, cols, num_rows) + y).astype(o_ref.dtype)
    plt.store(o_ref.at[pl.ds(0, rows), cols], y.astype(o_ref.dtype), mask=(jnp.arange(rows) < num_rows)[:, None])


def default_block_n(n_out: int) -> int:
    """Output columns a program: 32, or 16 below 4096 columns (more programs for the narrow projections: the H200 has
    132 SMs, and a program streams its whole K)."""
    block = 32 if n_out >= 4096 else 16
    while n_out % block and block > 16:
        block //= 2
    return block


def supported(num_rows: int, k_dim: int, n_out: int, block_k: int = 128) -> bool:
    """At most `MAX_ROWS` rows, K a multiple of `block_k`, the output columns of 16."""
    return num_rows <= MAX_ROWS and k_dim % block_k == 0 and n_out % 16 == 0


@functools.partial(jax.jit, static_argnames=("eps", "zero_centred", "act", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def decode_linear_pallas(x: Float[Array, "M K"], w: Float[Array, "K N"], *, norm_w: Array | None = None,
                         eps: float = 1e-6, zero_centred: bool = False, act: str | None = None,
                         residual: Array | None = None, block_n: int | None = None, block_k: int = 128,
                         num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> Array:
    """`decode_linear_reference` in one kernel (`supported` shapes)."""
    num_rows, k_dim = x.shape
    n_out = w.shape[1] // (2 if act == "silu" else 1)
    block_n = block_n or default_block_n(n_out)
    if not supported(num_rows, k_dim, n_out, block_k) or n_out % block_n or w.shape[0] != k_dim:
        raise ValueError(f"decode_linear_pallas: x {x.shape}, w {w.shape} ({act=}) do not tile with {block_k=}, "
                         f"{block_n=} (at most {MAX_ROWS} rows)")
    if residual is not None and residual.shape != (num_rows, n_out):
        raise ValueError(f"the residual {residual.shape} is not the output's {(num_rows, n_out)}")
    kernel = functools.partial(_kernel, num_rows=num_rows, k_dim=k_dim, n_out=n_out, has_norm=norm_w is not None,
                               has_residual=residual is not None, act=act, eps=eps, zero_centred=zero_centred,
                               block_n=block_n, block_k=block_k)
    operands = [x, w] + ([norm_w] if norm_w is not None else []) + ([residual] if residual is not None else [])
    parts = ("norm_" if norm_w is not None else "") + (f"{act}_" if act else "") + (
        "res_" if residual is not None else "")
    return pl.pallas_call(kernel, grid=(n_out // block_n,), in_specs=[_WHOLE] * len(operands), out_specs=_WHOLE,
                          out_shape=jax.ShapeDtypeStruct((num_rows, n_out), x.dtype),
                          compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          interpret=interpret, name=f"decode_linear_{parts}bn{block_n}_bk{block_k}")(*operands)


def decode_mlp_pallas(x: Float[Array, "M D"], norm_w: Float[Array, "D"], w_in: Float[Array, "D N"],
                      w_down: Float[Array, "I D"], *, eps: float, zero_centred: bool, act: str,
                      interpret: bool = False, **tuning) -> Float[Array, "M D"]:
    """`decode_mlp_reference` in two kernels: the norm, the up (and gate) projection and the activation; the down
    projection and the residual."""
    h = decode_linear_pallas(x, w_in, norm_w=norm_w, eps=eps, zero_centred=zero_centred, act=act, interpret=interpret,
                             **tuning)
    return decode_linear_pallas(h, w_down, residual=x, interpret=interpret, **tuning)
