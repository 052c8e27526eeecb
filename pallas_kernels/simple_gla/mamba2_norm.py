"""Pallas (Triton lowering) kernel for a Mamba2 mixer's prefill output after its scan, up to its out projection's
input (`reference.mamba2_gated_norm_reference`): the D skip, the gate and the grouped RMS norm in one pass.

Grid `(T / BT, I / group_size)`: program (i, g) reads tokens `[i BT, (i + 1) BT)` of norm group g from the scan
output o, the conv output's x columns and the in_proj output's z columns (both read in place, where they sit in
the packed arrays), and writes the normed `[BT, group_size]` tile. Tokens past T are masked.

Why: XLA runs the same work as two kernels with the gated product written and read back in fp32 between them
(`loop_multiply_fusion` then the Triton norm fusion; it does not fuse the D skip's SiLU into the norm), ~190 us a
layer at NemotronH's 8k prefill on an H100, where the bytes this kernel moves (three bf16 reads, one write) take
~90 us at the read rate (benchmarks/RESULTS.md, "Session 42").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

_WHOLE = pl.no_block_spec


def _kernel(o_ref, x_ref, z_ref, d_ref, w_ref, out_ref, *, block_t: int, group_size: int, head_dim: int,
            num_tokens: int, eps: float, y_dtype, x_activated: bool):
    i, g = pl.program_id(0), pl.program_id(1)
    tokens = pl.ds(pl.multiple_of(i * block_t, block_t), block_t)
    mask = ((i * block_t + jnp.arange(block_t)) < num_tokens)[:, None]
    start = pl.multiple_of(g * group_size, group_size)
    cols = pl.ds(start, group_size)
    x = plt.load(x_ref.at[tokens, cols], mask=mask, other=0).astype(jnp.float32)
    d = d_ref[(start + jnp.arange(group_size)) // head_dim].astype(jnp.float32)  # D of each column's head
    o = plt.load(o_ref.at[tokens, cols], mask=mask, other=0).astype(jnp.float32)
    x = x if x_activated else x * jax.nn.sigmoid(x)
    y = (o + x * d[None, :]).astype(y_dtype).astype(jnp.float32)
    z = plt.load(z_ref.at[tokens, cols], mask=mask, other=0).astype(jnp.float32)
    h = y * (z * jax.nn.sigmoid(z))  # [BT, group_size]
    h = h * jax.lax.rsqrt(jnp.sum(h * h, axis=1, keepdims=True) / group_size + eps)
    out = w_ref[cols].astype(jnp.float32)[None, :] * h.astype(y_dtype).astype(jnp.float32)
    plt.store(out_ref.at[tokens, cols], out.astype(out_ref.dtype), mask=mask)


def supported(inner: int, group_size: int) -> bool:
    """Static check: a power-of-two norm group of 16 to 4096 channels dividing the mixer's I channels."""
    return 16 <= group_size <= 4096 and group_size & (group_size - 1) == 0 and inner % group_size == 0


def token_block(group_size: int) -> int:
    """Tokens a program: about 2k elements a tile, 1 to 32 tokens. At NemotronH's 8k layer (groups of 512) on an
    H100, 4 tokens at 4 warps took 0.111 ms, 8 tokens 0.118-0.119, 16 tokens 0.118-0.128, 32 tokens 0.128-0.137;
    XLA 0.208-0.212 (`benchmarks.prefill_fusions`, benchmarks/RESULTS.md, "Session 42" and "Session 43")."""
    return max(1, min(32, 2048 // group_size))


@functools.partial(jax.jit, static_argnames=("group_size", "eps", "out_dtype", "x_activated", "block_t",
                                             "num_warps", "interpret"))
def mamba2_gated_norm_pallas(o: Float[Array, "T HV V"], xbc: Float[Array, "T C"], z: Float[Array, "T Z"],
                             d_skip: Float[Array, "HV"], weight: Float[Array, "I"], *, group_size: int, eps: float,
                             out_dtype, x_activated: bool = False, block_t: int | None = None,
                             num_warps: int = 4, interpret: bool = False) -> Float[Array, "T I"]:
    """Same signature and result as `mamba2_gated_norm_reference` (`supported` shapes)."""
    num_tokens, heads, head_dim = o.shape
    inner = heads * head_dim
    if not supported(inner, group_size) or xbc.shape[1] < inner or z.shape[1] < inner or weight.shape != (inner,) \
            or d_skip.shape != (heads,) or xbc.shape[0] != num_tokens or z.shape[0] != num_tokens:
        raise ValueError(f"mamba2_gated_norm_pallas: o {o.shape}, xbc {xbc.shape}, z {z.shape}, d_skip "
                         f"{d_skip.shape}, weight {weight.shape}, {group_size=} do not fit")
    block_t = block_t or token_block(group_size)
    y_dtype = jnp.dtype(out_dtype)
    kernel = functools.partial(_kernel, block_t=block_t, group_size=group_size, head_dim=head_dim,
                               num_tokens=num_tokens, eps=eps, y_dtype=y_dtype, x_activated=x_activated)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(num_tokens, block_t), inner // group_size),
        in_specs=[_WHOLE] * 5, out_specs=_WHOLE,
        out_shape=jax.ShapeDtypeStruct((num_tokens, inner), jnp.result_type(weight.dtype, y_dtype)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name=f"mamba2_gated_norm_bt{block_t}_g{group_size}_w{num_warps}" + ("_xa" if x_activated else ""),
    )(o.reshape(num_tokens, inner), xbc, z, d_skip, weight)
