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
from pallas_kernels.null_slot import load_state

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


def _decode_head(head, q, k, v, a, b, z, h, a_log_ref, dt_bias_ref, w_ref, *, out_dtype, scale: float, eps: float):
    """One (row, value head)'s decode step from its loaded inputs (q, k: the head's key head; a, b: scalars; h: the
    row's `[K, V]` state tile, `load_state`'s): (the normed, gated output [V] in `out_dtype`, the new tile in fp32)."""
    q = _l2_normalize(q, q.dtype)
    k = _l2_normalize(k, k.dtype)
    g, beta = _gates(a, b, a_log_ref[head], dt_bias_ref[head])
    o, h = recurrent_step(h, q, k, v, g, beta, scale)
    return _gated_norm(o.astype(out_dtype)[None, :], z[None, :], w_ref[...][None, :], eps)[0], h


def _store_tile(state_ref, slot, head, h):
    @pl.when(slot != 0)  # padding rows (the null slot) keep no state
    def _():
        state_ref[slot, head] = h.astype(state_ref.dtype)


def _kernel(slot_ids_ref, q_ref, k_ref, v_ref, a_ref, b_ref, z_ref, a_log_ref, dt_bias_ref, w_ref, state_in_ref,
            o_ref, state_ref, *, scale: float, eps: float):
    row, head = pl.program_id(0), pl.program_id(1)
    slot = slot_ids_ref[row]
    o_ref[...], h = _decode_head(head, q_ref[...], k_ref[...], v_ref[...], a_ref[row, head], b_ref[row, head],
                                 z_ref[...], load_state(state_in_ref.at[slot, head], slot), a_log_ref, dt_bias_ref,
                                 w_ref, out_dtype=o_ref.dtype, scale=scale, eps=eps)
    _store_tile(state_ref, slot, head, h)


def _packed_inputs(qkv_ref, proj_ref, row, head, dims: tuple[int, int, int, int]):
    """(q, k, v, a, b, z) of (row, value head) read in place from the packed arrays (`split_packed_decode`'s
    layout)."""
    hk, dk, hv, dv = dims
    kh = head // (hv // hk)
    conv = 2 * hk * dk + hv * dv  # the conv's channels: q, k, v
    at = lambda start, size: pl.ds(pl.multiple_of(start, 16), size)  # noqa: E731  (16-aligned: vector loads)
    return (qkv_ref[row, at(kh * dk, dk)], qkv_ref[row, at(hk * dk + kh * dk, dk)],
            qkv_ref[row, at(2 * hk * dk + head * dv, dv)], proj_ref[row, conv + hv * dv + hv + head],
            proj_ref[row, conv + hv * dv + head], proj_ref[row, at(conv + head * dv, dv)])


def _packed_kernel(slot_ids_ref, qkv_ref, proj_ref, a_log_ref, dt_bias_ref, w_ref, state_in_ref, o_ref, state_ref, *,
                   dims: tuple[int, int, int, int], scale: float, eps: float):
    """`_kernel` reading its inputs in place from the packed arrays."""
    row, head = pl.program_id(0), pl.program_id(1)
    slot = slot_ids_ref[row]
    o_ref[...], h = _decode_head(head, *_packed_inputs(qkv_ref, proj_ref, row, head, dims),
                                 load_state(state_in_ref.at[slot, head], slot), a_log_ref, dt_bias_ref, w_ref,
                                 out_dtype=o_ref.dtype, scale=scale, eps=eps)
    _store_tile(state_ref, slot, head, h)


