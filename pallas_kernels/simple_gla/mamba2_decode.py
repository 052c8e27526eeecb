"""One decode step of a Mamba2 (SSD) mixer from its convolved inputs to its output before the gated norm, in one
kernel.

The model's decode runs, per layer, the step size `dt = clip(softplus(dt_raw + dt_bias), dt_min, dt_max)`, the
decay `dt * -exp(A_log)`, the input `x * dt`, the scalar-decay recurrence (`fused_recurrent.py`) and the skip `y +
D x` as kernels of their own, with slices of the packed arrays written out to feed the recurrence. Here one
program per (row, head, block of the head's P channels) does all of it, reading its parts of the packed arrays in
place: x, B and C from the conv's (activated, fp32) output `xbc = [x (H*P) | B (G*N) | C (G*N)]`, and the raw dt
from the in_proj output `proj = [z (H*P) | xBC | dt (H)]` at column `dt_offset`. Head h reads B/C group
`h // (H / G)`. The rounding follows the model's path: all in fp32, the output cast to `out_dtype` once. With
`gated`, the output is the gated norm's input `y * silu(z)` (fp32; z from proj's first H*P columns): the grouped
norm after it is then one kernel (XLA leaves the gate's product and the norm's reduction apart).

`mamba2_decode_reference` is the same computation in jnp (the recurrence's reference).
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


def split_packed_decode(xbc: Float[Array, "B X"], proj: Float[Array, "B P"], dims: tuple[int, int, int, int],
                        dt_offset: int):
    """(x [B, H, P], B [B, G, N], C [B, G, N], raw dt [B, H]) from the packed arrays (`dims = (H, P, G, N)`)."""
    h, p, g, n = dims
    batch, inner = xbc.shape[0], h * p
    xs = xbc[:, :inner].reshape(batch, h, p)
    b = xbc[:, inner : inner + g * n].reshape(batch, g, n)
    c = xbc[:, inner + g * n : inner + 2 * g * n].reshape(batch, g, n)
    return xs, b, c, proj[:, dt_offset : dt_offset + h]


def _step_size(dt_raw, dt_bias, a_log, dt_range: tuple[float, float]):
    """(dt, log-space decay) in fp32."""
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    dt = jnp.clip(dt, *dt_range)
    return dt, dt * -jnp.exp(a_log.astype(jnp.float32))


def mamba2_decode_reference(
    xbc: Float[Array, "B X"], proj: Float[Array, "B P"], dt_bias: Float[Array, "H"], a_log: Float[Array, "H"],
    d_skip: Float[Array, "H"], state: Float[Array, "S H N P"], slot_ids: Int[Array, "B"], *,
    dims: tuple[int, int, int, int], dt_offset: int, dt_range: tuple[float, float], out_dtype,
    gated: bool = False,
) -> tuple[Float[Array, "B H P"], Float[Array, "S H N P"]]:
    """One decode token per row: `y = C S + D x` after `S = exp(dt A) S + B^T (dt x)`, from the packed arrays.
    Returns (y in `out_dtype`, the state with the rows' slots advanced; slot 0 rows start from zeros, keep
    nothing). `gated`: instead of y, the gated norm's input `y * silu(z)` in fp32 (y rounded to `out_dtype` first;
    z is proj's first H*P columns), so that the norm after it is one kernel."""
    return mamba2_decode_in_parts(xbc, proj, dt_bias, a_log, d_skip, state, slot_ids, dims=dims, dt_offset=dt_offset,
                                  dt_range=dt_range, out_dtype=out_dtype, gated=gated,
                                  recurrence=functools.partial(fused_recurrent_simple_gla_reference, scale=1.0))


def _gate(y, z):
    """The gated norm's input: `y` (as rounded) times `silu(z)`, in fp32."""
    return y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))


def mamba2_decode_in_parts(xbc, proj, dt_bias, a_log, d_skip, state, slot_ids, *, dims, dt_offset, dt_range, out_dtype,
                           recurrence, gated: bool = False):
    """`mamba2_decode_reference`'s parts one by one, the recurrence by `recurrence(q, k, v, g, state, slot_ids)`:
    the reference's, or the dispatched kernel (`simple_gla.mamba2_decode` unfused)."""
    xs, b, c, dt_raw = split_packed_decode(xbc, proj, dims, dt_offset)
    xs = xs.astype(jnp.float32)
    dt, decay = _step_size(dt_raw, dt_bias, a_log, dt_range)
    y, state = recurrence(c.astype(jnp.float32), b.astype(jnp.float32), xs * dt[..., None], decay, state, slot_ids)
    y = (y + xs * d_skip.astype(jnp.float32)[:, None]).astype(out_dtype)
    if gated:
        h, p = dims[:2]
        y = _gate(y, proj[:, : h * p].reshape(y.shape))
    return y, state


