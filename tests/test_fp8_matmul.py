"""The block-wise FP8 matmul (pallas_kernels/fp8_matmul): its jnp reference against float64 ground truth made
here with ml_dtypes' FP8 rounding, the Pallas kernel (interpret mode) against the reference for every
variant (split-K, activations quantized in or before the kernel, padded M and N), the weight quantizer's
rounding bound and round trip, the dispatch between W8A8 and W8A16, and lowering for the H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8_matmul import (
    BLOCK,
    DEQUANT_MIN_ROWS,
    block_config,
    dequantize_weight,
    fp8_matmul,
    fp8_matmul_pallas,
    fp8_matmul_reference,
    quantize_weight,
)
from tests.test_kernels_pallas import assert_close, lower_for_h200

E4M3 = ml_dtypes.float8_e4m3fn


def _inputs(m, k, n, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)) * rng.uniform(0.1, 10.0, size=(m, 1))  # rows of different magnitudes
    w = rng.normal(size=(k, n)) * 0.05
    w[: BLOCK, : min(n, 7)] *= 40.0  # one block of large weights: its scale differs from the others'
    return jnp.asarray(x, dtype), jnp.asarray(w, jnp.float32)


def _ground_truth(x, q, scale, n):
    """float64 `x @ W` of the W8A8 scheme, independent of the package: activations rounded to e4m3 by ml_dtypes
    per row and 128-group (scale amax / 448 in float32), the weight's FP8 values times their block scales."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    groups = x.reshape(m, k // BLOCK, BLOCK)
    s_x = np.maximum(np.abs(groups).max(-1), np.float32(1e-12)) / np.float32(448.0)  # float32, as the scheme
    x_q = (groups / s_x[..., None]).astype(E4M3).astype(np.float64) * s_x[..., None]
    w = np.asarray(q).astype(np.float64) * np.repeat(np.repeat(np.asarray(scale, np.float64), BLOCK, 0), BLOCK, 1)
    return x_q.reshape(m, k) @ w[:n].T


@pytest.mark.parametrize("m,k,n", [(1, 128, 128), (5, 384, 200), (33, 256, 300)])
def test_reference_is_w8a8_in_float64(m, k, n):
    """The reference equals the float64 ground truth (1e-6), and is not the product with unquantized
    activations (which it was seen to be under jit on the H200, where XLA dropped the float32 -> FP8 -> float32
    round trip before `to_fp8` kept it; on CPU the second assertion catches a reference without it)."""
    x, w = _inputs(m, k, n)
    q, scale = quantize_weight(w)
    want = _ground_truth(x, q, scale, n)
    for label, fn in (("eager", fp8_matmul_reference), ("jit", jax.jit(fp8_matmul_reference, static_argnums=3))):
        assert_close(f"reference {label} vs float64", fn(x, q, scale, n), want, 1e-6)
    unquantized = np.asarray(x, np.float64) @ np.asarray(dequantize_weight(q, scale, n), np.float64)
    rel = np.linalg.norm(want - unquantized) / np.linalg.norm(want)
    assert rel > 1e-3, f"activation rounding changed the product by only {rel:.1e}"


