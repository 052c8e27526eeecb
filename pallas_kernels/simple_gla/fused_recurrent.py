"""Pallas (Triton lowering) kernel for one decode step of the scalar-decay recurrence (simple GLA) over
state slots.

Grid `(B, HV, V // BV)`: program (b, j, i) owns the `[K, BV]` tile of value head j of row b's state slot.
It reads the tile from `state[slot_ids[b]]` (zeros when the slot is 0, the null slot), decays it by
`exp(g[b, j])`, adds `k v^T` for the row's single token, writes `o[b, j, i*BV:(i+1)*BV] = scale q^T S` and
stores the tile back into the same slot. The state is aliased input -> output, so under `jit` with a donated
state it is updated in place: only the rows' slots are touched. Padded rows share slot 0, which always reads
as zeros (pallas_kernels/README.md): they compute an output but store no state.

Nothing but the state tile is big: the step moves `2 K V` fp32 words per (row, value head), so it is bound
by memory bandwidth; `block_v` and `num_warps` only trade parallelism against per-program work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.null_slot import load_state

_WHOLE = pl.no_block_spec  # the whole array, indexed inside the kernel


def recurrent_step(h, q, k, v, g, scale: float):
    """One token of the scalar-decay recurrence on a `[K, BV]` state tile `h` (as `null_slot.load_state` reads it:
    zeros on the null slot): (o [BV], new tile), in fp32. q, k: [K]; v: [BV]; g: a scalar (log-space decay)."""
    h = h.astype(jnp.float32) * jnp.exp(g.astype(jnp.float32))
    h = h + k.astype(jnp.float32)[:, None] * v.astype(jnp.float32)[None, :]
    return jnp.sum(h * (q.astype(jnp.float32) * scale)[:, None], axis=0), h


def _fused_recurrent_kernel(
    slot_ids_ref,  # [B] (whole array)
    q_ref,  # [K]
    k_ref,  # [K]
    v_ref,  # [BV]
    g_ref,  # [B, HV] (whole array)
    state_in_ref,  # [S, HV, K, V] (whole array, aliased with state_ref)
    o_ref,  # [BV]
    state_ref,  # [S, HV, K, V] (whole array)
    *,
    scale: float,
    block_v: int,
):
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[b]
    v_slice = pl.ds(i * block_v, block_v)
    h = load_state(state_in_ref.at[slot, j, :, v_slice], slot)
    o, h = recurrent_step(h, q_ref[...], k_ref[...], v_ref[...], g_ref[b, j], scale)
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(slot != 0)  # padding rows (the null slot) keep no state: no racing writes to slot 0
    def _():
        state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "num_warps", "num_stages", "interpret"))
def fused_recurrent_simple_gla_pallas(
    q: Float[Array, "B H K"],
    k: Float[Array, "B H K"],
    v: Float[Array, "B HV V"],
    g: Float[Array, "B HV"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float = 1.0,
    block_v: int = 32,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """Same arguments and results as `fused_recurrent_simple_gla_reference` (row b's slot, and only it, is
    advanced by its token; slot 0 rows start from zeros and store nothing).

    K and V must be powers of two (Triton tiles); `block_v` is clipped to V.
    """
    batch, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1:]
    group = num_value_heads // num_heads
    block_v = min(block_v, value_dim)
    if value_dim % block_v:
        raise ValueError(f"{value_dim=} must be a multiple of {block_v=}")
    kernel = functools.partial(_fused_recurrent_kernel, scale=scale, block_v=block_v)
    o, new_state = pl.pallas_call(
        kernel,
        grid=(batch, num_value_heads, value_dim // block_v),
        in_specs=[
            _WHOLE,  # slot_ids
            pl.BlockSpec((None, None, key_dim), lambda b, j, i: (b, j // group, 0)),  # q
            pl.BlockSpec((None, None, key_dim), lambda b, j, i: (b, j // group, 0)),  # k
            pl.BlockSpec((None, None, block_v), lambda b, j, i: (b, j, i)),  # v
            _WHOLE,  # g
            _WHOLE,  # state (read by slot inside the kernel)
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_v), lambda b, j, i: (b, j, i)),  # o
            _WHOLE,  # state (written by slot inside the kernel)
        ],
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={5: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"sgla_fused_recurrent_bv{block_v}_w{num_warps}",
    )(slot_ids.astype(jnp.int32), q, k, v, g, state)
    return o, new_state
