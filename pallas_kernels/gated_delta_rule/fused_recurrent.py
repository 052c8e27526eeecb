"""Pallas (Triton lowering) kernel for one decode step of the gated delta rule over state slots.

Grid `(V // BV, HV, B)`: program (i, j, b) owns the `[K, BV]` tile of value head j of row b's state slot. The
value tile is the grid's first axis, the one CUDA launches fastest, so programs that run side by side read
neighbouring columns of the same rows of one head's state (as fla's kernel orders them); with b first, they read
one narrow column strip from a different slot each.
It reads the tile from `state[slot_ids[b]]` (zeros when the slot is 0, the null slot), applies the decay
and the delta-rule update for the row's single token, writes `o[b, j, i*BV:(i+1)*BV]` and stores the tile
back into the same slot. The state is aliased input -> output, so under `jit` with a donated state it is
updated in place: only the rows' slots are touched. Padded rows share slot 0, which always reads as zeros
(pallas_kernels/README.md): they compute an output but store no state.
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


def _fused_recurrent_kernel(
    slot_ids_ref,  # [B] (whole array)
    q_ref,  # [K]
    k_ref,  # [K]
    v_ref,  # [BV]
    g_ref,  # [B, HV] (whole array)
    beta_ref,  # [B, HV] (whole array)
    state_in_ref,  # [S, HV, K, V] (whole array, aliased with state_ref)
    o_ref,  # [BV]
    state_ref,  # [S, HV, K, V] (whole array)
    *,
    scale: float,
    block_v: int,
):
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[b]
    v_slice = pl.ds(i * block_v, block_v)
    h = load_state(state_in_ref.at[slot, j, :, v_slice], slot)
    o, h = recurrent_step(h, q_ref[...], k_ref[...], v_ref[...], g_ref[b, j], beta_ref[b, j], scale)
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(slot != 0)  # padding rows (the null slot) keep no state: no racing writes to slot 0
    def _():
        state_ref[slot, j, :, v_slice] = h.astype(state_ref.dtype)


def _persistent_kernel(slot_ids_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, o_ref, state_ref, *,
                       scale: float, block_v: int, programs: int, group: int):
    """`_fused_recurrent_kernel` with a fixed number of programs: program p takes tiles p, p + programs, ... (in the
    one-program-a-tile grid's order: value tile fastest) and loads the next one's state before computing the current
    one (a register double buffer), so that an SM keeps a tile's loads in flight while it computes and stores."""
    batch, num_value_heads, value_dim = o_ref.shape
    nv = value_dim // block_v
    tiles = batch * nv * num_value_heads
    pid = pl.program_id(0)

    def place(t):  # tile t: (its value columns, value head, row, the row's slot)
        i, j, b = t % nv, (t // nv) % num_value_heads, t // (nv * num_value_heads)
        return pl.ds(pl.multiple_of(i * block_v, block_v), block_v), j, b, slot_ids_ref[b]

    def tile(t):  # (t clamped into range: a program's last prefetch goes unused)
        cols, j, _, slot = place(jnp.minimum(t, tiles - 1))
        return load_state(state_in_ref.at[slot, j, :, cols], slot)

    def body(n, h):
        t = pid + n * programs
        h_next = tile(t + programs)  # tiles of distinct slots (or the null slot, never stored): no hazard
        cols, j, b, slot = place(t)
        o, h = recurrent_step(h, q_ref[b, j // group, :], k_ref[b, j // group, :], v_ref[b, j, cols],
                              g_ref[b, j], beta_ref[b, j], scale)
        o_ref[b, j, cols] = o.astype(o_ref.dtype)

        @pl.when(slot != 0)
        def _():
            state_ref[slot, j, :, cols] = h.astype(state_ref.dtype)

        return h_next

    jax.lax.fori_loop(0, (tiles - pid + programs - 1) // programs, body, tile(pid))


def recurrent_step(h, q, k, v, g, beta, scale: float):
    """One token's gated delta rule on a `[K, BV]` state tile `h` (as `null_slot.load_state` reads it: zeros on the
    null slot): (o [BV], new tile), in fp32. q, k: [K]; v: [BV]; g, beta: scalars."""
    h = h.astype(jnp.float32) * jnp.exp(g.astype(jnp.float32))
    k = k.astype(jnp.float32)
    v_err = v.astype(jnp.float32) - jnp.sum(h * k[:, None], axis=0)  # [BV]
    h = h + k[:, None] * (beta.astype(jnp.float32) * v_err)[None, :]
    return jnp.sum(h * (q.astype(jnp.float32) * scale)[:, None], axis=0), h


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "num_warps", "num_stages", "programs", "interpret"))
def fused_recurrent_gated_delta_rule_pallas(
    q: Float[Array, "B H K"],
    k: Float[Array, "B H K"],
    v: Float[Array, "B HV V"],
    g: Float[Array, "B HV"],
    beta: Float[Array, "B HV"],
    state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"],
    *,
    scale: float | None = None,
    block_v: int = 128,
    num_warps: int = 4,
    num_stages: int = 1,
    programs: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """Same arguments and results as `fused_recurrent_gated_delta_rule_reference`.

    K and V must be powers of two (Triton tiles); `block_v` is clipped to V. `programs`: that many programs (at most
    one a tile) walk the tiles with the next state tile loaded ahead (`_persistent_kernel`); None: one a tile.
    """
    batch, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1:]
    group = num_value_heads // num_heads
    block_v = min(block_v, value_dim)
    if value_dim % block_v:
        raise ValueError(f"{value_dim=} must be a multiple of {block_v=}")
    scale = key_dim**-0.5 if scale is None else scale
    if programs is not None:
        programs = max(1, min(programs, batch * num_value_heads * (value_dim // block_v)))
        return pl.pallas_call(
            functools.partial(_persistent_kernel, scale=scale, block_v=block_v, programs=programs, group=group),
            grid=(programs,),
            in_specs=[_WHOLE] * 7,
            out_specs=[_WHOLE, _WHOLE],
            out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
            input_output_aliases={6: 1},
            interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name=f"gdn_fused_recurrent_p{programs}_bv{block_v}_w{num_warps}",
        )(slot_ids.astype(jnp.int32), q, k, v, g, beta, state)
    kernel = functools.partial(_fused_recurrent_kernel, scale=scale, block_v=block_v)
    o, new_state = pl.pallas_call(
        kernel,
        grid=(value_dim // block_v, num_value_heads, batch),
        in_specs=[
            _WHOLE,  # slot_ids
            pl.BlockSpec((None, None, key_dim), lambda i, j, b: (b, j // group, 0)),  # q
            pl.BlockSpec((None, None, key_dim), lambda i, j, b: (b, j // group, 0)),  # k
            pl.BlockSpec((None, None, block_v), lambda i, j, b: (b, j, i)),  # v
            _WHOLE,  # g
            _WHOLE,  # beta
            _WHOLE,  # state (read by slot inside the kernel)
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_v), lambda i, j, b: (b, j, i)),  # o
            _WHOLE,  # state (written by slot inside the kernel)
        ],
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={6: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_fused_recurrent_bv{block_v}_w{num_warps}",
    )(slot_ids.astype(jnp.int32), q, k, v, g, beta, state)
    return o, new_state