def _packed_split_kernel(slot_ids_ref, qkv_ref, proj_ref, a_log_ref, dt_bias_ref, state_in_ref, o_ref, state_ref, *,
                         dims: tuple[int, int, int, int], block_v: int, scale: float):
    """`_packed_kernel` on a `[K, block_v]` column block of the head's state tile, grid `(V / block_v, HV, B)` (the
    value block fastest, as `fused_recurrent`'s): the norms of q and k, the gates and the recurrence, the output
    unnormed (the gated norm needs the head's whole output; the caller applies it)."""
    col, head, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ids_ref[row]
    cols = pl.ds(pl.multiple_of(col * block_v, 16), block_v)
    q, k, _, a, b, _ = _packed_inputs(qkv_ref, proj_ref, row, head, dims)  # (the unused loads are dropped)
    v = qkv_ref[row, pl.ds(pl.multiple_of(2 * dims[0] * dims[1] + head * dims[3] + col * block_v, 16), block_v)]
    g, beta = _gates(a, b, a_log_ref[head], dt_bias_ref[head])
    o, h = recurrent_step(load_state(state_in_ref.at[slot, head, :, cols], slot), _l2_normalize(q, q.dtype),
                          _l2_normalize(k, k.dtype), v, g, beta, scale)
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(slot != 0)
    def _():
        state_ref[slot, head, :, cols] = h.astype(state_ref.dtype)


