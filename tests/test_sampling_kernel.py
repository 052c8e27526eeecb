"""The Pallas kernel of the sampler's top-k / top-p thresholds (`pallas_kernels.sampling`, issue 19) against the
XLA filter it can replace (`jhybrid.engine.sampling._filter_top_k_top_p`), in interpret mode on the CPU, and its
lowering for the H200 (as tests/test_kernels_pallas.py checks lowering). Small vocabularies (1000-3000, not
multiples of the tile) keep the file within a few seconds of compile per configuration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.engine import sampling
from pallas_kernels.sampling import (
    apply_thresholds,
    order_keys,
    top_k_top_p_thresholds,
    top_k_top_p_thresholds_pallas,
    top_k_top_p_thresholds_reference,
)
from tests.test_kernels_pallas import lower_for_h200


def _rows(rng, vocab: int):
    """Rows that stress the thresholds, with each row's k and top_p: plain random rows, few distinct values (ties
    at both thresholds), mostly -inf (bans / grammar masks; fewer finite tokens than k), neighbouring floats
    (thresholds that differ in the lowest key bits), one all -inf row; k in {0, 1, 5, V, > V} and others,
    top_p in {1.0, 0.9, 1e-6} and others."""
    rows, ks, ps = [], [], []
    k_choices = [0, 1, 5, 50, vocab, vocab + 13]
    p_choices = [1.0, 0.9, 1e-6, 0.5]
    for i in range(12):
        x = rng.standard_normal(vocab).astype(np.float32) * rng.choice([0.5, 4.0])
        if i % 4 == 1:
            x = np.round(x * 2) / 2
        if i % 4 == 2:
            x[rng.random(vocab) < 0.97] = -np.inf
        if i % 4 == 3:
            base = np.float32(rng.standard_normal()).view(np.uint32)
            x = (base + rng.permutation(vocab).astype(np.uint32)).view(np.float32)
        rows.append(x)
        ks.append(k_choices[i % len(k_choices)])
        ps.append(p_choices[(i // 2) % len(p_choices)])
    rows.append(np.full(vocab, -np.inf, np.float32))
    ks.append(5)
    ps.append(0.9)
    return jnp.asarray(np.stack(rows)), jnp.asarray(ks, jnp.int32), jnp.asarray(ps, jnp.float32)


def _assert_same_or_rounding(x, in_top_k, got, want, p, label, tol=1e-5):
    """`got` keeps the tokens `want` keeps, but for tokens on the top-p boundary: a token is kept iff the mass
    above it (the top-k set's softmax) is below p, and where that mass is within `tol` of p (float64 here) the
    kernel's float32 sums, in another order than XLA's, may decide either way (the kernel's documented
    exactness). The top-k set itself must be equal (the caller compares kth exactly)."""
    differ = np.flatnonzero(got != want)
    if not differ.size:
        return
    probs = np.where(in_top_k, np.exp(x.astype(np.float64) - x.max()), 0.0)
    probs /= probs.sum()
    for j in differ:
        above = probs[x > x[j]].sum()
        assert abs(above - p) <= tol, f"{label}: token {j} (logit {x[j]}) kept={got[j]} vs {want[j]}, mass above " \
                                      f"{above:.9f} is not within {tol} of top_p"


def _kept(x):
    return np.isfinite(np.asarray(x))


@pytest.mark.parametrize("vocab, tuning", [
    (1000, dict(block=64, unroll=4, bits=4, skip=True)),
    (2999, dict(block=128, unroll=1, bits=8, table=False)),
], ids=["vocab1000-block64x4-R4-skip", "vocab2999-block128-R8-vector"])
def test_kernel_keeps_the_tokens_of_the_xla_filter(vocab, tuning):
    """The kernel (interpret mode) keeps exactly the tokens of `_filter_top_k_top_p` (the XLA radix passes) and of
    the pure-jnp reference on every row of `_rows`, and its kth equals the reference's wherever a row has a
    finite token; two configurations (4 bits a pass, 4 tiles an iteration, groups skipped by maxima kept in
    memory; 8 bits a pass, maxima kept in registers; fewer bits only compile longer in the interpreter),
    vocabularies with a ragged last tile. Checked to fail with the kernel's last top-k pass dropped
    (`range(1, num_passes - 1)`: ties of the high bits get in), with the top-p target not scaled by Z (`target
    = p`), with the count above the bucket not carried (`above` reset to 0 each top-k pass), and with groups
    skipped whose max key is only the lowest candidate (`needed = ... >= lo + (1 << shift)`, in either form of
    the group maxima: each configuration fails). (The
    padded keys of the last tile left as the keys of the loaded -inf's is not caught, and is harmless: such keys
    only count where the row's -inf tokens are in the top-k set already, and weigh nothing.)"""
    x, k, p = _rows(np.random.default_rng(vocab), vocab)
    want = _kept(jax.jit(sampling._filter_top_k_top_p)(x, k, p))
    kth, pth = top_k_top_p_thresholds_pallas(x, k, p, interpret=True, **tuning)
    got = _kept(apply_thresholds(x, kth, pth))
    ref_kth, ref_pth = top_k_top_p_thresholds_reference(x, k, p)
    in_top_k = np.asarray(order_keys(x) >= ref_kth[:, None])
    for i in range(x.shape[0]):
        _assert_same_or_rounding(np.asarray(x[i]), in_top_k[i], got[i], want[i], float(p[i]), f"row {i}: k={int(k[i])} "
                                 f"p={float(p[i])} {tuning}")
    finite = np.isfinite(np.asarray(x)).any(-1)
    np.testing.assert_array_equal(np.asarray(kth)[finite], np.asarray(ref_kth)[finite])
    np.testing.assert_array_equal(_kept(apply_thresholds(x, ref_kth, ref_pth)), want)
    assert 1 <= got.sum(-1)[finite].min() and got.sum(-1).max() == vocab  # from one token up to all


def test_dispatch_picks_the_reference_off_the_gpu_and_rejects_bad_tuning():
    """`impl="auto"` on the CPU is the reference (the same thresholds); unknown impls and a tile that is not a
    power of two raise ValueError. Checked to fail with "auto" routed to the kernel (no interpret: it raises on
    the CPU) and with the block check removed."""
    x, k, p = _rows(np.random.default_rng(1), 300)
    for got, want in zip(top_k_top_p_thresholds(x, k, p), top_k_top_p_thresholds_reference(x, k, p)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="impl"):
        top_k_top_p_thresholds(x, k, p, impl="triton")
    with pytest.raises(ValueError, match="power-of-two"):
        top_k_top_p_thresholds_pallas(x, k, p, block=1000, interpret=True)


def test_kernel_lowers_for_h200_and_the_engine_switch_selects_it(monkeypatch):
    """The kernel lowers for CUDA under an abstract H200 (`lower_for_h200`: Triton IR, so a non-power-of-two
    block or a primitive the Triton lowering lacks fails here; that helper's own test shows it can fail) at the
    benchmark's shape (64 x 151,936), as exactly one Triton call whose name carries the tuning; and
    `_filter_top_k_top_p` calls it when `TOP_K_TOP_P_IMPL == "pallas"` on a GPU and not with "xla". Checked to
    fail with a `sums[0]` slice in the kernel (no Triton lowering for `slice`), with a constant-returning branch
    of the top-p `cond` (the Triton lowering rejects it), and with the switch ignored."""
    specs = (jnp.zeros((64, 151936), jnp.float32), jnp.zeros(64, jnp.int32), jnp.zeros(64, jnp.float32))
    tuning = dict(block=64, unroll=2, bits=8, num_warps=8, skip=False)
    lower_for_h200(functools.partial(top_k_top_p_thresholds_pallas, **tuning), *specs,
                   kernels=["top_k_top_p_blk64x2_r8_w8_st1"])
    # the default configuration, through the engine's switch
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sampling, "TOP_K_TOP_P_IMPL", "pallas")
    lower_for_h200(lambda *a: sampling._filter_top_k_top_p(*a), *specs, kernels=["top_k_top_p_blk256x4_r4_w4_st1_skipt"])
    monkeypatch.setattr(sampling, "TOP_K_TOP_P_IMPL", "xla")  # a new function: jit's cache ignores the switch
    lower_for_h200(lambda *a: sampling._filter_top_k_top_p(*a), *specs, kernels=[])
