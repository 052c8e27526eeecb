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

from pallas_kernels.simple_gla import (
    fused_recurrent_simple_gla,
    fused_recurrent_simple_gla_reference,
)
from tests.test_kernels_pallas import assert_close, lower_for_h200


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