def _kernel(slot_ids_ref, xbc_ref, proj_ref, dt_bias_ref, a_log_ref, d_ref, state_in_ref, o_ref, state_ref, *,
            dims: tuple[int, int, int, int], dt_offset: int, dt_range: tuple[float, float], block_p: int,
            out_dtype, gated: bool):
    h, p, g, n = dims
    row, head, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[row]
    group = head // (h // g)
    at = lambda start, size: pl.ds(pl.multiple_of(start, 16), size)  # noqa: E731  (16-aligned: vector loads)
    cols = at(head * p + i * block_p, block_p)
    xs = xbc_ref[row, cols].astype(jnp.float32)  # [BP]
    b = xbc_ref[row, at(h * p + group * n, n)]  # [N]
    c = xbc_ref[row, at(h * p + g * n + group * n, n)]  # [N]
    dt, decay = _step_size(proj_ref[row, dt_offset + head], dt_bias_ref[head], a_log_ref[head], dt_range)
    p_slice = pl.ds(pl.multiple_of(i * block_p, block_p), block_p)
    y, s = recurrent_step(load_state(state_in_ref.at[slot, head, :, p_slice], slot), c, b, xs * dt, decay, 1.0)
    y = (y + xs * d_ref[head].astype(jnp.float32)).astype(out_dtype)
    o_ref[...] = (_gate(y, proj_ref[row, cols]) if gated else y).astype(o_ref.dtype)

    @pl.when(slot != 0)  # padding rows (the null slot) keep no state
    def _():
        state_ref[slot, head, :, p_slice] = s.astype(state_ref.dtype)


def pallas_supported(dims: tuple[int, int, int, int]) -> bool:
    """P and N powers of two from 16 (every offset 16-aligned)."""
    _, p, _, n = dims
    return all(d >= 16 and d & (d - 1) == 0 for d in (p, n))


@functools.partial(jax.jit, static_argnames=("dims", "dt_offset", "dt_range", "out_dtype", "gated", "block_p",
                                             "num_warps", "interpret"))
def mamba2_decode_pallas(
    xbc: Float[Array, "B X"], proj: Float[Array, "B P"], dt_bias: Float[Array, "H"], a_log: Float[Array, "H"],
    d_skip: Float[Array, "H"], state: Float[Array, "S H N P"], slot_ids: Int[Array, "B"], *,
    dims: tuple[int, int, int, int], dt_offset: int, dt_range: tuple[float, float], out_dtype, gated: bool = False,
    block_p: int = 32, num_warps: int = 4, interpret: bool = False,
) -> tuple[Float[Array, "B H P"], Float[Array, "S H N P"]]:
    """`mamba2_decode_reference` as one Pallas kernel; grid `(B, H, P / block_p)`. The state is aliased in place
    (donate it under jit)."""
    h, p, g, n = dims
    if not pallas_supported(dims) or h % g:
        raise ValueError(f"the Mamba2 decode kernel needs P and N powers of two from 16 and G dividing H, got {dims=}")
    if xbc.shape[1] < h * p + 2 * g * n or proj.shape[1] < dt_offset + h or state.shape[1:] != (h, n, p):
        raise ValueError(f"packed shapes {xbc.shape}, {proj.shape}, state {state.shape} do not hold {dims=}")
    block_p = min(block_p, p)
    batch = xbc.shape[0]
    kernel = functools.partial(_kernel, dims=dims, dt_offset=dt_offset, dt_range=dt_range, block_p=block_p,
                               out_dtype=out_dtype, gated=gated)
    return pl.pallas_call(
        kernel,
        grid=(batch, h, p // block_p),
        in_specs=[_WHOLE] * 7,
        out_specs=[pl.BlockSpec((None, None, block_p), lambda r, j, i: (r, j, i)), _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((batch, h, p), jnp.float32 if gated else out_dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={6: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"mamba2_decode_bp{block_p}_w{num_warps}{'_gated' if gated else ''}",
    )(slot_ids.astype(jnp.int32), xbc, proj, dt_bias, a_log, d_skip, state)
