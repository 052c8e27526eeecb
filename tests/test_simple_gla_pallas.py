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

from pallas_kernels import simple_gla
from pallas_kernels.simple_gla import (
    chunk_mamba2,
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
    # 128-token chunks (the Mamba2 split form's default, `MAMBA2_SPLIT_TUNING`): 2.3 chunks, one token past a chunk
    ([1, 300, 129], [2, 1, 3], 2, 2, 16, 32, 128, 1.5),
]
CHUNK_VARIANTS = {"split": dict(fused_output=False), "fused": dict(fused_output=True),
                  "split_bk16": dict(fused_output=False, state_block_k=16)}  # case 1: K in two blocks


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
    "split_bk32": [r"sgla_chunk_state_c64_bv32_w4_s2_bk32", r"sgla_chunk_output_c64_bv64_w4", _SINGLE],
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
    if variant == "split_bk32":  # the sequential pass in [32, BV] blocks of the state
        tuning["state_block_k"] = 32
    fn = functools.partial(chunk_simple_gla, impl="pallas", **tuning)
    cu, slots = jnp.array([0, 100, 101, 130], jnp.int32), jnp.array([1, 2, 0], jnp.int32)
    for h, hv, dk, dv, dtype in [(4, 4, 128, 128, jnp.bfloat16), (2, 8, 128, 64, jnp.float32)]:
        q, k, v, g, state = _inputs(rng, 136, h, hv, dk, dv, 4, 1.0, dtype)
        lower_for_h200(fn, q, k, v, g, cu, jnp.asarray(state), slots, kernels=CHUNK_KERNELS[variant])


MAMBA2_CHUNK_CASES = [
    # lengths, slots, (Hm, P, G, N), xbc dtype: one-token rows, a ragged row, an empty row, the null slot
    ([1, 40, 0, 16, 1], [3, 1, 2, 0, 5], (4, 16, 2, 16), jnp.float32),
    ([33, 1, 17], [4, 0, 1], (2, 32, 1, 16), jnp.bfloat16),  # one group for every head; bf16 conv output
]


def _mamba2_chunk_inputs(lengths, slots, dims, dtype, seed, gate_width=None):
    """`chunk_mamba2`'s arguments for rows of `lengths` in `slots` (3 padding tokens after them): (args, cu_seqlens,
    the state as numpy, the slots, the free slots `_poison` filled). With `gate_width`, the gate `z` last: an array
    that wide, whose first Hm P columns are the gate (the in_proj output)."""
    heads, head_dim, groups, n = dims
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + 3
    xbc = jnp.asarray(rng.normal(size=(num_tokens, heads * head_dim + 2 * groups * n)), dtype)
    dt = jnp.asarray(rng.uniform(0.01, 0.3, (num_tokens, heads)), jnp.float32)
    g = dt * -jnp.asarray(rng.uniform(0.5, 4.0, heads), jnp.float32)
    d_skip = jnp.asarray(rng.normal(size=heads), jnp.float32)
    state = rng.normal(size=(max(slots) + 2, heads, n, head_dim)).astype(np.float32)
    slots = np.asarray(slots, np.int32)
    free = _poison(state, slots)
    args = (xbc, dt, g, d_skip, jnp.asarray(cu), jnp.asarray(state), jnp.asarray(slots))
    if gate_width is not None:
        args += (jnp.asarray(rng.normal(size=(num_tokens, gate_width)), dtype),)
    return args, cu, state, slots, free


