"""Simple GLA (scalar-decay recurrence: lightning attention, Mamba2) Pallas kernels against the pure-jnp
references: interpret mode on CPU (fp32, random inputs), and lowering for the H200.

Whatever a kernel must not read is NaN: the null slot 0 (rows on it start from zeros), the slots no row
owns (which must also come back bit-identical) and, in the chunk tests, nothing else can be poisoned
because the padding tokens' outputs are checked to be zeros. `lower_for_h200` (tests/test_kernels_pallas.py)
lowers for CUDA under an abstract H200 mesh and checks which Triton kernels the program calls, so a kernel
the Triton lowering rejects fails here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.simple_gla import (
    chunk_simple_gla,
    chunk_simple_gla_reference,
    fused_recurrent_simple_gla,
    fused_recurrent_simple_gla_reference,
)
from tests.test_kernels_pallas import H200, assert_close, assert_triton_kernels, lower_for_h200


def _inputs(rng, num_tokens, h, hv, dk, dv, num_slots, g_max, dtype=jnp.float32):
    """q, k `[T, H, K]` (scaled so that q.k ~ 1), v `[T, HV, V]`, log decays g `[T, HV]` in (-g_max, 0] and a
    random fp32 state `[S, HV, K, V]` (NumPy, for poisoning)."""
    q = jnp.asarray(rng.normal(size=(num_tokens, h, dk)) / np.sqrt(dk), dtype)
    k = jnp.asarray(rng.normal(size=(num_tokens, h, dk)) / np.sqrt(dk), dtype)
    v = jnp.asarray(rng.normal(size=(num_tokens, hv, dv)), dtype)
    g = jnp.asarray(-rng.uniform(0.0, g_max, (num_tokens, hv)), jnp.float32)
    state = rng.normal(size=(num_slots, hv, dk, dv)).astype(np.float32)
    return q, k, v, g, state


def _poison(state, slots):
    """NaN in the null slot and in every slot no row owns; returns those free slots."""
    state[0] = np.nan
    free = np.setdiff1d(np.arange(1, state.shape[0]), slots)
    state[free] = np.nan
    return free


# ---------------------------------------------------------------- decode


DECODE_CASES = [
    # batch, H, HV, K, V, g_max
    (5, 2, 2, 16, 32, 1.5),  # H == HV (lightning attention), two value blocks
    (6, 2, 4, 32, 16, 40.0),  # grouped value heads (Mamba2 groups), decays far past exp underflow
]


@pytest.mark.parametrize("batch,h,hv,dk,dv,g_max", DECODE_CASES)
def test_fused_recurrent_pallas_matches_reference(batch, h, hv, dk, dv, g_max):
    """One decode step, interpret mode vs `fused_recurrent_simple_gla_reference`: outputs of real rows, their
    slots' new states, free slots untouched (NaN-poisoned, compared bit for bit), null-slot rows start from
    zeros (slot 0 is NaN). Checked to fail with the decay dropped from `recurrent_step`, with the null-slot
    zeroing removed (NaN output) and with the key head taken as `j % H` instead of `j // (HV // H)`
    (grouped case)."""
    rng = np.random.default_rng(batch * 10 + dk)
    num_slots = batch + 4
    q, k, v, g, state = _inputs(rng, batch, h, hv, dk, dv, num_slots, g_max)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    slots[1] = slots[-1] = 0  # padded rows on the null slot
    free = _poison(state, slots)
    args = (q, k, v, g, jnp.asarray(state), jnp.asarray(slots))
    want_o, want_state = jax.jit(fused_recurrent_simple_gla_reference, static_argnames="scale")(*args, scale=0.7)
    got_o, got_state = fused_recurrent_simple_gla(*args, impl="pallas", interpret=True, scale=0.7, block_v=16)
    live = slots != 0
    assert_close("decode output", np.asarray(got_o)[live], np.asarray(want_o)[live], 1e-5)
    assert not np.isnan(np.asarray(got_o)).any(), "null-slot rows must start from zeros"
    real = slots[live]
    assert_close("decode state", np.asarray(got_state)[real], np.asarray(want_state)[real], 1e-5)
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])


def test_fused_recurrent_lowers_for_h200():
    """The decode kernel lowers for the H200 at the models' shapes (bf16 lightning q/k/v, fp32 Mamba2 inputs with
    K=128 V=64), calling exactly the one Triton kernel named for its block. Checked to fail with K=96 given to
    `fused_recurrent_simple_gla_pallas` directly ("power of 2": Triton rejects the [96, 32] tile) and with the
    expected kernel name changed to `bv64_w4`."""
    rng = np.random.default_rng(0)
    fn = functools.partial(fused_recurrent_simple_gla, impl="pallas")
    slots = jnp.arange(8, dtype=jnp.int32)
    q, k, v, g, state = _inputs(rng, 8, 4, 4, 128, 128, 9, 1.0, jnp.bfloat16)
    lower_for_h200(fn, q, k, v, g, jnp.asarray(state), slots, kernels=[r"sgla_fused_recurrent_bv32_w4"])
    q, k, v, g, state = _inputs(rng, 8, 2, 8, 128, 64, 9, 1.0, jnp.float32)
    lower_for_h200(functools.partial(fn, block_v=64, num_warps=8), q, k, v, g, jnp.asarray(state), slots,
                   kernels=[r"sgla_fused_recurrent_bv64_w8"])


# ---------------------------------------------------------------- chunked prefill


CHUNK_CASES = [
    # lengths, slots (0: the null slot), H, HV, K, V, chunk size, g_max
    # one-token rows first and last, a ragged 2.5-chunk row, an empty row, exactly one chunk on the null slot
    ([1, 40, 0, 16, 1], [3, 1, 2, 0, 5], 2, 2, 16, 32, 16, 1.5),
    # grouped value heads, a one-token row on the null slot, one chunk + 1 token, decays far past exp underflow
    ([33, 1, 17, 2], [4, 0, 1, 6], 2, 4, 32, 16, 16, 40.0),
]
CHUNK_VARIANTS = {"split": dict(fused_output=False), "fused": dict(fused_output=True)}


@pytest.mark.parametrize("variant", CHUNK_VARIANTS)
@pytest.mark.parametrize("case", range(len(CHUNK_CASES)))
def test_chunk_pallas_matches_reference(case, variant):
    """Chunked prefill over a ragged packed batch (3 padding tokens after cu_seqlens[B]), interpret mode vs
    `chunk_simple_gla_reference`: every token's output (padding tokens exactly zero), the rows' final states,
    free slots untouched bit for bit; slot 0 and the free slots are NaN. Checked to fail with: the inter-chunk
    decay `exp(G_last)` dropped from `_advance` (both variants), the intra-chunk mask made non-causal in
    `_intra_output`, the state-entering-chunk store moved after the update in `_state_kernel` (split only),
    the one-token kernel's state store removed (case 0: rows 0 and 4 keep stale slots), and the key head taken as
    `j % H` (grouped case 1)."""
    lengths, slots, h, hv, dk, dv, c, g_max = CHUNK_CASES[case]
    rng = np.random.default_rng(case)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_slots = max(slots) + 2
    q, k, v, g, state = _inputs(rng, int(cu[-1]) + 3, h, hv, dk, dv, num_slots, g_max)
    slots = np.asarray(slots, np.int32)
    free = _poison(state, slots)
    args = (q, k, v, g, jnp.asarray(cu), jnp.asarray(state), jnp.asarray(slots))
    want_o, want_state = jax.jit(chunk_simple_gla_reference, static_argnames=("scale", "chunk_size"))(
        *args, scale=0.7, chunk_size=c)
    got_o, got_state = chunk_simple_gla(*args, impl="pallas", interpret=True, scale=0.7, chunk_size=c, block_v=16,
                                        out_block_v=16, single_block_v=16, **CHUNK_VARIANTS[variant])
    assert_close("chunk output", got_o, want_o, 1e-5)
    assert np.all(np.asarray(got_o)[cu[-1]:] == 0), "padding tokens must produce zeros"
    live = slots[(slots != 0) & (np.asarray(lengths) > 0)]
    assert_close("chunk final state", np.asarray(got_state)[live], np.asarray(want_state)[live], 1e-5)
    empty = slots[(slots != 0) & (np.asarray(lengths) == 0)]
    np.testing.assert_array_equal(np.asarray(got_state)[empty], state[empty])  # an empty row keeps its state
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])


_SINGLE = r"sgla_chunk_single_bv32_w4"
CHUNK_KERNELS = {
    "split": [r"sgla_chunk_state_c64_bv32_w4_s2", r"sgla_chunk_output_c64_bv64_w4", _SINGLE],
    "fused": [r"sgla_chunk_fused_c64_bv32_w4_s2", _SINGLE],
    "split_x3": [r"sgla_chunk_state_c64_bv32_w4_s2_x3", r"sgla_chunk_output_c64_bv64_w4", _SINGLE],
}


@pytest.mark.parametrize("variant", CHUNK_KERNELS)
def test_chunk_lowers_for_h200(variant):
    """The chunk kernels lower for the H200 at the models' head shapes: bf16 lightning q/k/v (K = V = 128) and
    fp32 Mamba2 inputs (grouped, K=128 state, V=64 head dim), each program calling exactly the named Triton
    kernels in order. Checked to fail with K=96 given to `chunk_simple_gla_pallas` directly (the lowering rejects a
    96-row tile: "power of 2"), with
    chunk_size=48 (ValueError before lowering) and with the single-token kernel's name changed."""
    rng = np.random.default_rng(2)
    tuning = dict(fused_output=variant == "fused", precision="tf32x3" if variant == "split_x3" else "tf32")
    fn = functools.partial(chunk_simple_gla, impl="pallas", **tuning)
    cu, slots = jnp.array([0, 100, 101, 130], jnp.int32), jnp.array([1, 2, 0], jnp.int32)
    for h, hv, dk, dv, dtype in [(4, 4, 128, 128, jnp.bfloat16), (2, 8, 128, 64, jnp.float32)]:
        q, k, v, g, state = _inputs(rng, 136, h, hv, dk, dv, 4, 1.0, dtype)
        lower_for_h200(fn, q, k, v, g, cu, jnp.asarray(state), slots, kernels=CHUNK_KERNELS[variant])


