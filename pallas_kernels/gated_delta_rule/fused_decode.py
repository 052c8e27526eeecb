"""One decode step of a Gated DeltaNet mixer from its convolved inputs to its normed output, in one kernel.

The unfused decode runs, per layer, an L2 norm of q and of k, the gates (`beta = sigmoid(b)`, `g = -exp(A_log) *
softplus(a + dt_bias)`), the recurrence (`fused_recurrent.py`) and the gated RMS norm of its output (`w *
rmsnorm(o) * silu(z)`) as separate kernels, each a launch of its own at a few microseconds of work at batch 1.
Here one program per (row, value head) does all of it: grid `(B, HV)`, each program the whole `[K, V]` state tile
of its head (V up to 256: the norm needs the head's whole output), read from and written back to the row's slot
(the null slot 0 reads zeros and keeps nothing, as in `fused_recurrent.py`). The rounding follows the unfused
path's: q and k normalised in fp32 and cast to the input dtype, the recurrence in fp32, its output cast to the
input dtype before the norm, the normed output cast before the weight and again after the gate.

`gated_delta_decode_reference` is the same computation in jnp (with the recurrence's reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.gated_delta_rule.fused_recurrent import recurrent_step
from pallas_kernels.gated_delta_rule.reference import fused_recurrent_gated_delta_rule_reference

L2_EPS = 1e-6  # the L2 norm's epsilon of q and k (fla's and HF's)
_WHOLE = pl.no_block_spec


def _l2_normalize(x, dtype):
    """`x / sqrt(sum(x^2) + eps)` over the last axis in fp32, cast to `dtype` (the unfused path's rounding)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)).astype(dtype)


def _gates(a, b, a_log, dt_bias):
    """(decay g, beta) in fp32 from the raw projections."""
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, beta


def _gated_norm(o, z, w, eps: float):
    """`w * rmsnorm(o) * silu(z)` over the last axis, `o` in the output dtype (the unfused path's)."""
    of = o.astype(jnp.float32)
    of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    out = (w * of.astype(o.dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    return out.astype(o.dtype)


def gated_delta_decode_reference(
    q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B HV V"], a: Float[Array, "B HV"],
    b: Float[Array, "B HV"], z: Float[Array, "B HV V"], a_log: Float[Array, "HV"], dt_bias: Float[Array, "HV"],
    norm_w: Float[Array, "V"], state: Float[Array, "S HV K V"], slot_ids: Int[Array, "B"], *, eps: float,
    scale: float | None = None,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """One decode token per row: q and k (convolved, not yet normalised), v, the gate projections a and b, the
    output gate z, the layer's A_log, dt_bias and output-norm weight. Returns (the normed, gated output in v's
    dtype, the state with the rows' slots updated)."""
    return decode_in_parts(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slot_ids, eps=eps,
                           recurrence=functools.partial(fused_recurrent_gated_delta_rule_reference, scale=scale))


def decode_in_parts(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slot_ids, *, eps: float, recurrence):
    """`gated_delta_decode_reference`'s parts one by one, the recurrence by `recurrence(q, k, v, g, beta, state,
    slot_ids)`: the reference's, or the dispatched kernel (`gated_delta_decode` unfused)."""
    g, beta = _gates(a, b, a_log, dt_bias)
    o, state = recurrence(_l2_normalize(q, q.dtype), _l2_normalize(k, k.dtype), v, g, beta, state, slot_ids)
    return _gated_norm(o.astype(v.dtype), z, norm_w, eps), state


def _kernel(slot_ids_ref, q_ref, k_ref, v_ref, a_ref, b_ref, z_ref, a_log_ref, dt_bias_ref, w_ref, state_in_ref,
            o_ref, state_ref, *, scale: float, eps: float):
    row, head = pl.program_id(0), pl.program_id(1)
    slot = slot_ids_ref[row]
    q = _l2_normalize(q_ref[...], q_ref.dtype)
    k = _l2_normalize(k_ref[...], k_ref.dtype)
    g, beta = _gates(a_ref[row, head], b_ref[row, head], a_log_ref[head], dt_bias_ref[head])
    o, h = recurrent_step(state_in_ref[slot, head], slot, q, k, v_ref[...], g, beta, scale)
    o_ref[...] = _gated_norm(o.astype(o_ref.dtype)[None, :], z_ref[...][None, :], w_ref[...][None, :], eps)[0]

    @pl.when(slot != 0)  # padding rows (the null slot) keep no state
    def _():
        state_ref[slot, head] = h.astype(state_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "scale", "num_warps", "num_stages", "interpret"))
def gated_delta_decode_pallas(
    q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B HV V"], a: Float[Array, "B HV"],
    b: Float[Array, "B HV"], z: Float[Array, "B HV V"], a_log: Float[Array, "HV"], dt_bias: Float[Array, "HV"],
    norm_w: Float[Array, "V"], state: Float[Array, "S HV K V"], slot_ids: Int[Array, "B"], *, eps: float,
    scale: float | None = None, num_warps: int = 4, num_stages: int = 1, interpret: bool = False,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """`gated_delta_decode_reference` as one Pallas kernel (K and V powers of two from 16, V at most 256). The
    state is aliased in place (donate it under jit)."""
    batch, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1:]
    group = num_value_heads // num_heads
    scale = key_dim**-0.5 if scale is None else scale
    kernel = functools.partial(_kernel, scale=scale, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_value_heads),
        in_specs=[
            _WHOLE,  # slot_ids
            pl.BlockSpec((None, None, key_dim), lambda r, j: (r, j // group, 0)),  # q
            pl.BlockSpec((None, None, key_dim), lambda r, j: (r, j // group, 0)),  # k
            pl.BlockSpec((None, None, value_dim), lambda r, j: (r, j, 0)),  # v
            _WHOLE,  # a
            _WHOLE,  # b
            pl.BlockSpec((None, None, value_dim), lambda r, j: (r, j, 0)),  # z
            _WHOLE,  # A_log
            _WHOLE,  # dt_bias
            pl.BlockSpec((value_dim,), lambda r, j: (0,)),  # the norm's weight
            _WHOLE,  # state (read by slot inside the kernel)
        ],
        out_specs=[pl.BlockSpec((None, None, value_dim), lambda r, j: (r, j, 0)), _WHOLE],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={10: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_fused_decode_w{num_warps}",
    )(slot_ids.astype(jnp.int32), q, k, v, a, b, z, a_log, dt_bias, norm_w, state)