@pytest.mark.parametrize("fused_output", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("gated", [False, True], ids=["y", "gated"])
@pytest.mark.parametrize("case", range(len(MAMBA2_CHUNK_CASES)))
def test_chunk_mamba2_reads_the_conv_output_in_place(case, gated, fused_output):
    """`chunk_mamba2` with the kernels reading x, B and C in the conv output (SiLU, `v = x dt` and the D skip
    inside them) against its parts in jnp around the reference scan: every real token's `y = o + D x` in the
    output dtype, or with the gate (`z`, read from a wider array) `y SiLU(z)` in fp32 (padding tokens exactly
    zero), the rows' final states, free slots untouched; in both forms of the chunk kernels (one pass, or the state
    pass then the parallel output kernel). (Checked to fail with B and C swapped in `_chunk_inputs`, with the D
    skip dropped from the one-token rows, with the step size left out of v in the chunks, and with the gate read one
    head over in the chunks; the split form with the step size left out of the state pass's v, and with the D skip
    dropped from its output kernel.)"""
    lengths, slots, dims, dtype = MAMBA2_CHUNK_CASES[case]
    heads, head_dim, _, _ = dims
    args, cu, state, slots, free = _mamba2_chunk_inputs(lengths, slots, dims, dtype, 10 + case,
                                                        gate_width=heads * head_dim + 7 if gated else None)
    num_tokens = args[0].shape[0]
    out_dtype = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    want_y, want_state = chunk_mamba2(*args, dims=dims, out_dtype=out_dtype, impl="reference", chunk_size=16)
    got_y, got_state = chunk_mamba2(*args, dims=dims, out_dtype=out_dtype, impl="pallas", interpret=True,
                                    chunk_size=16, block_v=16, single_block_v=16, out_block_v=16, fused=True,
                                    fused_output=fused_output)
    assert got_y.dtype == (jnp.float32 if gated else out_dtype) and got_y.shape == (num_tokens, heads, head_dim)
    rtol = 1e-5 if out_dtype == jnp.float32 else 1e-2
    real = int(cu[-1])
    assert_close("mamba2 chunk output", got_y[:real], want_y[:real], rtol)
    assert np.all(np.asarray(got_y, np.float32)[real:] == 0), "padding tokens must produce zeros"
    live = slots[(slots != 0) & (np.asarray(lengths) > 0)]
    # (a bf16 conv output scans in bf16, `MAMBA2_SCAN_DTYPE` "auto": its states within bf16 rounding)
    state_rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert_close("mamba2 chunk final state", np.asarray(got_state)[live], np.asarray(want_state)[live], state_rtol)
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])


@pytest.mark.parametrize("fused", [True, False], ids=["in_place", "parts"])
def test_chunk_mamba2_state_pass_in_key_blocks(fused):
    """The split form's sequential pass in `[16, BV]` blocks of a 32-wide state (`state_block_k`), reading B in place
    from the conv output or from the parts' array: outputs and final states against the reference. Checked to fail
    with every key block reading B's first 16 columns (the in-place form's `k_slice` offset dropped) and with the
    blocks' states stored at key block 0."""
    lengths, slots, dims = [1, 40, 0, 16, 1], [3, 1, 2, 0, 5], (4, 16, 2, 32)
    args, cu, state, slots, free = _mamba2_chunk_inputs(lengths, slots, dims, jnp.float32, 21)
    want_y, want_state = chunk_mamba2(*args, dims=dims, out_dtype=jnp.float32, impl="reference", chunk_size=16)
    got_y, got_state = chunk_mamba2(*args, dims=dims, out_dtype=jnp.float32, impl="pallas", interpret=True,
                                    chunk_size=16, block_v=16, single_block_v=16, out_block_v=16, fused=fused,
                                    fused_output=False, state_block_k=16)
    real = int(cu[-1])
    assert_close("mamba2 chunk output", got_y[:real], want_y[:real], 1e-5)
    live = slots[(slots != 0) & (np.asarray(lengths) > 0)]
    assert_close("mamba2 chunk final state", np.asarray(got_state)[live], np.asarray(want_state)[live], 1e-5)
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])


