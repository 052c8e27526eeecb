"""Pallas (Triton lowering) kernel for the decode step of a depthwise causal convolution over state slots.

Grid `(B, C // BC)`: program (b, c) owns channels `[c * BC, (c + 1) * BC)` of row b. The input may be wider than
C (a packed projection whose columns `[offset, offset + C)` the conv takes: read in place, no slice of it written
first); an optional bias and activation (SiLU) are applied to the output in registers. It reads the row's `W - 1`
inputs of those channels from `state[slot_ids[b]]` (one strided load per tap; zeros on the null slot 0), adds the
row's new input, writes the output and stores the last `W - 1` inputs back into the slot (aliased in place; the
null slot is never written, so padding rows race on nothing). One kernel where XLA runs the gather of the slots'
windows, the sum and the scatter of the new windows as kernels of their own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.conv_update.reference import finish
from pallas_kernels.null_slot import load_state

_WHOLE = pl.no_block_spec


def _kernel(slot_ids_ref, x_ref, w_ref, *refs, hist: int, block_c: int, offset: int, has_bias: bool,
            activation: str | None, window: bool):
    bias_ref = refs[0] if has_bias else None
    state_in_ref, o_ref, state_ref = refs[int(has_bias):]
    row, c = pl.program_id(0), pl.program_id(1)
    slot = slot_ids_ref[row]
    start = pl.multiple_of(c * block_c, block_c)
    channels = pl.ds(start, block_c)
    x = x_ref[row, pl.ds(pl.multiple_of(offset + start, 16), block_c)].astype(jnp.float32)
    if window:
        _window_step(slot, x, w_ref, bias_ref, state_in_ref, o_ref, state_ref, channels, hist, activation, x_ref.dtype)
        return
    taps = [load_state(state_in_ref.at[slot, channels, jnp.int32(i)], slot) for i in range(hist)]  # null slot: zeros
    taps.append(x)
    out = jnp.zeros((block_c,), jnp.float32)
    for i, tap in enumerate(taps):  # (each weight column a strided load: Triton slices no loaded value)
        out = out + tap * w_ref[:, i].astype(jnp.float32)
    o_ref[...] = finish(out.astype(x_ref.dtype), bias_ref[...] if has_bias else None, activation, o_ref.dtype)

    @pl.when(slot != 0)
    def _():
        for i in range(hist):
            state_ref[slot, channels, i] = taps[i + 1].astype(state_ref.dtype)


def _window_step(slot, x, w_ref, bias_ref, state_in_ref, o_ref, state_ref, channels, hist: int, activation, dtype):
    """`_kernel`'s step with the slot's `W - 1` inputs of the block read as one contiguous `[BC, W]` tile (a channel's
    inputs are consecutive in the state; the tile's last column, the next channel's first input, is masked off) and
    the new window stored the same way, where the plain step reads and writes them one strided tap at a time."""
    block_c = x.shape[0]
    col = jnp.arange(hist + 1)[None, :]
    cols = pl.ds(0, hist + 1)
    past = col < hist
    tile = load_state(state_in_ref.at[slot, channels, cols], slot, mask=past)  # [BC, W]
    full = jnp.where(col == hist, x[:, None], tile)  # the window with the row's new input last
    out = jnp.sum(full * w_ref[...].astype(jnp.float32), axis=1)
    o_ref[...] = finish(out.astype(dtype), bias_ref[...] if bias_ref is not None else None, activation, o_ref.dtype)
    new = jnp.zeros_like(full)
    for j in range(hist):  # the window shifted by one (Triton slices no loaded value: a masked sum a column)
        new = jnp.where(col == j, jnp.sum(jnp.where(col == j + 1, full, 0.0), axis=1)[:, None], new)

    @pl.when(slot != 0)
    def _():
        plt.store(state_ref.at[slot, channels, cols], new.astype(state_ref.dtype),
                  mask=jnp.broadcast_to(past, (block_c, hist + 1)))


def block_channels(num_channels: int, most: int = 1024) -> int:
    """The largest power of two up to `most` that divides `num_channels` (0: none from 16 up)."""
    block = most
    while block >= 16 and num_channels % block:
        block //= 2
    return block if block >= 16 else 0


@functools.partial(jax.jit, static_argnames=("offset", "activation", "out_dtype", "block_c", "num_warps", "window",
                                             "interpret"))
def conv_update_pallas(x: Float[Array, "B X"], conv_state: Float[Array, "S C W1"], weight: Float[Array, "C W"],
                       slot_ids: Int[Array, "B"], *, offset: int = 0, bias: Array | None = None,
                       activation: str | None = None, out_dtype=None, block_c: int | None = None,
                       num_warps: int = 4, window: bool = False,
                       interpret: bool = False) -> tuple[Float[Array, "B C"], Float[Array, "S C W1"]]:
    """Same arguments and results as `conv_update_reference`. W must be a power of two (the weight's tile);
    `block_c` (default `block_channels(C)`) a power of two dividing C; `offset` a multiple of 16. `window`: the
    state's inputs read and written as one contiguous tile (`_window_step`; faster from 32 rows: `WINDOW_FROM_ROWS`)."""
    batch = x.shape[0]
    num_channels, width = weight.shape
    if x.shape[1] < offset + num_channels or offset % 16:
        raise ValueError(f"the conv's channels [{offset}, {offset + num_channels}) are not a 16-aligned part of its "
                         f"input's {x.shape[1]} columns")
    block_c = block_c or block_channels(num_channels)
    if not block_c or num_channels % block_c:
        raise ValueError(f"no power-of-two channel block >= 16 divides C={num_channels}")
    kernel = functools.partial(_kernel, hist=width - 1, block_c=block_c, offset=offset, has_bias=bias is not None,
                               activation=activation, window=window)
    out_dtype = jax.eval_shape(lambda: finish(jnp.zeros((1,), x.dtype), None if bias is None else jnp.zeros(
        (1,), bias.dtype), activation, out_dtype)).dtype
    return pl.pallas_call(
        kernel,
        grid=(batch, num_channels // block_c),
        in_specs=[
            _WHOLE,  # slot_ids
            _WHOLE,  # x (the row's channels read inside the kernel)
            pl.BlockSpec((block_c, width), lambda b, c: (c, 0)),  # weight
            *([pl.BlockSpec((block_c,), lambda b, c: (c,))] if bias is not None else []),  # bias
            _WHOLE,  # state (read by slot inside the kernel)
        ],
        out_specs=[pl.BlockSpec((None, block_c), lambda b, c: (b, c)), _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((batch, num_channels), out_dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)],
        input_output_aliases={3 + (bias is not None): 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"conv_update_bc{block_c}_w{num_warps}{'_' + activation if activation else ''}{'_win' if window else ''}",
    )(slot_ids.astype(jnp.int32), x, weight, *([bias] if bias is not None else []), conv_state)
