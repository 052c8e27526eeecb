"""One decode step of a Gated DeltaNet mixer from its in_proj output to its normed output, the conv included.

The packed decode (`fused_decode.gated_delta_decode_packed_pallas`) starts from the conv's output, which a kernel of
its own (`conv_update`) writes first: two launches a layer. Here one program per (row, key head) does both:

- the causal conv of the key head's q and k channels and of its G = HV / HK value heads' v channels (read in place
  from the in_proj output, the slot's `W - 1` past inputs one strided tap at a time, the new window stored back),
  with SiLU, rounded as `conv_update` rounds (fp32 sum in tap order, cast to the input dtype, SiLU in fp32, cast);
- then, for each of its G value heads in turn, the norms, gates, recurrence and gated norm of `fused_decode`.

Why a program per key head, not per value head: the G value heads of a key head share its q and k channels, whose
conv state the step also rewrites. Programs per value head would each read that state while another might already
have stored its new window (the state is updated in place); one program per key head reads and writes it alone.
Its G state tiles are independent, so their loads can be in flight together (the loop is unrolled).

The null slot 0 reads zeros and keeps nothing (`null_slot.load_state`), as in the two kernels this replaces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.conv_update.reference import conv_update_reference, finish
from pallas_kernels.gated_delta_rule.fused_decode import (
    _decode_head,
    _store_tile,
    gated_delta_decode_reference,
    packed_supported,
    split_packed_decode,
)
from pallas_kernels.null_slot import load_state

_WHOLE = pl.no_block_spec


def gated_delta_conv_decode_reference(
    proj: Float[Array, "B P"], conv_state: Float[Array, "S C W1"], conv_weight: Float[Array, "C W"],
    a_log: Float[Array, "HV"], dt_bias: Float[Array, "HV"], norm_w: Float[Array, "V"], state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"], *, dims: tuple[int, int, int, int], eps: float, scale: float | None = None,
):
    """The two steps in jnp: `conv_update_reference` (SiLU) on proj's first C columns, then
    `gated_delta_decode_reference` on `split_packed_decode`. Returns (o [B, HV, V], conv_state, state)."""
    qkv, conv_state = conv_update_reference(proj, conv_state, conv_weight, slot_ids, activation="silu")
    o, state = gated_delta_decode_reference(*split_packed_decode(qkv, proj, dims), a_log, dt_bias, norm_w, state,
                                            slot_ids, eps=eps, scale=scale)
    return o, conv_state, state


def _conv(proj_ref, w_ref, conv_in_ref, conv_ref, row, slot, start: int | jax.Array, size: int, hist: int):
    """Channels `[start, start + size)` of row's conv step: the activated output in proj's dtype; the slot's new
    window stored (not on the null slot)."""
    chans = pl.ds(pl.multiple_of(start, 16), size)
    taps = [load_state(conv_in_ref.at[slot, chans, jnp.int32(i)], slot) for i in range(hist)]
    taps.append(proj_ref[row, chans].astype(jnp.float32))
    out = jnp.zeros((size,), jnp.float32)
    for i, tap in enumerate(taps):  # conv_update's order and rounding
        out = out + tap * w_ref[chans, i].astype(jnp.float32)

    @pl.when(slot != 0)
    def _():
        for i in range(hist):
            conv_ref[slot, chans, i] = taps[i + 1].astype(conv_ref.dtype)

    return finish(out.astype(proj_ref.dtype), None, "silu", None)


def _kernel(slot_ids_ref, proj_ref, w_ref, a_log_ref, dt_bias_ref, norm_ref, conv_in_ref, state_in_ref, o_ref,
            conv_ref, state_ref, *, dims: tuple[int, int, int, int], hist: int, scale: float, eps: float):
    row, kh = pl.program_id(0), pl.program_id(1)
    hk, dk, hv, dv = dims
    group = hv // hk
    conv = 2 * hk * dk + hv * dv
    slot = slot_ids_ref[row]
    conv_step = functools.partial(_conv, proj_ref, w_ref, conv_in_ref, conv_ref, row, slot, hist=hist)
    q = conv_step(kh * dk, dk)
    k = conv_step(hk * dk + kh * dk, dk)
    for j in range(group):  # unrolled: the G state tiles' loads need nothing of each other
        head = kh * group + j
        v = conv_step(2 * hk * dk + head * dv, dv)
        z = proj_ref[row, pl.ds(pl.multiple_of(conv + head * dv, 16), dv)]
        b, a = proj_ref[row, conv + hv * dv + head], proj_ref[row, conv + hv * dv + hv + head]
        o_ref[row, head, :], h = _decode_head(head, q, k, v, a, b, z, load_state(state_in_ref.at[slot, head], slot),
                                              a_log_ref, dt_bias_ref, norm_ref, out_dtype=o_ref.dtype, scale=scale,
                                              eps=eps)
        _store_tile(state_ref, slot, head, h)


def conv_decode_supported(dims: tuple[int, int, int, int], conv_weight_shape: tuple[int, int]) -> bool:
    """Whether `gated_delta_conv_decode_pallas` runs these heads and this conv: the packed kernel's head dims
    (`packed_supported`), value heads a multiple of key heads, and the conv's C channels exactly q, k and v."""
    hk, dk, hv, dv = dims
    return packed_supported(dims) and hv % hk == 0 and conv_weight_shape[0] == 2 * hk * dk + hv * dv