def _pallas_operand_dtypes(fn, *args) -> list:
    """The dtypes of every operand of every `pallas_call` in `fn`'s jaxpr (nested jaxprs included)."""
    from jax.extend.core import jaxprs_in_params

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.extend(v.aval.dtype for v in eqn.invars)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("fused_output", [True, False], ids=["fused", "split"])
def test_chunk_mamba2_scan_in_bf16(fused_output):
    """`scan_dtype="bfloat16"` (`MAMBA2_SCAN_DTYPE`): the parts' Pallas scan takes B, C and v in bf16, in both forms
    of the chunk kernel, and stays within bf16 rounding of the fp32 reference: every real token's gated output and
    the rows' final states (rtol 2e-2; free slots untouched). The jnp scans ignore it (bit-identical to fp32).
    Checked to fail with the cast left out of `chunk_mamba2_in_parts` (no bf16 operand reaches the kernel), and with
    the jnp scans given bf16 operands too."""
    lengths, slots, dims, _ = MAMBA2_CHUNK_CASES[0]
    args, cu, state, slots, free = _mamba2_chunk_inputs(lengths, slots, dims, jnp.bfloat16, 21,
                                                        gate_width=dims[0] * dims[1])
    want_y, want_state = chunk_mamba2(*args, dims=dims, out_dtype=jnp.bfloat16, impl="reference", chunk_size=16)
    ref_bf16 = chunk_mamba2(*args, dims=dims, out_dtype=jnp.bfloat16, impl="reference", chunk_size=16,
                            scan_dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(ref_bf16[0]), np.asarray(want_y))
    fn = functools.partial(chunk_mamba2, dims=dims, out_dtype=jnp.bfloat16, impl="pallas", interpret=True,
                           chunk_size=16, block_v=16, single_block_v=16, out_block_v=16, fused=False,
                           fused_output=fused_output, scan_dtype="bfloat16")
    assert jnp.dtype(jnp.bfloat16) in _pallas_operand_dtypes(fn, *args), "the kernel must take bf16 operands"
    got_y, got_state = fn(*args)
    real = int(cu[-1])
    assert_close("mamba2 bf16 scan output", got_y[:real], want_y[:real], 2e-2)
    live = slots[(slots != 0) & (np.asarray(lengths) > 0)]
    assert_close("mamba2 bf16 scan final state", np.asarray(got_state)[live], np.asarray(want_state)[live], 2e-2)
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])
    with pytest.raises(ValueError, match="scan_dtype"):
        chunk_mamba2(*args, dims=dims, out_dtype=jnp.bfloat16, impl="reference", scan_dtype="float16")


@pytest.mark.parametrize("fused_output", [True, False], ids=["fused", "split"])
def test_chunk_mamba2_in_place_form_scans_in_bf16_as_the_parts_do(fused_output):
    """The in-place form (`fused=True`) with `scan_dtype="bfloat16"` rounds B, C, v, the per-chunk states and the
    scan's output as the parts' bf16 scan does: interpreted, both give the same gated output and final states bit
    for bit, and its kernels' dots take bf16. Checked to fail with the in-place form's dots left in fp32, with its
    output o not rounded before the D skip, and with the one-token rows' operands not rounded (each leaves outputs
    a bf16 rounding apart)."""
    lengths, slots, dims, _ = MAMBA2_CHUNK_CASES[0]
    args, cu, state, slots, free = _mamba2_chunk_inputs(lengths, slots, dims, jnp.bfloat16, 23,
                                                        gate_width=dims[0] * dims[1])
    common = dict(dims=dims, out_dtype=jnp.bfloat16, impl="pallas", interpret=True, chunk_size=16, block_v=16,
                  single_block_v=16, out_block_v=16, fused_output=fused_output, scan_dtype="bfloat16")
    want_y, want_state = chunk_mamba2(*args, fused=False, **common)
    in_place = functools.partial(chunk_mamba2, fused=True, **common)
    got_y, got_state = in_place(*args)
    real = int(cu[-1])
    np.testing.assert_array_equal(np.asarray(got_y[:real], np.float32), np.asarray(want_y[:real], np.float32))
    live = slots[(slots != 0) & (np.asarray(lengths) > 0)]
    np.testing.assert_array_equal(np.asarray(got_state)[live], np.asarray(want_state)[live])
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])
    assert jnp.dtype(jnp.bfloat16) in _pallas_kernel_dot_dtypes(in_place, *args), "the kernels' dots must be bf16"


