"""The pure-jnp kernel references against float64 NumPy ground truth written independently here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    chunk_gated_delta_rule_reference,
    paged_attention_reference,
    recurrent_gated_delta_rule_reference,
    write_kv_pages,
)
from pallas_kernels.gated_delta_rule import fused_recurrent_gated_delta_rule_reference


def assert_close(label, got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), f"{label}: NaN in output"
    err = np.abs(got - want).max()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel <= rtol, f"{label}: max abs err {err:.3e}, relative RMS err {rel:.3e} > {rtol}"


# ---------------------------------------------------------------- gated delta rule


def gdn_numpy(q, k, v, g, beta, cu, state, slots):
    """Token-by-token float64 gated delta rule, sequence by sequence."""
    num_heads, num_value_heads, key_dim = q.shape[1], v.shape[1], q.shape[2]
    state = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for b in range(len(slots)):
        h = np.zeros(state.shape[1:]) if slots[b] == 0 else state[slots[b]].copy()
        for t in range(cu[b], cu[b + 1]):
            for j in range(num_value_heads):
                kh = k[t, j // (num_value_heads // num_heads)]
                qh = q[t, j // (num_value_heads // num_heads)] * key_dim**-0.5
                h[j] *= np.exp(g[t, j])
                h[j] += np.outer(kh, beta[t, j] * (v[t, j] - kh @ h[j]))
                out[t, j] = qh @ h[j]
        state[slots[b]] = h
    return out, state


def make_gdn_inputs(rng, lengths, num_heads, num_value_heads, key_dim, value_dim, num_slots, pad=3):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad

    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit((num_tokens, num_heads, key_dim)), unit((num_tokens, num_heads, key_dim))
    v = rng.normal(size=(num_tokens, num_value_heads, value_dim))
    g = -rng.uniform(0.0, 1.5, (num_tokens, num_value_heads))
    beta = rng.uniform(0.0, 1.0, (num_tokens, num_value_heads))
    state = rng.normal(size=(num_slots, num_value_heads, key_dim, value_dim))
    return q, k, v, g, beta, cu, state


GDN_CASES = [
    # lengths, H, HV, K, V
    ([1], 1, 1, 16, 16),
    ([64], 2, 2, 16, 32),
    ([1, 63, 130, 5], 2, 4, 8, 16),
    ([0, 200, 1], 1, 3, 32, 8),
]


@pytest.mark.parametrize("form,lengths,h,hv,dk,dv", [  # fast tier: every form on the ragged GQA case
    pytest.param(form, *case, marks=() if i == 2 else pytest.mark.slow, id=f"{form}-case{i}")
    for form in ["recurrent", "chunk16", "chunk64"] for i, case in enumerate(GDN_CASES)])
def test_gated_delta_rule_matches_float64(lengths, h, hv, dk, dv, form):
    rng = np.random.default_rng(len(lengths) * 7 + dk)
    num_slots = len(lengths) + 3
    q, k, v, g, beta, cu, state = make_gdn_inputs(rng, lengths, h, hv, dk, dv, num_slots)
    slots = np.arange(1, len(lengths) + 1, dtype=np.int32)[::-1].copy()
    if len(lengths) > 2:
        slots[1] = 0  # a row on the null slot starts from zeros
    want_o, want_state = gdn_numpy(q, k, v, g, beta, cu, state, slots)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    args += [jnp.asarray(cu), jnp.asarray(state, jnp.float32), jnp.asarray(slots)]
    if form == "recurrent":
        fn = recurrent_gated_delta_rule_reference
    else:
        fn = lambda *a: chunk_gated_delta_rule_reference(*a, chunk_size=int(form[5:]))  # noqa: E731
    o, new_state = jax.jit(fn)(*args)
    assert_close(f"{form} output", o[: cu[-1]], want_o[: cu[-1]], 2e-5)
    assert np.all(np.asarray(o)[cu[-1] :] == 0), "padding tokens must produce zeros"
    live = slots[slots != 0]
    assert_close(f"{form} final state", np.asarray(new_state)[live], want_state[live], 2e-5)
    untouched = np.setdiff1d(np.arange(1, num_slots), slots)
    np.testing.assert_array_equal(np.asarray(new_state)[untouched], state.astype(np.float32)[untouched])


def test_fused_recurrent_step_equals_one_token_sequences():
    rng = np.random.default_rng(3)
    lengths = [1, 1, 1, 1]
    q, k, v, g, beta, cu, state = make_gdn_inputs(rng, lengths, 2, 4, 16, 16, num_slots=6, pad=0)
    slots = np.array([5, 2, 0, 3], np.int32)
    want_o, want_state = gdn_numpy(q, k, v, g, beta, cu, state, slots)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    o, new_state = fused_recurrent_gated_delta_rule_reference(
        f32(q), f32(k), f32(v), f32(g), f32(beta), f32(state), jnp.asarray(slots)
    )
    assert_close("decode output", o, want_o, 1e-5)
    assert_close("decode state", np.asarray(new_state)[[2, 3, 5]], want_state[[2, 3, 5]], 1e-5)


def test_gated_delta_rule_rejects_bad_shapes():
    z = jnp.zeros
    with pytest.raises(ValueError, match="multiple of key heads"):
        recurrent_gated_delta_rule_reference(
            z((4, 2, 8)), z((4, 2, 8)), z((4, 3, 8)), z((4, 3)), z((4, 3)), z((2,), int), z((2, 3, 8, 8)), z((1,), int)
        )
    with pytest.raises(ValueError, match="state must be"):
        chunk_gated_delta_rule_reference(
            z((4, 2, 8)), z((4, 2, 8)), z((4, 2, 8)), z((4, 2)), z((4, 2)), z((2,), int), z((2, 2, 8, 4)), z((1,), int)
        )


# ---------------------------------------------------------------- paged attention


def attention_numpy(q, k_seq, v_seq, pos, scale, window=None, soft_cap=None):
    """float64 causal attention of one query over a contiguous key sequence."""
    num_heads, num_kv_heads = q.shape[0], k_seq.shape[1]
    out = np.zeros(q.shape)
    lse = np.zeros(num_heads)
    keys = np.arange(pos + 1)
    if window is not None:
        keys = keys[keys > pos - window]
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        s = k_seq[keys, kv] @ q[h] * scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        m = s.max()
        p = np.exp(s - m)
        out[h] = p @ v_seq[keys, kv] / p.sum()
        lse[h] = m + np.log(p.sum())
    return out, lse


PAGED_CASES = [
    ([1], [1], 4, 4, 64, 16),  # a single token
    ([16, 33], [16, 1], 8, 2, 128, 16),  # exactly one block; decode at a block boundary
    ([300, 7, 129], [45, 7, 1], 16, 2, 256, 16),  # many blocks, ragged tail, GQA 8
    ([40, 5], [40, 5], 6, 3, 64, 8),  # GQA 2
]


@pytest.mark.parametrize("variant,lengths,new,h,kvh,d,bs", [  # fast tier: every variant on the GQA-8 case
    pytest.param(variant, *case, marks=() if i == 2 else pytest.mark.slow, id=f"{variant}-case{i}")
    for variant in ["plain", "window", "softcap"] for i, case in enumerate(PAGED_CASES)])
def test_paged_attention_matches_float64(lengths, new, h, kvh, d, bs, variant):
    rng = np.random.default_rng(sum(lengths) + d)
    max_blocks = max(-(-n // bs) for n in lengths) + 1
    num_pages = 1 + max_blocks * len(lengths) + 2
    k_pages = np.full((num_pages, bs, kvh, d), np.nan, np.float32)  # unread pages poisoned
    v_pages = np.full((num_pages, bs, kvh, d), np.nan, np.float32)
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    seqs_k, seqs_v = [], []
    for b, n in enumerate(lengths):
        nb = -(-n // bs)
        tables[b, :nb] = perm[b * max_blocks : b * max_blocks + nb]
        ks, vs = rng.normal(size=(n, kvh, d)), rng.normal(size=(n, kvh, d))
        seqs_k.append(ks)
        seqs_v.append(vs)
        for pos in range(n - new[b]):  # the cached prefix; the new tokens are written below
            k_pages[tables[b, pos // bs], pos % bs] = ks[pos]
            v_pages[tables[b, pos // bs], pos % bs] = vs[pos]
    token_seq = np.concatenate([[b] * new[b] for b in range(len(lengths))]).astype(np.int32)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, new)]).astype(np.int32)
    slot_mapping = tables[token_seq, positions // bs] * bs + positions % bs
    new_k = np.stack([seqs_k[b][p] for b, p in zip(token_seq, positions)])
    new_v = np.stack([seqs_v[b][p] for b, p in zip(token_seq, positions)])
    q = rng.normal(size=(len(token_seq), h, d))
    window = 5 if variant == "window" else None
    cap = 2.0 if variant == "softcap" else None
    kp, vp = write_kv_pages(jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(new_k, jnp.float32),
                            jnp.asarray(new_v, jnp.float32), jnp.asarray(slot_mapping))
    o, lse = jax.jit(
        lambda *a: paged_attention_reference(*a, sliding_window=window, soft_cap=cap, return_lse=True)
    )(jnp.asarray(q, jnp.float32), kp, vp, jnp.asarray(tables), jnp.asarray(token_seq), jnp.asarray(positions))
    want = [attention_numpy(q[t], seqs_k[b], seqs_v[b], p, d**-0.5, window, cap)
            for t, (b, p) in enumerate(zip(token_seq, positions))]
    assert_close("attention output", o, np.stack([w[0] for w in want]), 1e-5)
    assert_close("attention lse", lse, np.stack([w[1] for w in want]), 1e-5)