def _persistent_packed_kernel(slot_ids_ref, qkv_ref, proj_ref, a_log_ref, dt_bias_ref, w_ref, state_in_ref, o_ref,
                              state_ref, *, dims: tuple[int, int, int, int], programs: int, scale: float, eps: float):
    """`_packed_kernel` with a fixed number of programs: program p takes the (row, head) pairs p, p + programs, ...
    in turn, and loads the next pair's state tile before it computes the current one, so that each program keeps a
    tile's loads in flight while it computes and stores (a register double buffer)."""
    hv = dims[2]
    total = o_ref.shape[0] * hv
    pid = pl.program_id(0)

    def tile(t):  # pair t's state tile (t clamped into range: the last prefetch of a program goes unused)
        t = jnp.minimum(t, total - 1)
        slot = slot_ids_ref[t // hv]
        return load_state(state_in_ref.at[slot, t % hv], slot)

    def body(n, h):
        t = pid + n * programs
        h_next = tile(t + programs)  # pairs are distinct slots (or the null slot, never stored): no hazard
        row, head = t // hv, t % hv
        slot = slot_ids_ref[row]
        o_ref[row, head, :], h = _decode_head(head, *_packed_inputs(qkv_ref, proj_ref, row, head, dims), h,
                                              a_log_ref, dt_bias_ref, w_ref, out_dtype=o_ref.dtype, scale=scale,
                                              eps=eps)
        _store_tile(state_ref, slot, head, h)
        return h_next

    jax.lax.fori_loop(0, (total - pid + programs - 1) // programs, body, tile(pid))


def split_packed_decode(qkv: Float[Array, "B X"], proj: Float[Array, "B P"], dims: tuple[int, int, int, int]):
    """(q, k, v, a, b, z) of one decode token per row from a Gated DeltaNet layer's packed arrays: `qkv`, the
    convolved (activated) q, k, v channels `[HK*K | HK*K | HV*V]` (its first C columns), and `proj`, the in_proj
    output `[C | HV*V (z) | HV (b) | HV (a)]` (`dims = (HK, K, HV, V)`)."""
    hk, dk, hv, dv = dims
    batch, conv = qkv.shape[0], 2 * hk * dk + hv * dv
    q = qkv[:, : hk * dk].reshape(batch, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].reshape(batch, hk, dk)
    v = qkv[:, 2 * hk * dk : conv].reshape(batch, hv, dv)
    z = proj[:, conv : conv + hv * dv].reshape(batch, hv, dv)
    b = proj[:, conv + hv * dv : conv + hv * dv + hv]
    a = proj[:, conv + hv * dv + hv : conv + hv * dv + 2 * hv]
    return q, k, v, a, b, z


def packed_supported(dims: tuple[int, int, int, int]) -> bool:
    """Whether `gated_delta_decode_packed_pallas` reads these heads in place: K and V powers of two from 16 (every
    offset then 16-aligned)."""
    _, dk, _, dv = dims
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


@functools.partial(jax.jit, static_argnames=("dims", "eps", "scale", "num_warps", "num_stages", "programs", "block_v",
                                             "interpret"))
def gated_delta_decode_packed_pallas(
    qkv: Float[Array, "B X"], proj: Float[Array, "B P"], a_log: Float[Array, "HV"], dt_bias: Float[Array, "HV"],
    norm_w: Float[Array, "V"], state: Float[Array, "S HV K V"], slot_ids: Int[Array, "B"], *,
    dims: tuple[int, int, int, int], eps: float, scale: float | None = None, num_warps: int = 4, num_stages: int = 1,
    programs: int | None = None, block_v: int | None = None, interpret: bool = False,
) -> tuple[Float[Array, "B HV V"], Float[Array, "S HV K V"]]:
    """`gated_delta_decode_pallas` on `split_packed_decode(qkv, proj, dims)`, reading the packed arrays in place:
    no slice of them is written to memory first (XLA runs each slice feeding a custom call as a kernel of its
    own: five a layer). `programs`: that many programs (at most one per (row, head) pair) walk the pairs with the
    next state tile loaded ahead (`_persistent_packed_kernel`); None: one program per pair. `block_v` (a power of
    two from 16, below V): a program per `[K, block_v]` block of a head's tile (`_packed_split_kernel`), smaller
    tiles in more programs, with the gated norm after the kernel in jnp (one more launch; the same roundings)."""
    hk, dk, hv, dv = dims
    if not packed_supported(dims):
        raise ValueError(f"the packed decode kernel needs K and V powers of two from 16, got {dims=}")
    if qkv.shape[1] < 2 * hk * dk + hv * dv or proj.shape[1] < 2 * hk * dk + 2 * hv * dv + 2 * hv:
        raise ValueError(f"packed shapes {qkv.shape}, {proj.shape} do not hold {dims=}")
    batch = qkv.shape[0]
    scale = dk**-0.5 if scale is None else scale
    if block_v is not None and block_v < dv:
        if block_v < 16 or block_v & (block_v - 1) or programs is not None:
            raise ValueError(f"block_v={block_v} must be a power of two from 16, and not with programs={programs}")
        o, state = pl.pallas_call(
            functools.partial(_packed_split_kernel, dims=dims, block_v=block_v, scale=scale),
            grid=(dv // block_v, hv, batch),
            in_specs=[_WHOLE] * 6,
            out_specs=[pl.BlockSpec((None, None, block_v), lambda c, j, r: (r, j, c)), _WHOLE],
            out_shape=[jax.ShapeDtypeStruct((batch, hv, dv), qkv.dtype),
                       jax.ShapeDtypeStruct(state.shape, state.dtype)],
            input_output_aliases={5: 1},
            interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name=f"gdn_fused_decode_packed_bv{block_v}_w{num_warps}",
        )(slot_ids.astype(jnp.int32), qkv, proj, a_log, dt_bias, state)
        z = split_packed_decode(qkv, proj, dims)[5]
        return _gated_norm(o, z, norm_w, eps), state
    if programs is None:
        kernel = functools.partial(_packed_kernel, dims=dims, scale=scale, eps=eps)
        grid, o_spec, name = (batch, hv), pl.BlockSpec((None, None, dv), lambda r, j: (r, j, 0)), ""
    else:
        programs = max(1, min(programs, batch * hv))
        kernel = functools.partial(_persistent_packed_kernel, dims=dims, programs=programs, scale=scale, eps=eps)
        grid, o_spec, name = (programs,), _WHOLE, f"_p{programs}"
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[_WHOLE, _WHOLE, _WHOLE, _WHOLE, _WHOLE, pl.BlockSpec((dv,), lambda *_: (0,)), _WHOLE],
        out_specs=[o_spec, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((batch, hv, dv), qkv.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={6: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_fused_decode_packed{name}_w{num_warps}",
    )(slot_ids.astype(jnp.int32), qkv, proj, a_log, dt_bias, norm_w, state)


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
