"""`linear` pads a dot of few rows to a GEMM's size (jhybrid/models/quant.py, `MIN_GEMM_MACS`; issue 20).

XLA's GPU simplifier turns a dot of fewer than ~10M multiply-adds into an elementwise product over the whole weight
plus a reduction; at batch-1 decode that was every 4096 x 2048 out projection, 0.45 ms of a 2.5 ms token on the H200
(`python3 -m benchmarks.device_loop --small-dots` shows which shapes it rewrites). These tests check the padding is
there for such a dot and absent where it is not needed, and that the rows it returns are the plain product's.
Checked to fail: with `_gemm_rows` returning `m` (no padding) `test_one_row_big_weight_is_padded` fails, and with the
padded product not sliced back `test_padded_rows_equal_the_plain_product` fails on its shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.models import quant
from jhybrid.models.quant import _gemm_rows, linear


def _padded_rows(x, w) -> int | None:
    """The rows of the dot `linear` runs for x @ w, when more than x's (None: not padded)."""
    # a new function each call: make_jaxpr caches a function's trace, which would hide a changed MIN_GEMM_MACS
    eqns = jax.make_jaxpr(lambda a, b: linear(a, b))(x, w).jaxpr.eqns
    (dot,) = [e for e in eqns if e.primitive.name == "dot_general"]
    rows = dot.invars[0].aval.shape[0]
    return rows if rows > x.shape[0] else None


@pytest.mark.parametrize("m,k,n", [(1, 4096, 2048), (1, 2048, 2048), (2, 2048, 2048)])
def test_one_row_big_weight_is_padded(m, k, n):
    x, w = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    rows = _padded_rows(x, w)
    assert rows is not None and rows * k * n > quant.MIN_GEMM_MACS


@pytest.mark.parametrize("m,k,n", [(1, 2048, 11264), (4, 4096, 2048), (1, 64, 32), (1, 2048, 32)])
def test_no_padding_where_the_dot_is_big_enough_or_the_weight_small(m, k, n):
    x, w = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    assert _padded_rows(x, w) is None
    assert _gemm_rows(m, k, n) == m


def test_switch_off(monkeypatch):
    monkeypatch.setattr(quant, "MIN_GEMM_MACS", 0)
    x, w = jnp.zeros((1, 4096), jnp.bfloat16), jnp.zeros((4096, 2048), jnp.bfloat16)
    assert _padded_rows(x, w) is None


def test_padded_rows_equal_the_plain_product():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    w = (rng.standard_normal((4096, 1024)) / 64).astype(np.float32)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), jnp.asarray(w)))
    assert got.shape == (1, 1024)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
