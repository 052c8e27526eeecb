"""The scalar-decay recurrence references (lightning attention / Mamba2) against float64 NumPy ground truth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.simple_gla import (
    chunk_simple_gla,
    chunk_simple_gla_reference,
    fused_recurrent_simple_gla,
    fused_recurrent_simple_gla_reference,
    recurrent_simple_gla_reference,
)


def assert_close(label, got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), f"{label}: NaN in output"
    err = np.abs(got - want).max()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel <= rtol, f"{label}: max abs err {err:.3e}, relative RMS err {rel:.3e} > {rtol}"


def simple_gla_numpy(q, k, v, g, cu, state, slots, scale):
    """Token-by-token float64 S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t, sequence by sequence."""
    num_heads, num_value_heads = q.shape[1], v.shape[1]
    state = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for b in range(len(slots)):
        h = np.zeros(state.shape[1:]) if slots[b] == 0 else state[slots[b]].copy()
        for t in range(cu[b], cu[b + 1]):
            for j in range(num_value_heads):
                src = j // (num_value_heads // num_heads)
                h[j] = np.exp(g[t, j]) * h[j] + np.outer(k[t, src], v[t, j])
                out[t, j] = scale * q[t, src] @ h[j]
        state[slots[b]] = h
    return out, state


def make_inputs(rng, lengths, num_heads, num_value_heads, key_dim, value_dim, num_slots, pad=3, g_max=1.5):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad
    q = rng.normal(size=(num_tokens, num_heads, key_dim)) / np.sqrt(key_dim)
    k = rng.normal(size=(num_tokens, num_heads, key_dim)) / np.sqrt(key_dim)
    v = rng.normal(size=(num_tokens, num_value_heads, value_dim))
    g = -rng.uniform(0.0, g_max, (num_tokens, num_value_heads))
    state = rng.normal(size=(num_slots, num_value_heads, key_dim, value_dim))
    return q, k, v, g, cu, state


CASES = [
    # lengths, H, HV, K, V, g_max (large decays: Mamba2's dt * A reaches tens; exp must underflow, not overflow)
    ([1], 1, 1, 16, 16, 1.5),
    ([64], 2, 2, 16, 32, 0.05),  # lightning-like: small constant-ish decays
    ([1, 63, 130, 5], 2, 4, 8, 16, 1.5),  # grouped (Mamba2 n_groups < heads)
    ([0, 200, 1], 1, 3, 32, 8, 40.0),
]


@pytest.mark.parametrize("form,lengths,h,hv,dk,dv,g_max", [  # fast tier: every form on the grouped case
    pytest.param(form, *case, marks=() if i == 2 else pytest.mark.slow, id=f"{form}-case{i}")
    for form in ["recurrent", "chunk16", "chunk64"] for i, case in enumerate(CASES)])
def test_simple_gla_matches_float64(lengths, h, hv, dk, dv, g_max, form):
    rng = np.random.default_rng(len(lengths) * 7 + dk)
    num_slots = len(lengths) + 3
    q, k, v, g, cu, state = make_inputs(rng, lengths, h, hv, dk, dv, num_slots, g_max=g_max)
    slots = np.arange(1, len(lengths) + 1, dtype=np.int32)[::-1].copy()
    if len(lengths) > 2:
        slots[1] = 0  # a row on the null slot starts from zeros
    scale = 0.7
    want_o, want_state = simple_gla_numpy(q, k, v, g, cu, state, slots, scale)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g)]
    args += [jnp.asarray(cu), jnp.asarray(state, jnp.float32), jnp.asarray(slots)]
    if form == "recurrent":
        fn = lambda *a: recurrent_simple_gla_reference(*a, scale=scale)  # noqa: E731
    else:
        fn = lambda *a: chunk_simple_gla_reference(*a, scale=scale, chunk_size=int(form[5:]))  # noqa: E731
    o, new_state = jax.jit(fn)(*args)
    assert_close(f"{form} output", o[: cu[-1]], want_o[: cu[-1]], 2e-5)
    assert np.all(np.asarray(o)[cu[-1] :] == 0), "padding tokens must produce zeros"
    live = slots[slots != 0]
    assert_close(f"{form} final state", np.asarray(new_state)[live], want_state[live], 2e-5)
    untouched = np.setdiff1d(np.arange(1, num_slots), slots)
    np.testing.assert_array_equal(np.asarray(new_state)[untouched], state.astype(np.float32)[untouched])


def test_fused_recurrent_step_equals_one_token_sequences():
    rng = np.random.default_rng(3)
    q, k, v, g, cu, state = make_inputs(rng, [1, 1, 1, 1], 2, 4, 16, 8, num_slots=6, pad=0)
    slots = np.array([5, 2, 0, 3], np.int32)
    want_o, want_state = simple_gla_numpy(q, k, v, g, cu, state, slots, 1.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    o, new_state = fused_recurrent_simple_gla_reference(f32(q), f32(k), f32(v), f32(g), f32(state), jnp.asarray(slots))
    assert_close("decode output", o, want_o, 1e-5)
    assert_close("decode state", np.asarray(new_state)[[2, 3, 5]], want_state[[2, 3, 5]], 1e-5)
    o2, _ = fused_recurrent_simple_gla(f32(q), f32(k), f32(v), f32(g), f32(state), jnp.asarray(slots), impl="auto")
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))


def test_simple_gla_rejects_bad_shapes_and_impls():
    z = jnp.zeros
    with pytest.raises(ValueError, match="multiple of key heads"):
        recurrent_simple_gla_reference(z((4, 2, 8)), z((4, 2, 8)), z((4, 3, 8)), z((4, 3)), z((2,), int), z((2, 3, 8, 8)), z((1,), int))
    with pytest.raises(ValueError, match="state must be"):
        chunk_simple_gla_reference(z((4, 2, 8)), z((4, 2, 8)), z((4, 2, 8)), z((4, 2)), z((2,), int), z((2, 2, 8, 4)), z((1,), int))
    with pytest.raises(ValueError, match="no Pallas kernel"):
        chunk_simple_gla(z((4, 2, 8)), z((4, 2, 8)), z((4, 2, 8)), z((4, 2)), z((2,), int), z((2, 2, 8, 8)), z((1,), int), impl="pallas")