def test_weight_quantization_rounds_to_e4m3_and_round_trips():
    """Each weight is within FP8 rounding of its block's grid (|w - w8| <= 2^-4 |w| + 2^-10 scale: 3 mantissa
    bits, half the subnormal step), N is padded with zero rows, a block of zeros stays zeros (no NaN), and
    quantizing the dequantized weight gives back the same bytes and scales (what an FP8 checkpoint's weights go
    through at load: `jhybrid.models.quant`). Checked to fail with the weights rounded to e5m2 instead."""
    k, n = 384, 200
    _, w = _inputs(1, k, n)
    w = w.at[BLOCK:2 * BLOCK, :].set(0.0)  # a zero block row
    q, scale = quantize_weight(w)
    assert q.shape == (256, k) and q.dtype == jnp.float8_e4m3fn and scale.shape == (2, 3)
    deq = np.asarray(dequantize_weight(q, scale, n), np.float64)
    step = np.repeat(np.repeat(np.asarray(scale, np.float64), BLOCK, 0), BLOCK, 1)[:n].T
    err = np.abs(deq - np.asarray(w, np.float64))
    assert (err <= 2**-4 * np.abs(np.asarray(w)) + 2**-10 * step + 1e-12).all()
    assert not np.isnan(deq).any() and (deq[BLOCK:2 * BLOCK] == 0).all()
    assert (np.asarray(q)[n:].astype(np.float32) == 0).all()
    q2, scale2 = quantize_weight(jnp.asarray(deq, jnp.float32))
    assert np.array_equal(np.asarray(q2).view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_allclose(np.asarray(scale2), np.asarray(scale), rtol=1e-6)


KERNEL_CASES = [
    pytest.param(1, 256, 128, dict(block_n=64), id="M1"),
    pytest.param(5, 640, 200, dict(block_n=32, split_k=None), id="split-auto-padded-N"),
    pytest.param(17, 384, 256, dict(block_n=128, split_k=2, prequantized=True), id="split2-prequantized"),
    pytest.param(70, 256, 384, dict(block_m=64, block_n=128, prequantized=True), id="padded-M"),
    pytest.param(16, 512, 128, dict(block_n=64, split_k=3), id="uneven-splits", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("m,k,n,kw", KERNEL_CASES)
def test_kernel_matches_reference(m, k, n, kw):
    """The Pallas kernel in interpret mode against the reference (fp32 activations, so the comparison is not
    hidden by bf16 output rounding): relative error <= 1e-5. Checked to fail (was seen to) with the weight
    scale of the wrong block row (the scale's index map returning block row 0: the three cases with N > 128)."""
    x, w = _inputs(m, k, n, seed=m)
    q, scale = quantize_weight(w)
    got = fp8_matmul_pallas(x, q, scale, n=n, interpret=True, **kw)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert_close(f"kernel {kw}", got, fp8_matmul_reference(x, q, scale, n), 1e-5)


def test_dispatch_w8a8_below_the_row_threshold_w8a16_above():
    """Below `DEQUANT_MIN_ROWS` rows `fp8_matmul` is the W8A8 reference (on CPU); from it on, the weight
    dequantized to the activations' dtype times the activations as they are. The two differ by the
    activations' rounding, so a swapped threshold fails."""
    k, n = 256, 128
    x, w = _inputs(DEQUANT_MIN_ROWS, k, n, seed=3)
    q, scale = quantize_weight(w)
    w8a16 = np.asarray(x, np.float64) @ np.asarray(dequantize_weight(q, scale, n), np.float64)
    assert_close("W8A16 rows", fp8_matmul(x, q, scale, n=n), w8a16, 1e-6)
    small = x[: DEQUANT_MIN_ROWS - 1]
    assert_close("W8A8 rows", fp8_matmul(small, q, scale, n=n), _ground_truth(small, q, scale, n), 1e-6)
    rel = np.linalg.norm(w8a16[:-1] - _ground_truth(small, q, scale, n)) / np.linalg.norm(w8a16[:-1])
    assert rel > 1e-3
    with pytest.raises(ValueError, match="impl"):
        fp8_matmul(small, q, scale, n=n, impl="triton")


@pytest.mark.parametrize("m", [1, 64])
def test_kernel_lowers_for_h200(m):
    """The kernel configurations `fp8_matmul` picks lower for the H200 at the 2.2 B model's widest K (5632:
    44 K blocks, not a power of two) with a padded N; one Triton kernel each (the split-K sum and the
    activation quantization are XLA's)."""
    cfg = block_config(m)
    x = jnp.zeros((m, 5632), jnp.bfloat16)
    q, scale = jnp.zeros((2048, 5632), jnp.float8_e4m3fn), jnp.ones((16, 44), jnp.float32)
    lower_for_h200(functools.partial(fp8_matmul_pallas, n=2000, **cfg), x, q, scale,
                   kernels=[rf"fp8_matmul_bm\d+_bn{cfg['block_n']}_s\d+_q_w4_st3"])