def _pallas_kernel_dot_dtypes(fn, *args) -> set:
    """The operand dtypes of every dot inside every `pallas_call` kernel of `fn`'s jaxpr."""
    from jax.extend.core import jaxprs_in_params

    found = set()

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            if inside and eqn.primitive.name == "dot_general":
                found.update(v.aval.dtype for v in eqn.invars)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub, inside or eqn.primitive.name == "pallas_call")

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return found


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_chunk_mamba2_scan_dtype_follows_the_activations(dtype, monkeypatch):
    """The default `MAMBA2_SCAN_DTYPE` ("auto") gives the parts' Pallas scan B, C and v in the conv output's dtype:
    bf16 operands for a bf16 model, none for an fp32 one. Checked to fail with "auto" resolved to fp32 always, and
    to bf16 always."""
    from pallas_kernels import simple_gla

    monkeypatch.setattr(simple_gla, "MAMBA2_SCAN_DTYPE", "auto")
    lengths, slots, dims, _ = MAMBA2_CHUNK_CASES[0]
    args, *_ = _mamba2_chunk_inputs(lengths, slots, dims, dtype, 22)
    fn = functools.partial(chunk_mamba2, dims=dims, out_dtype=dtype, impl="pallas", interpret=True, chunk_size=16,
                           block_v=16, single_block_v=16, out_block_v=16, fused=False)
    has_bf16 = jnp.dtype(jnp.bfloat16) in _pallas_operand_dtypes(fn, *args)
    assert has_bf16 == (dtype == jnp.bfloat16)


def _lower_mamba2_step(fused: bool, kernels: list[str]) -> None:
    """`chunk_mamba2` lowered for the H200 at NemotronH's head shapes (Hm 64, P 64, G 8, N 128; bf16 conv output) in
    a 136-token step (rows of 100, 1 and 29 tokens); it must launch exactly `kernels`."""
    heads, head_dim, groups, n = dims = (64, 64, 8, 128)
    f32 = jnp.float32
    t = 136
    xbc = jax.ShapeDtypeStruct((t, heads * head_dim + 2 * groups * n), jnp.bfloat16)
    fn = functools.partial(chunk_mamba2, dims=dims, out_dtype=jnp.bfloat16, impl="pallas", fused=fused)
    lower_for_h200(fn, xbc, jnp.zeros((t, heads), f32), jnp.zeros((t, heads), f32), jnp.zeros(heads, f32),
                   jnp.array([0, 100, 101, 130], jnp.int32), jnp.zeros((4, heads, n, head_dim), f32),
                   jnp.array([1, 2, 0], jnp.int32), kernels=kernels)


def test_chunk_mamba2_lowers_for_h200():
    """The in-place Mamba2 form: the fused pass and the one-token rows' kernel, and nothing else; the pass at
    `MAMBA2_PREFILL_TUNING`'s 8 warps where none is given (checked to fail with that default not applied: the
    kernel's own 4)."""
    _lower_mamba2_step(True, [r"mamba2_chunk_fused_c64_bv32_w8_s2", r"mamba2_chunk_single_bv32_w4"])


@pytest.mark.parametrize("split_from, kernels", [
    (0, [r"sgla_chunk_fused_c64_bv32_w4_s2", r"sgla_chunk_single_bv32_w4"]),
    (136, [r"sgla_chunk_state_c128_bv32_w4_s2", r"sgla_chunk_output_c128_bv64_w8", r"sgla_chunk_single_bv32_w4"]),
    (137, [r"sgla_chunk_fused_c64_bv32_w4_s2", r"sgla_chunk_single_bv32_w4"]),
    ("in place 136", [r"mamba2_chunk_state_c64_bv32_w8_s2", r"mamba2_chunk_output_c64_bv64_w8",
                      r"mamba2_chunk_single_bv32_w4"]),
    ("in place 137", [r"mamba2_chunk_fused_c64_bv32_w8_s2", r"mamba2_chunk_single_bv32_w4"]),
])
def test_chunk_mamba2_takes_the_split_form_from_a_step_size(monkeypatch, split_from, kernels):
    """The chunk kernels run their split form in steps of at least `MAMBA2_SPLIT_FROM_TOKENS` tokens (here a
    136-token step), the one-pass form below it and when it is 0: the parts' kernel, and the in-place form's. The
    parts' split form at `MAMBA2_SPLIT_TUNING`'s default (128-token chunks, the output kernel at 8 warps), the
    in-place form at 64-token chunks. Checked to fail with the threshold ignored, with the split tuning's chunk
    size given to the in-place form too, and with JHYBRID_MAMBA2_SPLIT_TUNING='{}' (the old 64-token chunks)."""
    in_place = isinstance(split_from, str)
    monkeypatch.setattr(simple_gla, "MAMBA2_SPLIT_FROM_TOKENS", int(str(split_from).split()[-1]))
    _lower_mamba2_step(in_place, kernels)