@functools.partial(jax.jit, static_argnames=("dims", "eps", "scale", "num_warps", "interpret"))
def gated_delta_conv_decode_pallas(
    proj: Float[Array, "B P"], conv_state: Float[Array, "S C W1"], conv_weight: Float[Array, "C W"],
    a_log: Float[Array, "HV"], dt_bias: Float[Array, "HV"], norm_w: Float[Array, "V"], state: Float[Array, "S HV K V"],
    slot_ids: Int[Array, "B"], *, dims: tuple[int, int, int, int], eps: float, scale: float | None = None,
    num_warps: int = 4, interpret: bool = False,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S C W1"], Float[Array, "S HV K V"]]:
    """`gated_delta_conv_decode_reference` in one kernel, grid `(B, HK)`; both states updated in place (aliased:
    donate them under jit). `proj` is the in_proj output `[C | HV*V (z) | HV (b) | HV (a)]`. `num_warps`: 4, the
    fastest of 4, 8 and 16 at the qwen3_next layer's 256 rows on the H200 (8 and 16 were 45-49% slower,
    benchmarks/RESULTS.md session 39)."""
    hk, dk, hv, dv = dims
    if not conv_decode_supported(dims, conv_weight.shape):
        raise ValueError(f"the conv decode kernel needs K and V powers of two from 16, HV a multiple of HK and "
                         f"C = 2*HK*K + HV*V conv channels, got {dims=} and a conv weight of {conv_weight.shape}")
    conv = 2 * hk * dk + hv * dv
    if proj.shape[1] < conv + hv * dv + 2 * hv or conv_state.shape[1:] != (conv, conv_weight.shape[1] - 1):
        raise ValueError(f"shapes proj {proj.shape}, conv state {conv_state.shape} do not hold {dims=} and a conv "
                         f"weight of {conv_weight.shape}")
    batch = proj.shape[0]
    kernel = functools.partial(_kernel, dims=dims, hist=conv_weight.shape[1] - 1,
                               scale=dk**-0.5 if scale is None else scale, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(batch, hk),
        in_specs=[_WHOLE] * 5 + [pl.BlockSpec((dv,), lambda *_: (0,)), _WHOLE, _WHOLE],
        out_specs=[_WHOLE, _WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((batch, hv, dv), proj.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={6: 1, 7: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"gdn_conv_decode_w{num_warps}",
    )(slot_ids.astype(jnp.int32), proj, conv_weight, a_log, dt_bias, norm_w, conv_state, state)