def test_mesh_dispatch_lowers_per_shard():
    """With a 2-device head-splitting mesh, both kernels run per shard under shard_map (a manual region on half
    the heads) and lower for CUDA. Checked to fail with `mesh` ignored by the dispatch (the whole-array kernels then
    do not lower on sharded operands)."""
    mesh = AbstractMesh((2,), ("tp",), abstract_device=H200)

    def sds(shape, dtype, spec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def lower(fn, *shapes, local, kernels):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert_triton_kernels(text, kernels)
        manual = [line for line in text.splitlines() if "manual_computation" in line]
        assert manual and 'manual_axes={"tp"}' in manual[0], "no per-shard region"
        assert local in manual[0], f"per-shard operand {local} not in {manual[0][:400]}"

    t, b, s, h, hv, dk, dv = 64, 4, 5, 4, 8, 64, 32
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    heads = P(None, "tp", None)
    state = sds((s, hv, dk, dv), f32, P(None, "tp", None, None))
    qk, vv, gg = sds((t, h, dk), bf, heads), sds((t, hv, dv), bf, heads), sds((t, hv), f32, P(None, "tp"))
    lower(lambda *a: chunk_simple_gla(*a, impl="pallas", mesh=mesh), qk, qk, vv, gg, sds((b + 1,), i32), state,
          sds((b,), i32), local="tensor<5x4x64x32xf32>", kernels=CHUNK_KERNELS["fused"][:1] + [
              r"sgla_chunk_single_bv32_w4"])  # the default form: the output inside the sequential pass
    qd, vd, gd = sds((b, h, dk), bf, heads), sds((b, hv, dv), bf, heads), sds((b, hv), f32, P(None, "tp"))
    lower(lambda *a: fused_recurrent_simple_gla(*a, impl="pallas", mesh=mesh), qd, qd, vd, gd, state,
          sds((b,), i32), local="tensor<4x2x64xbf16>", kernels=[r"sgla_fused_recurrent_bv32_w4"])