@pytest.mark.parametrize("split_from, kernels", [
    (136, [r"sgla_chunk_state_c128_bv32_w4_s2", r"sgla_chunk_output_c128_bv64_w8", r"sgla_chunk_single_bv32_w4"]),
    (137, [r"sgla_chunk_fused_c64_bv32_w4_s2", r"sgla_chunk_single_bv32_w4"]),
])
def test_chunk_mamba2_split_tuning(monkeypatch, split_from, kernels):
    """`MAMBA2_SPLIT_TUNING` (chunk size and kernel keywords) tunes the parts' split form and nothing else (the
    one-pass form keeps 64-token chunks). Checked to fail with the tuning not applied, and with it applied to both
    forms."""
    monkeypatch.setattr(simple_gla, "MAMBA2_SPLIT_FROM_TOKENS", split_from)
    monkeypatch.setattr(simple_gla, "MAMBA2_SPLIT_TUNING", {"chunk_size": 128, "out_num_warps": 8})
    _lower_mamba2_step(False, kernels)


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


# ---------------------------------------------------------------- Mamba2 decode from the packed arrays


def _mamba2_packed(rng, batch, dims, dtype):
    """The conv's activated fp32 output `[x | B | C]` with NaN columns after it, and an in_proj output `[z | xBC |
    dt]` whose xBC columns are NaN (the kernel reads z and dt there)."""
    h, p, g, n = dims
    conv = h * p + 2 * g * n
    xbc = np.concatenate([rng.normal(size=(batch, conv)), np.full((batch, 16), np.nan)], axis=1)
    proj = np.full((batch, h * p + conv + h), np.nan)
    proj[:, : h * p] = rng.normal(size=(batch, h * p))
    proj[:, h * p + conv :] = rng.normal(size=(batch, h)) - 1.0
    return jnp.asarray(xbc, jnp.float32), jnp.asarray(proj, dtype), h * p + conv


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("batch,dims,dtype", [(4, (4, 32, 2, 16), jnp.float32), (3, (8, 16, 1, 32), jnp.bfloat16)])
def test_mamba2_decode_pallas_matches_fp64(batch, dims, dtype, gated):
    """The Mamba2 decode step in one kernel (`mamba2_decode`, fused: step size, decay, recurrence, D skip, read in
    place from the packed arrays) and its jnp reference, against the recurrence written out in float64 here:
    `S' = exp(dt A) S + B (dt x)^T`, `y = C S' + D x` with `dt = clip(softplus(dt_raw + dt_bias))`. Padded rows on
    the null slot (NaN there) keep nothing, free slots are neither read nor written. `gated`: the output is the
    gated norm's input `y * silu(z)` (fp32, y rounded first). Checked to fail with the kernel's D skip dropped, with
    B and C swapped, with the dt clamp's upper bound ignored, and with the gate's z read from xBC's columns."""
    from pallas_kernels.simple_gla import mamba2_decode, mamba2_decode_reference

    h, p, g, n = dims
    rng = np.random.default_rng(batch * h)
    num_slots = batch + 3
    xbc, proj, dt_offset = _mamba2_packed(rng, batch, dims, dtype)
    dt_bias = jnp.asarray(rng.normal(size=h), jnp.float32)
    a_log = jnp.asarray(rng.uniform(-1.0, 1.5, h), jnp.float32)
    d_skip = jnp.asarray(rng.normal(size=h), jnp.float32)
    state = rng.normal(size=(num_slots, h, n, p)).astype(np.float32)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    slots[1] = 0
    clean = state.copy()
    state[0] = np.nan
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    state[free] = np.nan
    dt_range = (1e-3, 0.9)  # an upper bound some rows reach
    form = dict(dims=dims, dt_offset=dt_offset, dt_range=dt_range, out_dtype=dtype, gated=gated)
    args = (xbc, proj, dt_bias, a_log, d_skip, jnp.asarray(state), jnp.asarray(slots))

    # float64 ground truth
    x64 = np.asarray(xbc, np.float64)
    xs = x64[:, : h * p].reshape(batch, h, p)
    bk = x64[:, h * p : h * p + g * n].reshape(batch, g, n)
    cq = x64[:, h * p + g * n : h * p + 2 * g * n].reshape(batch, g, n)
    dt = np.log1p(np.exp(np.asarray(proj, np.float64)[:, dt_offset:] + np.asarray(dt_bias, np.float64)))
    dt = np.clip(dt, *dt_range)
    want_y = np.zeros((batch, h, p))
    want_state = {}
    for r in range(batch):
        s0 = np.zeros((h, n, p)) if slots[r] == 0 else clean[slots[r]].astype(np.float64)
        for j in range(h):
            grp = j // (h // g)
            s1 = np.exp(dt[r, j] * -np.exp(float(a_log[j]))) * s0[j] + np.outer(bk[r, grp], dt[r, j] * xs[r, j])
            want_y[r, j] = cq[r, grp] @ s1 + float(d_skip[j]) * xs[r, j]
            want_state[(r, j)] = s1
    if gated:  # y rounded to the activations' dtype, times silu(z)
        z = np.asarray(proj, np.float64)[:, : h * p].reshape(batch, h, p)
        want_y = np.asarray(jnp.asarray(want_y, dtype), np.float64) * z / (1 + np.exp(-z))
    live = slots != 0
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, (y, new_state) in {
        "reference": jax.jit(functools.partial(mamba2_decode_reference, **form))(*args),
        "fused kernel": mamba2_decode(*args, **form, impl="pallas", interpret=True, fused=True, block_p=16),
        "parts (Pallas recurrence)": mamba2_decode(*args, **form, impl="pallas", interpret=True, fused=False),
    }.items():
        assert y.dtype == (jnp.float32 if gated else dtype)
        assert_close(f"{name} y", np.asarray(y, np.float64)[live], want_y[live], rtol)
        got = np.stack([np.asarray(new_state)[slots[r], j] for r in range(batch) if live[r] for j in range(h)])
        want = np.stack([want_state[(r, j)] for r in range(batch) if live[r] for j in range(h)])
        assert_close(f"{name} state", got, want, 1e-5)
        np.testing.assert_array_equal(np.asarray(new_state)[free], state[free])


