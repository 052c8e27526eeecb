"""One decode step of a MiniMax lightning-attention mixer from its packed in_proj output to the recurrence's output,
in one kernel.

The model's decode runs, per layer, the SiLU of q, k and v, three slices of the packed projection (head j's q, k
and v sit side by side: columns `[3 j hd, 3 (j + 1) hd)` of `proj = [qkv (3 H hd) | gate (H hd)]`), a broadcast of
the per-head decay to every row, and the scalar-decay recurrence (`fused_recurrent.py`) as kernels of their own.
Here one program per (row, head, block of the head's value channels) reads its q, k and v in place, applies SiLU
(in fp32, cast to the activations' dtype: the model's rounding) and the head's fixed decay `-slope[j]`, and runs
the recurrence. Output in the activations' dtype.

`lightning_decode_reference` is the same computation in jnp (the recurrence's reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.null_slot import load_state
from pallas_kernels.simple_gla.fused_recurrent import recurrent_step
from pallas_kernels.simple_gla.reference import fused_recurrent_simple_gla_reference

_WHOLE = pl.no_block_spec


def _silu(x, dtype):
    return jax.nn.silu(x.astype(jnp.float32)).astype(dtype)


def split_packed_decode(proj: Float[Array, "B P"], num_heads: int, head_dim: int):
    """(q, k, v) `[B, H, hd]` each, activated, from the packed in_proj output (head j: q | k | v)."""
    batch = proj.shape[0]
    qkv = _silu(proj[:, : 3 * num_heads * head_dim], proj.dtype).reshape(batch, num_heads, 3, head_dim)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def lightning_decode_in_parts(proj, slopes, state, slot_ids, *, num_heads: int, head_dim: int, recurrence):
    """The decode step in parts, the recurrence by `recurrence(q, k, v, g, state, slot_ids)` (the reference's, or
    the dispatched kernel)."""
    q, k, v = split_packed_decode(proj, num_heads, head_dim)
    g = jnp.broadcast_to(-slopes.astype(jnp.float32), (proj.shape[0], num_heads))
    return recurrence(q, k, v, g, state, slot_ids)


def lightning_decode_reference(
    proj: Float[Array, "B P"], slopes: Float[Array, "H"], state: Float[Array, "S H hd hd"], slot_ids: Int[Array, "B"],
    *, num_heads: int, head_dim: int,
) -> tuple[Float[Array, "B H hd"], Float[Array, "S H hd hd"]]:
    """One decode token per row: `S = exp(-slope) S + k^T v`, `o = q S` with q, k, v the SiLU of the packed
    projection's parts. Returns (o in proj's dtype, the state with the rows' slots advanced; slot 0 rows start from
    zeros and keep nothing)."""
    return lightning_decode_in_parts(proj, slopes, state, slot_ids, num_heads=num_heads, head_dim=head_dim,
                                     recurrence=functools.partial(fused_recurrent_simple_gla_reference, scale=1.0))


def _kernel(slot_ids_ref, proj_ref, slopes_ref, state_in_ref, o_ref, state_ref, *, head_dim: int, block_v: int):
    row, head, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[row]
    base = head * 3 * head_dim
    at = lambda start, size: pl.ds(pl.multiple_of(start, 16), size)  # noqa: E731  (16-aligned: vector loads)
    dtype = proj_ref.dtype
    q = _silu(proj_ref[row, at(base, head_dim)], dtype)
    k = _silu(proj_ref[row, at(base + head_dim, head_dim)], dtype)
    v = _silu(proj_ref[row, at(base + 2 * head_dim + i * block_v, block_v)], dtype)
    v_slice = pl.ds(pl.multiple_of(i * block_v, block_v), block_v)
    h = load_state(state_in_ref.at[slot, head, :, v_slice], slot)
    o, h = recurrent_step(h, q, k, v, -slopes_ref[head], 1.0)
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(slot != 0)  # padding rows (the null slot) keep no state
    def _():
        state_ref[slot, head, :, v_slice] = h.astype(state_ref.dtype)


def pallas_supported(head_dim: int) -> bool:
    """A power-of-two head dim from 16 (every offset 16-aligned)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@functools.partial(jax.jit, static_argnames=("num_heads", "head_dim", "block_v", "num_warps", "interpret"))
def lightning_decode_pallas(
    proj: Float[Array, "B P"], slopes: Float[Array, "H"], state: Float[Array, "S H hd hd"], slot_ids: Int[Array, "B"],
    *, num_heads: int, head_dim: int, block_v: int = 32, num_warps: int = 4, interpret: bool = False,
) -> tuple[Float[Array, "B H hd"], Float[Array, "S H hd hd"]]:
    """`lightning_decode_reference` as one Pallas kernel; grid `(B, H, hd / block_v)`. The state is aliased in
    place (donate it under jit)."""
    if not pallas_supported(head_dim):
        raise ValueError(f"the lightning decode kernel needs a power-of-two head dim from 16, got {head_dim}")
    if proj.shape[1] < 3 * num_heads * head_dim or state.shape[1:] != (num_heads, head_dim, head_dim):
        raise ValueError(f"packed shape {proj.shape}, state {state.shape} do not hold {num_heads} heads of {head_dim}")
    block_v = min(block_v, head_dim)
    batch = proj.shape[0]
    kernel = functools.partial(_kernel, head_dim=head_dim, block_v=block_v)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_heads, head_dim // block_v),
        in_specs=[_WHOLE] * 4,
        out_specs=[pl.BlockSpec((None, None, block_v), lambda r, j, i: (r, j, i)), _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((batch, num_heads, head_dim), proj.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={3: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"lightning_decode_bv{block_v}_w{num_warps}",
    )(slot_ids.astype(jnp.int32), proj, slopes.astype(jnp.float32), state)