def test_mamba2_decode_lowers_for_h200():
    """At the NemotronH-shaped layer of benchmarks.floors (64 heads of 64, 8 groups, state 128)."""
    from pallas_kernels.simple_gla import mamba2_decode

    dims, dt_offset = (64, 64, 8, 128), 4096 + 6144
    fn = functools.partial(mamba2_decode, dims=dims, dt_offset=dt_offset, dt_range=(0.0, float("inf")),
                           out_dtype=jnp.bfloat16, impl="pallas", fused=True)
    args = [jnp.zeros((8, 6144), jnp.float32), jnp.zeros((8, 4096 + 6144 + 64), jnp.bfloat16),
            jnp.zeros((64,), jnp.float32), jnp.zeros((64,), jnp.float32), jnp.zeros((64,), jnp.float32),
            jnp.zeros((9, 64, 128, 64), jnp.float32), jnp.arange(8, dtype=jnp.int32)]
    lower_for_h200(fn, *args, kernels=[r"mamba2_decode_bp32_w4"])


# ---------------------------------------------------------------- lightning decode from the packed projection


@pytest.mark.parametrize("batch,heads,hd,dtype", [(4, 3, 16, jnp.float32), (2, 2, 32, jnp.bfloat16)])
def test_lightning_decode_pallas_matches_fp64(batch, heads, hd, dtype):
    """The lightning decode step in one kernel (`lightning_decode`, fused: SiLU of the packed q | k | v per head,
    the head's fixed decay, the recurrence) and its jnp reference, against float64 written out here: `S' =
    exp(-slope) S + k v^T`, `o = q S'`; the gate's columns after the qkv are NaN (never read). Padded rows on the
    null slot keep nothing, free slots are untouched. Checked to fail with the kernel's k and v offsets swapped, and
    with the decay's sign flipped."""
    from pallas_kernels.simple_gla import lightning_decode, lightning_decode_reference

    rng = np.random.default_rng(heads * hd)
    num_slots = batch + 2
    qkv = rng.normal(size=(batch, 3 * heads * hd))
    proj = jnp.asarray(np.concatenate([qkv, np.full((batch, heads * hd), np.nan)], axis=1), dtype)
    slopes = jnp.asarray(rng.uniform(0.05, 1.0, heads), jnp.float32)
    state = rng.normal(size=(num_slots, heads, hd, hd)).astype(np.float32)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    slots[-1] = 0
    clean = state.copy()
    state[0] = np.nan
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    state[free] = np.nan
    args = (proj, slopes, jnp.asarray(state), jnp.asarray(slots))
    form = dict(num_heads=heads, head_dim=hd)

    act = np.asarray(proj, np.float64)[:, : 3 * heads * hd]
    act = (act / (1 + np.exp(-act))).astype(np.float32 if dtype == jnp.float32 else np.float64)
    act = np.asarray(jnp.asarray(act, dtype), np.float64).reshape(batch, heads, 3, hd)  # SiLU rounded as the model
    want_o, want_s = np.zeros((batch, heads, hd)), {}
    for r in range(batch):
        for j in range(heads):
            s0 = np.zeros((hd, hd)) if slots[r] == 0 else clean[slots[r], j].astype(np.float64)
            s1 = np.exp(-float(slopes[j])) * s0 + np.outer(act[r, j, 1], act[r, j, 2])
            want_o[r, j], want_s[(r, j)] = act[r, j, 0] @ s1, s1
    live = slots != 0
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, (o, new_state) in {
        "reference": jax.jit(functools.partial(lightning_decode_reference, **form))(*args),
        "fused kernel": lightning_decode(*args, **form, impl="pallas", interpret=True, fused=True, block_v=16),
        "parts (Pallas recurrence)": lightning_decode(*args, **form, impl="pallas", interpret=True, fused=False),
    }.items():
        assert o.dtype == dtype
        assert_close(f"{name} o", np.asarray(o, np.float64)[live], want_o[live], rtol)
        got = np.stack([np.asarray(new_state)[slots[r], j] for r in range(batch) if live[r] for j in range(heads)])
        want = np.stack([want_s[(r, j)] for r in range(batch) if live[r] for j in range(heads)])
        assert_close(f"{name} state", got, want, 1e-5 if dtype == jnp.float32 else 1e-3)
        np.testing.assert_array_equal(np.asarray(new_state)[free], state[free])


def test_lightning_decode_lowers_for_h200():
    """At the MiniMax-shaped layer of benchmarks.floors (16 heads of 128)."""
    from pallas_kernels.simple_gla import lightning_decode

    fn = functools.partial(lightning_decode, num_heads=16, head_dim=128, impl="pallas", fused=True)
    args = [jnp.zeros((8, 4 * 16 * 128), jnp.bfloat16), jnp.zeros((16,), jnp.float32),
            jnp.zeros((9, 16, 128, 128), jnp.float32), jnp.arange(8, dtype=jnp.int32)]
    lower_for_h200(fn, *args, kernels=[r"lightning_decode_bv32_w4"])
